"""The trainer's side of vLLM's weight-transfer API: the policy's weights from trainer rank 0 to every server.

vLLM's RL routes (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config``) drive it:

1. once, ``/init_weight_transfer_engine`` on every server, while the trainer opens the group: one process group
   of the trainer (rank 0) and every worker of every server (ranks after it, server by server);
2. per push, ``/start_weight_update``; ``/update_weights`` with each weight's name, dtype and shape, answered
   once the server has received them all, while the trainer broadcasts them one tensor at a time;
   ``/finish_weight_update`` with the version, which the server then reports at ``/weight_info`` (a server
   that reports the new version has finished, even when its reply was lost on the way: the retry that vLLM
   would refuse is not needed); and ``/reset_prefix_cache`` on every server.

Why the last step: vLLM caches the KV of prompt prefixes keyed by their token ids alone, and nothing in a weight
update clears it. Without the reset every prefix a server saw before (the chat header every prompt shares, a
prompt seen again on the next pass over the data, the earlier turns of a multi-turn trajectory) would be served
from KV that older weights computed: the version check passes, and nothing downstream can undo it. A push ends
only once every server has cleared its cache, so no retry or restart can skip it.

Two transports, the same protocol: ``nccl`` (vLLM's own, GPU to GPU) and ``gloo`` (CPU; vLLM ships none, so
``grpo_lightning.integrations.vllm.gloo`` adds it to the server through a vLLM plugin: the server's environment needs
grpo_lightning installed). The group's time limit bounds every broadcast: a server that dies mid-push stops it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, wait
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.engines.http import ServerClient, ServerError

TRANSPORTS = ("nccl", "gloo")


def gloo_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> tuple[Any, Any]:
    """A gloo process group of its own (not torch.distributed's default one, which the trainer and vLLM keep
    for themselves): ``(store, group)``. Rank 0 hosts the rendezvous store at ``host:port`` (``port`` 0: a free
    one, read back from the store)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore("grpo-weights", store), rank, world_size, timeout)
    return store, group


