"""The shape of the house: no import cycles, rooms that hold what they say, and the Lightning internals we rely on.

- No module of ``grpo_lightning`` imports, directly or through others, a module that imports it back (imports
  inside functions and under ``TYPE_CHECKING`` count: they are dependencies too).
- The core (everything outside ``grpo_lightning/integrations/``) imports no integration; no two folders import each
  other, and the folders stand in layers (no import runs from a lower one up to a higher one).
- ``GRPOModule`` depends on no callback; every module says in its docstring what it owns; no file is over 500
  lines (a file is one idea; the cap catches a file that has become several).
- Where Lightning offers no public hook for what we need, we use its internals; each such place is listed in the
  docs/how_it_works.md, and the tests below fail the day Lightning changes what we rely on.
"""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_lightning"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """For each module of the package, the package's modules it imports (static: every import statement)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1 steps
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for candidate in candidates:
                target = resolve(candidate) if candidate.split(".")[0] == "grpo_lightning" else None
                # A module importing its own package (or the top-level package) runs that __init__ first, by Python's
                # rules, whatever it does: not a dependency that can form a cycle of its own.
                if target and target != name and not name.startswith(f"{target}.") and target != "grpo_lightning":
                    targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_lightning_module_depends_on_no_callback_and_the_round_on_no_module():
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert not {m for m in reachable("grpo_lightning.module") if m.startswith("grpo_lightning.callbacks")}
    for lower in ("grpo_lightning.rollout.round", "grpo_lightning.engines", "grpo_lightning.losses"):
        assert "grpo_lightning.module" not in reachable(lower), lower
    assert "grpo_lightning.rollout.datamodule" not in reachable("grpo_lightning.module")


def test_every_module_says_what_it_owns_in_a_short_file():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.relative_to(PACKAGE.parent)} has no module docstring"
        assert len(path.read_text().splitlines()) <= 500, f"{path.relative_to(PACKAGE.parent)} is over 500 lines"


# ---------------------------------------------------------------- the core and its integrations (issue 51)
INTEGRATIONS = "grpo_lightning.integrations"


def room(module: str) -> str:
    """The folder (or top-level file) a module belongs to: ``grpo_lightning.rollout``, ``grpo_lightning.module``,
    and one room per integration (``grpo_lightning.integrations.vision``)."""
    parts = module.split(".")
    depth = 3 if module.startswith(INTEGRATIONS + ".") else 2
    return ".".join(parts[:depth])


def room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        graph.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return graph


def test_the_core_imports_no_integration():
    """What the quickstart uses (everything outside ``grpo_lightning/integrations/``) imports no integration, at the
    top of a file or inside a function: integrations plug in through the core's declared extension points, and the
    core reaches one only by its ``"module:attr"`` path (``plugins.load_plugin``)."""
    offending = {
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if not module.startswith(INTEGRATIONS)
        for target in targets
        if target.startswith(INTEGRATIONS)
    }
    assert not offending, sorted(offending)


def test_no_two_rooms_import_each_other_and_the_rooms_stand_in_layers():
    """No two folders import each other, and the rooms form layers: no import runs from a lower room up to a higher
    one (the graph of rooms has no cycle at all, so every room stands above everything it imports)."""
    graph = room_graph()
    pairs = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})
    assert pairs == [], pairs
    assert cycles(graph) == []


def test_the_room_check_sees_a_two_way_pair():
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert room("grpo_lightning.integrations.vision.inputs") == "grpo_lightning.integrations.vision"
    assert room("grpo_lightning.rollout.round") == "grpo_lightning.rollout"


