"""Where the lean forward's CPU products multiply by oneDNN-packed weights (``models/cpu_packing.py``): only where
it pays on the machine it runs on, measured there once and remembered.

Why a measurement and not thresholds. The figures the packing came from, per instruction set:

- AVX-512 (2-core AMD EPYC): oneDNN's kernels on packed weights ran products of 32 rows by a 256-wide layer's
  weights 1.2–1.5× faster than MKL's ``sgemm`` (decoding steps), of 2016 rows by a 512-wide layer's 1.3–1.4× (the
  teacher's pass), and a reorder cost what the faster products saved over ~350 rows. Hence constants: decoding
  packed weights from 2^16 elements, passes from 512 positions (``tools/bench_distill.py`` 0.70 → 0.65 of TRL's
  time).
- AVX2 (2-core AMD EPYC): with the same constants ``tools/bench_trl.py``'s settings A took 1.31× the time of the
  code before the packing, B 0.94× (issue 55). There the small products of A's 128-wide model gained nothing
  packed, while each reorder still cost its fixed price, in every π_ref pass and every rollout.

One instruction set also runs at different speeds on different CPU generations, so a threshold table per
instruction set would be wrong somewhere. Hence:

- **Per machine and shape class, measured.** The first time a model's products could be packed (decoding steps of
  a given number of rows, rounded up to a power of two; or a pass without gradients) a few products at the model's
  own widths (its first layer's q/k/v, o, gate/up and down) are timed plain and packed, with the reorder
  (``measure``: minima over alternated rounds, ``BUDGET_S`` once ``MIN_ROUNDS`` are done). A group of products is
  packed only where packing wins by ``MARGIN``, reorder included: for decoding steps one reorder per rollout
  against its steps' products, for a pass one reorder per pass against the products over its positions (from the
  ``PASS_ROWS``-row timing; passes below ``PASS_ROWS`` positions are never packed). A measurement whose minima do
  not repeat in ``MEASUREMENTS`` tries (other processes had the cores) decides plain products, and is cached as
  such (delete the file to measure again): a later process must not take another path than the first.
- **Only where oneDNN's float32 kernels were measured**: x86 with AVX2 or AVX-512 (without AMX). Anything else
  (ARM, AVX-512 with AMX, an unknown instruction set) keeps plain products: the safe default.
- **Remembered**: the timings are cached in the user's cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``, under
  ``grpo_lightning/cpu_packing``), one file per CPU model, instruction set, torch version, thread count, model
  widths and shape class, so another CPU or torch version is measured again. The decision is a function of the
  cached timings, so every process on the machine (DDP ranks, a resumed run) takes the same path and gets the same
  numbers. Processes measure one at a time (a lock in that folder: the others wait, then read the file), and a
  file is created whole (written aside, then hard-linked in place: if two processes measured, the first to finish
  wins and the other uses its timings). An unreadable or corrupt file is measured again silently; an unwritable
  folder leaves each process with its own measurement (a warning says so: a resumed run may then round
  differently in the last bits).

``GRPO_LIGHTNING_CPU_PACKING=off`` turns packing off (plain products everywhere); nothing else is a setting. The
test suite sets it (``tests/conftest.py``): no test times anything; tests inject timings instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_lightning.models.cpu_packing import (
    GROUPS,
    PackPlan,
    cpu_weight_packer,
    packed_linear,
    packing_applies,
    product_groups,
    stackable,
    stacked_weight,
)

log = logging.getLogger(__name__)

SWITCH = "GRPO_LIGHTNING_CPU_PACKING"
"""Environment variable: ``off`` (or ``0``, ``false``, ``no``) keeps every product plain."""

MEASURED_INSTRUCTION_SETS = ("AVX2", "AVX512")
"""Where oneDNN's float32 kernels were measured: only there is packing considered at all."""

MARGIN = 0.1
"""Packing is taken where it saves at least this share of the plain products' time, reorder included."""

PASS_ROWS = 512
"""A pass's products are timed at this many rows; passes of fewer positions are never packed (their products are
too small for the reorder to pay, and the timing says nothing below it)."""