def gloo_broadcast(group: Any, tensor: Tensor) -> None:
    """``tensor`` from rank 0 to every rank of ``group`` (in place on the receivers)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return s.getsockname()[1]


def address_towards(servers: Sequence[ServerClient]) -> str:
    """This machine's address as the servers reach it: 127.0.0.1 when they all run here, else the address of
    the interface that routes to the first one."""
    from urllib.parse import urlparse

    hosts = [urlparse(s.base_url).hostname or "localhost" for s in servers]
    if all(h in ("localhost", "127.0.0.1", "::1") for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


def background(fn: Any, *args: Any, **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` in a daemon thread: a request left hanging by a failed push never holds up the
    process's exit (a thread pool's workers would)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(err)

    threading.Thread(target=run, daemon=True, name="grpo-weight-transfer").start()
    return future


def held_version(server: ServerClient) -> str | None:
    """The weights version ``server`` reports (``/weight_info``)."""
    return server.get("/weight_info").get("weight_version")


class _Finished(Exception):
    """The server already reports the pushed version: the update is finished."""


def finish_update(server: ServerClient, version: str, held_before: str | None) -> None:
    """``/finish_weight_update`` with ``version``, idempotent by version.

    The call is retried like any request; but when the first call went through and only its reply was lost, vLLM
    refuses the retry (no update is open any more). So before each retry, and after a failure, the server's
    version decides: one that now reports ``version`` (and did not before this push) has finished.
    """

    def finished_already() -> None:
        if version != held_before and held_version(server) == version:
            raise _Finished

    try:
        server.request("POST", "/finish_weight_update", {"weight_version": version}, before_retry=finished_already)
    except _Finished:
        return
    except ServerError:
        try:
            finished_already()
        except _Finished:
            return
        except ServerError:
            pass
        raise


def clear_prefix_cache(server: ServerClient, attempts: int = 5) -> None:
    """Drop every cached prefix on ``server`` (module docstring: why after every push).

    ``reset_running_requests``: a request still running on the server (none of this trainer's: every rank has
    finished sampling before a push; a client that gave up on one leaves it running) is preempted and computed
    again, on the new weights, instead of holding cache blocks that would make the reset fail.
    """
    for attempt in range(attempts):
        if server.post("/reset_prefix_cache?reset_running_requests=true", {}).get("success"):
            return
        time.sleep(0.2 * 2**attempt)
    raise ServerError(
        f"the vLLM server {server} did not clear its prefix cache after {attempts} tries: it would serve KV computed "
        "by the previous weights"
    )


class WeightChannel:
    """Trainer rank 0's link to the servers' weight-transfer engines (see the module docstring)."""

    def __init__(
        self, servers: Sequence[ServerClient], *, transport: str, address: str, port: int, timeout_s: float
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
        self.servers, self.transport, self.timeout_s = list(servers), transport, timeout_s
        self.address, self.port = address, port
        self.group: Any = None
        self._store: Any = None

    def open(self) -> None:
        """Form the group: ask every server to join while this process opens it as rank 0."""
        for server in self.servers:
            # A trainer killed between /start_weight_update and /finish_weight_update leaves the server's update
            # open, and it would refuse the next start; closing it is harmless (everything is pushed next).
            try:
                server.post("/finish_weight_update", {}, retry=False)
            except ServerError:
                pass  # none was open: the usual case
        sizes = [int(s.get("/get_world_size")["world_size"]) for s in self.servers]
        world = 1 + sum(sizes)
        port = self.port or free_port(self.address)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        info = {"master_address": self.address, "master_port": port, "world_size": world}
        if self.transport == "gloo":
            info["timeout_s"] = self.timeout_s
        else:
            info["packed"] = False  # one tensor per broadcast, as the gloo transport does
        joins = [
            background(
                s.post,
                "/init_weight_transfer_engine",
                {"init_info": {**info, "rank_offset": offset}},
                timeout_s=self.timeout_s,
                retry=False,
            )
            for s, offset in zip(self.servers, offsets)
        ]
        forming = background(self._form_group, port, world)
        while not forming.done():  # a server that refuses to join fails now, not at the group's time limit
            if any(j.done() and j.exception() is not None for j in joins):
                raise self._failure(joins, "forming the weight-transfer group", RuntimeError("refused"))
            wait([forming], timeout=0.2)
        if forming.exception() is not None:
            raise self._failure(joins, "forming the weight-transfer group", forming.exception())
        self._settle(joins, "joining the weight-transfer group")

    def _form_group(self, port: int, world: int) -> None:
        if self.transport == "gloo":
            self._store, self.group = gloo_group(self.address, port, 0, world, self.timeout_s)
        else:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            self.group = trainer_init(
                {"master_address": self.address, "master_port": port, "world_size": world}, rank=0
            )

    def push(
        self, weights: Iterable[tuple[str, Tensor]], meta: Sequence[tuple[str, torch.dtype, tuple]], version: int
    ) -> None:
        """Every weight of ``meta`` (name, dtype, shape), taken from ``weights`` in that order, then the servers
        report ``version``."""
        if self.group is None:
            self.open()
        update = {
            "names": [name for name, _, _ in meta],
            "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in meta],
            "shapes": [list(shape) for _, _, shape in meta],
        }
        before = [held_version(s) for s in self.servers]  # tells a finished update whose reply was lost
        self._each("/start_weight_update", {}, "starting the weight update")
        receiving = [
            background(s.post, "/update_weights", {"update_info": update}, timeout_s=self.timeout_s, retry=False)
            for s in self.servers
        ]
        try:
            for (name, tensor), (expected, dtype, shape) in zip(weights, meta, strict=True):
                if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                    raise RuntimeError(f"the weight {name} does not match its announced {expected} {dtype} {shape}")
                if any(r.done() for r in receiving):  # a server stopped receiving: do not wait out the time limit
                    raise RuntimeError(f"a server stopped receiving before {name}")
                self._send(name, tensor, receiving)
        except Exception as err:
            self.group = None  # a broken group cannot be used again
            raise self._failure(receiving, "sending the weights", err) from None
        self._settle(receiving, "receiving the weights")
        finishing = [background(finish_update, s, str(version), held) for s, held in zip(self.servers, before)]
        self._settle(finishing, "finishing the weight update")
        self._settle([background(clear_prefix_cache, s) for s in self.servers], "clearing the prefix cache")

    def _send(self, name: str, tensor: Tensor, receiving: list[Future]) -> None:
        """Broadcast one weight. Over gloo, the broadcast runs in a thread while the servers' requests are watched:
        a server that fails on this very weight (vLLM refusing its name, say) never joins the broadcast, which
        would otherwise block for the whole time limit (``push_timeout_s``) before the server's error is read."""
        if self.transport != "gloo":  # NCCL's broadcast is queued on the stream and returns at once
            self._broadcast(tensor)
            return
        sending = background(self._broadcast, tensor)
        while not sending.done():
            if any(r.done() and r.exception() is not None for r in receiving):
                raise RuntimeError(f"a server failed while receiving {name}")
            wait([sending], timeout=0.05)
        sending.result()

    def _broadcast(self, tensor: Tensor) -> None:
        if self.transport == "gloo":
            gloo_broadcast(self.group, tensor.detach().to("cpu").contiguous())
        else:
            self.group.broadcast(tensor.detach().contiguous(), src=0, stream=torch.cuda.current_stream())

    def _each(self, path: str, body: dict, what: str) -> None:
        self._settle([background(s.post, path, body, timeout_s=self.timeout_s) for s in self.servers], what)

    def _settle(self, futures: list[Future], what: str) -> None:
        for server, future in zip(self.servers, futures):
            try:
                future.result(timeout=self.timeout_s)
            except ServerError as err:
                self.group = None
                raise ServerError(f"{err} ({what})") from None
            except Exception as err:  # noqa: BLE001 - a thread's timeout or a failure of the request itself
                self.group = None
                raise ServerError(f"the vLLM server {server} failed {what}: {type(err).__name__}: {err}") from None

    def _failure(self, futures: list[Future], what: str, err: BaseException) -> ServerError:
        """The error to raise when this side failed: a server's own error if one answered with it (it says which),
        else this side's, naming every server."""
        for future in futures:
            if future.done() and future.exception() is not None:
                return ServerError(f"{future.exception()} ({what})")
        names = ", ".join(map(str, self.servers))
        return ServerError(f"{what} to the vLLM servers {names} failed: {' '.join(str(err).split())[:300]}")

    def close(self) -> None:
        """Leave the group (best effort: a server that is gone needs no goodbye)."""
        if self.group is not None:
            for server in self.servers:
                try:
                    server.post("/shutdown_weight_transfer_engine", timeout_s=10, retry=False)
                except ServerError:
                    pass
        self.group, self._store = None, None