# ------------------------------------------------------------ the Lightning internals we rely on (docs/how_it_works.md)
def test_lightning_stops_a_run_at_the_end_of_a_batch_on_sigterm():
    """Why ``RoundCheckpoint`` handles SIGTERM itself: Lightning's own handler only flags the signal, and its
    training loop then raises at the end of the current micro-batch, mid-round (a round cut there cannot be
    resumed exactly). If Lightning ever lets a callback defer the stop, the handler can go."""
    import inspect

    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    source = inspect.getsource(_TrainingEpochLoop.on_advance_end)
    assert "received_sigterm" in source and "SIGTERMException" in source


def test_round_checkpoint_puts_back_the_sigterm_handler_it_replaced(tmp_path):
    from grpo_lightning.callbacks.checkpointing import RoundCheckpoint

    previous = signal.getsignal(signal.SIGTERM)
    callback = RoundCheckpoint(dirpath=str(tmp_path))
    callback._install_handler(exclusive=True)
    assert signal.getsignal(signal.SIGTERM) == callback._on_sigterm
    callback._restore_handler()
    assert signal.getsignal(signal.SIGTERM) == (previous if previous is not None else signal.SIG_DFL)


def test_model_parallel_strategy_keeps_its_sizes_where_fsdp2_strategy_sets_them():
    """``FSDP2Strategy`` sizes the data-parallel dimension to the world size at ``setup_environment`` (Lightning's
    ``auto`` would give one node's devices to tensor parallelism): it sets ``ModelParallelStrategy``'s private
    ``_data_parallel_size``, there being no public setter."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy()
    assert strategy._data_parallel_size == "auto" and strategy._tensor_parallel_size == "auto"


def test_wandb_logger_keeps_the_init_arguments_where_grpo_wandb_logger_cleans_them(tmp_path):
    """``GRPOWandbLogger`` drops the ``None`` values Lightning puts in ``WandbLogger._wandb_init`` (``anonymous``,
    ``id``), each of which costs a W&B warning at every run; there is no public way to leave them out."""
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from grpo_lightning.callbacks import GRPOWandbLogger

    assert WandbLogger(save_dir=str(tmp_path), offline=True)._wandb_init["anonymous"] is None
    assert "anonymous" not in GRPOWandbLogger(save_dir=str(tmp_path), offline=True)._wandb_init


def test_model_checkpoint_keeps_its_triggers_where_check_checkpoint_timing_reads_them():
    """``check_checkpoint_timing`` (at a rollout lag, a checkpoint callback that saves inside a round is refused)
    reads when a ``ModelCheckpoint`` saves from its private trigger attributes, and a time-based
    ``val_check_interval`` from ``Trainer._val_check_time_interval`` (as ``ModelCheckpoint`` itself does): Lightning
    has no public accessor for either."""
    from datetime import timedelta

    from lightning import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert ModelCheckpoint(every_n_train_steps=3)._every_n_train_steps == 3
    assert ModelCheckpoint(train_time_interval=timedelta(minutes=5))._train_time_interval == timedelta(minutes=5)
    assert ModelCheckpoint()._save_on_train_epoch_end is None
    assert ModelCheckpoint(save_on_train_epoch_end=True)._save_on_train_epoch_end is True
    assert Trainer(logger=False, val_check_interval="00:00:00:30")._val_check_time_interval == 30
    assert Trainer(logger=False, val_check_interval=0.5).val_check_interval == 0.5


def test_rich_progress_bar_takes_the_training_text_from_get_train_description():
    """``RoundProgressBar`` says ``Round k/N`` by overriding ``RichProgressBar._get_train_description``, where
    Lightning makes the training bar's text at each round's start and for a resumed round's bar; a public hook could
    only replace the text after Lightning set it (its refresh thread may draw ``Epoch`` in between)."""
    import inspect

    from lightning.pytorch.callbacks import RichProgressBar

    assert list(inspect.signature(RichProgressBar._get_train_description).parameters) == ["self", "current_epoch"]
    for hook in (RichProgressBar.on_train_epoch_start, RichProgressBar._initialize_train_progress_bar_id):
        assert "self._get_train_description(" in inspect.getsource(hook), hook.__name__