CACHE_VERSION = 1
BUDGET_S = 0.4  # one measurement's time, once its ``MIN_ROUNDS`` are done
MIN_ROUNDS, MAX_ROUNDS = 3, 12
REPEATABLE = 1.1  # a minimum counts once a second reading comes within this factor of it
LOCK_WAIT_S = 30.0
MEASUREMENTS = 3  # tries before a measurement that does not repeat decides plain products


class Timing(NamedTuple):
    """Seconds for one product of a group on plain weights (the parts one by one), on packed ones (stacked), and
    for the reorder (stacking included)."""

    plain: float
    packed: float
    reorder: float

    def pays(self, products: float) -> bool:
        """Whether packing wins by ``MARGIN`` over ``products`` products (one reorder for them all)."""
        return self.reorder + products * self.packed <= (1 - MARGIN) * products * self.plain


NEVER = Timing(0.0, math.inf, 0.0)
"""A product that is never packed (not one product, or oneDNN does not take it)."""
NOT_MEASURED = dict.fromkeys(GROUPS, NEVER)
"""What a measurement that did not repeat decides, and caches: plain products. Cached, so that the decision is the
same in every later process of the machine (a resumed run rounds as the first did), not a gamble on a quieter one."""


# ---------------------------------------------------------------------------------------------- the decisions
def decode_plan(model: nn.Module, rows: int, steps: int) -> PackPlan | None:
    """The ``PackPlan`` for decoding ``steps`` steps of ``rows`` rows on ``model``'s lean forward; None: plain
    products (nothing pays, packing does not apply, or it is off)."""
    if not enabled() or not packing_applies(model.lm_head.weight):
        return None
    timings = calibrated(model.model.layers[0], "decode", 1 << max(rows - 1, 0).bit_length())
    return _plan(timings, rows, lambda timing: timing.pays(max(steps, 1)))


def pass_plan(model: nn.Module, hidden: Tensor, positions: int) -> PackPlan | None:
    """The ``PackPlan`` for a forward pass over ``positions`` positions whose first hidden states are ``hidden``;
    None: plain products (fewer than ``PASS_ROWS`` positions, nothing pays, packing does not apply, or it is
    off). Its products' time grows with the positions; the reorder's does not."""
    if positions < PASS_ROWS or not enabled() or not packing_applies(hidden):
        return None
    timings = calibrated(model.model.layers[0], "pass", PASS_ROWS)
    return _plan(timings, positions, lambda timing: timing.pays(positions / PASS_ROWS))


def _plan(timings: dict[str, Timing] | None, rows: int, pays: Callable[[Timing], bool]) -> PackPlan | None:
    groups = frozenset() if timings is None else frozenset(name for name in GROUPS if pays(timings[name]))
    return PackPlan(cpu_weight_packer(rows), groups) if groups else None


