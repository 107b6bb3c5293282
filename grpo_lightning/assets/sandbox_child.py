"""The program that runs inside the sandbox: sets up isolation, drops privileges, then runs the tests.

``integrations/sandbox/sandbox.py`` passes this file's text to ``python -I -B -c`` in the child it starts. It lives
under ``assets/`` (package data, not one of the package's modules) because it must never be imported: at the top level
it reads its configuration from stdin, mounts file systems and gives up its uid. Reports go to a private duplicate of
the original stdout as JSON lines; fds 0-2 point at /dev/null while user code runs.
"""

import ctypes
import io
import json
import os
import resource
import signal
import sys

cfg = json.loads(sys.stdin.buffer.read())
chan = os.fdopen(os.dup(1), "w", buffering=1)
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC = 1, 2, 4, 8, 32, 4096, 16384


def mount(src, dst, fstype, flags, data=None):
    args = [x.encode() if x else None for x in (src, dst, fstype)]
    if libc.mount(*args, ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        raise OSError(ctypes.get_errno(), "mount " + dst)


def moved(paths, root, target):
    """``paths`` with the hidden install root ``root`` replaced by its bind mount ``target``."""
    return [target + p[len(root) :] if p.startswith(root) else p for p in paths]


work, uid = cfg["workdir"], cfg["uid"]
if cfg["namespaces"]:
    mount("proc", "/proc", "proc", NOSUID | NODEV | NOEXEC)
    for line in open("/proc/self/mountinfo").read().splitlines():
        point, opts = line.split()[4].replace("\\040", " "), line.split()[5].split(",")
        if point.split("/")[1] in ("proc", "sys", "dev"):
            continue
        keep = sum(f for name, f in (("nosuid", NOSUID), ("nodev", NODEV), ("noexec", NOEXEC)) if name in opts)
        try:
            mount(None, point, None, REMOUNT | BIND | RDONLY | keep)
        except OSError:
            pass
    for path, size in (("/tmp", cfg["tmpfs_mb"]), ("/var/tmp", 1), ("/dev/shm", 1)):
        mount("tmpfs", path, "tmpfs", NOSUID | NODEV, f"size={size}m,mode=755")
    os.mkdir(work, 0o700)
    for i, root in enumerate(cfg["hidden_roots"]):
        target = f"/tmp/.python{i}"
        os.mkdir(target, 0o755)
        mount(root, target, None, BIND | REC)
        mount(None, target, None, REMOUNT | BIND | RDONLY)
        sys.path[:] = moved(sys.path, root, target)
        for module in list(sys.modules.values()):
            if isinstance(getattr(module, "__path__", None), list):
                module.__path__[:] = moved(module.__path__, root, target)
for name in cfg["preimport"].split():
    __import__(name)
if uid is not None:
    os.chown(work, uid, uid)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    libc.prctl(1, signal.SIGKILL)
os.chdir(work)
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
if cfg["guards"]:
    BLOCKED = {
        "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "os.fork", "os.forkpty",
        "os.system", "os.posix_spawn", "os.exec", "os.spawn", "subprocess.Popen", "os.kill", "os.killpg",
        "signal.pthread_kill", "pty.spawn",
    }  # fmt: skip
    PATHS = {
        "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
        "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile",
    }  # fmt: skip
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    real_work = os.path.realpath(work)

    def inside(path):
        if isinstance(path, int):
            return True
        path = os.path.realpath(os.path.join(real_work, os.fsdecode(path)))
        return path == real_work or path.startswith(real_work + "/") or path == os.devnull

    def hook(event, args):
        if event in BLOCKED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[0] is not None:
            writes = (isinstance(args[2], int) and args[2] & WRITE) or any(c in (args[1] or "") for c in "wax+")
            if writes and not inside(args[0]):
                raise PermissionError("sandbox: writing outside the work directory")
        if event in PATHS and args and not inside(args[0]):
            raise PermissionError(f"sandbox: {event} outside the work directory")

    sys.addaudithook(hook)


class Stop(BaseException):
    pass


class Sink(io.BytesIO):
    def write(self, data):
        if self.tell() + len(data) > cfg["max_output"]:
            raise Stop("output limit")
        return super().write(data)


active = [False]


def on_alarm(*_):
    if active[0]:
        raise Stop("time limit")


signal.signal(signal.SIGALRM, on_alarm)
me = os.getpid()


def run(compiled, scope, stdin):
    out = Sink()
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(Sink(), encoding="utf-8", write_through=True)
    ok = False
    try:
        try:
            active[0] = True
            signal.setitimer(signal.ITIMER_REAL, cfg["test_timeout"])
            exec(compiled, scope)
            ok = True
        except SystemExit as stop:
            ok = stop.code in (None, 0)
        finally:
            active[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException:
        ok = False
    if os.getpid() != me:
        os._exit(1)
    return ok, out.getvalue().decode("utf-8", "replace")


def report(**fields):
    chan.write(json.dumps(fields) + "\n")
    chan.flush()


report(ready=True)
try:
    program = compile(cfg["code"], "<solution>", "exec")
except BaseException:
    program = None
if cfg["kind"] == "assert":
    scope = {"__name__": "solution"}
    ok = program is not None and run(program, scope, "")[0]
    for i, test in enumerate(cfg["tests"]):
        try:
            report(i=i, ok=ok and run(compile(test, "<test>", "exec"), scope, "")[0])
        except BaseException:
            report(i=i, ok=False)
else:
    for i, stdin in enumerate(cfg["tests"]):
        ok, out = run(program, {"__name__": "__main__"}, stdin) if program else (False, "")
        report(i=i, ok=ok, out=out)
report(done=True)