def enabled() -> bool:
    """False where ``GRPO_LIGHTNING_CPU_PACKING`` says off."""
    return os.environ.get(SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


# ------------------------------------------------------------------------------------------------ the machine
@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name, with family, model and stepping where the OS gives them (a hypervisor may show only
    "AMD EPYC")."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown"
    ids = [f"{field} {info[field]}" for field in ("cpu family", "model", "stepping") if field in info]
    return f"{name} ({', '.join(ids)})" if ids else name


def instruction_set() -> str:
    """The vector instruction set torch's CPU kernels dispatch to (``AVX2``, ``AVX512``, ...), ``AVX512_AMX``
    where the CPU also has AMX tiles."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and "amx_tile" in _cpuinfo().get("flags", "").split():
        return "AVX512_AMX"
    return capability


def machine(threads: int | None = None) -> str:
    """One line for a benchmark's table: the CPU, the instruction set torch dispatches to, the thread count
    (``threads``, else this process's) and torch's version."""
    threads = torch.get_num_threads() if threads is None else threads
    return (
        f"machine: CPU {cpu_model()}, torch dispatches to {instruction_set()}, {threads} threads, "
        f"torch {torch.__version__}"
    )


# ------------------------------------------------------------------------------------- measured and remembered
_MEASURED: dict[str, dict[str, Timing] | None] = {}  # this process's timings, by cache file name
_LABELS: dict[str, str] = {}  # what each was measured for, by cache file name (``describe``)


def calibrated(layer: nn.Module, regime: str, rows: int) -> dict[str, Timing] | None:
    """Timings of ``layer``'s product groups at ``rows`` rows for ``regime`` (``decode`` or ``pass``) on this
    machine: cached, else measured (and cached where the cache folder is writable; a measurement that was not
    repeatable as ``NOT_MEASURED``); None where packing is not considered on this instruction set."""
    isa = instruction_set()
    if isa not in MEASURED_INSTRUCTION_SETS:
        return None
    groups = product_groups(layer)
    key = {
        "version": CACHE_VERSION,
        "cpu": cpu_model(),
        "instruction_set": isa,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "regime": regime,
        "rows": rows,
        "shapes": {name: [[*part.weight.shape, part.bias is not None] for part in groups[name]] for name in GROUPS},
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json"
    if name not in _MEASURED:
        _MEASURED[name] = _cached_or_measured(cache_folder(), name, key, groups, rows)
        _LABELS[name] = f"{regime} at {rows} rows, {groups['o'][0].in_features} wide"
    return _MEASURED[name]


def _cached_or_measured(
    folder: Path | None, name: str, key: dict, groups: dict[str, tuple[nn.Linear, ...]], rows: int
) -> dict[str, Timing] | None:
    """The timings cached under ``folder`` for ``key``, else measured and cached (``NOT_MEASURED`` where the
    measurement was not repeatable)."""
    path = None if folder is None else folder / name
    timings = None if path is None else _read(path, key)
    if timings is not None:
        return timings
    with _measuring_alone(folder):
        timings = None if path is None else _read(path, key)  # another process measured while this one waited
        if timings is not None:
            return timings
        for _ in range(MEASUREMENTS):  # a reading disturbed once (a core woken late, a page fault) is read again
            timings = measure(groups, rows)
            if timings is not None:
                break
        if timings is None:  # remembered as "never pays": every later process (a resumed run) takes the same path
            log.info(
                "CPU packing: timings not repeatable (a busy machine?): plain products, remembered in %s (delete "
                "it to measure again)",
                folder,
            )
            timings = NOT_MEASURED
        return timings if path is None else _store(path, key, timings)


@contextlib.contextmanager
def _measuring_alone(folder: Path | None) -> Iterator[None]:
    """Hold the cache folder's lock while measuring: the processes of a run (DDP ranks) measure one after the other,
    each on cores the others leave idle, and the later ones find the first one's file. Without a lock (no folder,
    no ``fcntl``, or ``LOCK_WAIT_S`` passed) each measures anyway."""
    handle = None
    try:
        import fcntl

        if folder is None:
            raise OSError("no cache folder")
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / ".lock", "a")  # noqa: SIM115 (closed below, which releases the lock)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
    except (ImportError, OSError):
        pass
    try:
        yield
    finally:
        if handle is not None:
            handle.close()


def forget() -> None:
    """Drop this process's timings (the next decision reads the cache again, as a new process would)."""
    _MEASURED.clear()
    _LABELS.clear()


def describe() -> list[str]:
    """What this process measured or read, one line per shape class, for a benchmark's report: per group packed
    time over plain, and from how many products (decoding steps, or passes' positions over ``PASS_ROWS``) the
    reorder pays."""
    lines = []
    for name, timings in _MEASURED.items():
        if timings == NOT_MEASURED:
            lines.append(f"{_LABELS[name]}: not repeatable, plain")
            continue
        parts = []
        for group, timing in timings.items():
            saving = (1 - MARGIN) * timing.plain - timing.packed
            pays = f"from {timing.reorder / saving:.1f} products" if saving > 0 else "never"
            parts.append(f"{group} {timing.packed / max(timing.plain, 1e-12):.2f}x ({pays})")
        lines.append(f"{_LABELS[name]}: " + ", ".join(parts))
    return lines


def cache_folder() -> Path | None:
    """Where the timings are cached; None where there is no home folder."""
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:
        return None
    return base / "grpo_lightning" / "cpu_packing"


def _read(path: Path, key: dict) -> dict[str, Timing] | None:
    """The timings cached at ``path`` for ``key``; None where the file is missing, unreadable or not such a file."""
    try:
        content = json.loads(path.read_text())
        if content["key"] != key:
            return None
        timings = {name: Timing(*map(float, content["timings"][name])) for name in GROUPS}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(math.isnan(value) or value < 0 for timing in timings.values() for value in timing):
        return None
    return timings


_UNCACHED_WARNED: list[bool] = []


def _store(path: Path, key: dict, timings: dict[str, Timing]) -> dict[str, Timing]:
    """Cache ``timings`` at ``path`` unless another process got there first; the timings the file holds after
    (or ``timings`` where the folder is not writable)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "timings": {name: list(timings[name]) for name in GROUPS}}, f)
        try:
            os.link(tmp, path)  # whole or absent: a process reading it never sees half a file
        except FileExistsError:
            if _read(path, key) is None:  # a corrupt or unreadable file in the way
                os.replace(tmp, path)
        except OSError:  # no hard links on this file system: last writer wins, and is what is read back below
            os.replace(tmp, path)
    except OSError as error:
        if not _UNCACHED_WARNED:
            _UNCACHED_WARNED.append(True)
            log.warning(
                "CPU packing: cannot cache its timings under %s (%s); each process measures its own, so a resumed "
                "run may take another path (numbers equal up to the last bits). %s=off keeps products plain.",
                path.parent,
                error,
                SWITCH,
            )
        return timings
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return _read(path, key) or timings


@torch.no_grad()
def measure(groups: dict[str, tuple[nn.Linear, ...]], rows: int) -> dict[str, Timing] | None:
    """Time each group's product at ``rows`` rows, plain (its parts one by one, as the lean forward runs them
    unpacked) and packed (stacked), and its reorder: minima over alternated rounds, at least ``MIN_ROUNDS``, until
    every product's minimum has repeated (a second reading within ``REPEATABLE`` of it) or ``BUDGET_S`` has
    passed; None where it has not (other processes had the cores: a minimum seen once may be a lucky or an unlucky
    one). The inputs come from a generator of their own: the run's random state is untouched."""
    generator = torch.Generator().manual_seed(0)
    pack = cpu_weight_packer(rows)
    cases = {}
    for name in GROUPS:
        linears = groups[name]
        if len(linears) > 1 and not stackable(linears):
            continue  # not one product: never packed
        weight, bias = stacked_weight(linears) if len(linears) > 1 else (linears[0].weight, linears[0].bias)
        packed = pack(weight)
        if packed is None:
            continue
        x = torch.randn(rows, weight.size(1), generator=generator)
        parts = [(linear.weight.detach(), None if linear.bias is None else linear.bias.detach()) for linear in linears]

        def plain(x: Tensor = x, parts: list = parts) -> None:
            for part_weight, part_bias in parts:
                F.linear(x, part_weight, part_bias)

        def product(x: Tensor = x, packed: Tensor = packed, bias: Tensor | None = bias) -> None:
            packed_linear(x, packed, bias)

        def reorder(linears: tuple[nn.Linear, ...] = linears) -> None:
            pack(stacked_weight(linears)[0] if len(linears) > 1 else linears[0].weight)

        repeat = max(1, min(16, int(1e-4 / max(_seconds(plain, 1), 1e-7))))  # tiny products: several per reading
        _seconds(product, 1)  # oneDNN builds its kernel on the first call
        cases[name] = (plain, product, reorder, repeat)
    readings: dict[str, tuple[list[float], ...]] = {name: ([], [], []) for name in cases}
    start = time.perf_counter()
    for round_ in range(MAX_ROUNDS):
        for name, (plain, product, reorder, repeat) in cases.items():
            order = ((0, plain), (1, product)) if round_ % 2 == 0 else ((1, product), (0, plain))
            for slot, fn in (*order, (2, reorder)):
                readings[name][slot].append(_seconds(fn, 1 if slot == 2 else repeat))
        repeated = all(_repeated(times) for plain, packed, _ in readings.values() for times in (plain, packed))
        if round_ + 1 >= MIN_ROUNDS and (repeated or time.perf_counter() - start > BUDGET_S):
            break
    if not repeated:
        return None
    return {name: Timing(*map(min, readings[name])) if name in readings else NEVER for name in GROUPS}


def _repeated(times: list[float]) -> bool:
    """Whether the smallest of ``times`` came twice (within ``REPEATABLE``)."""
    if len(times) < 2:
        return False
    low, second = sorted(times)[:2]
    return second <= REPEATABLE * low


def _seconds(fn: Callable[[], object], repeat: int) -> float:
    """Seconds per call of ``fn`` over ``repeat`` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat
