"""The combination matrix's cases, generated from the package's declarations (issue 51, point 3).

The axes are read from where the package declares them, never listed by hand:

- **engine**: the engine registry (``engines.ENGINES``), one case per distinct engine (``auto`` is ``lean``); an
  engine registered as a ``"module:attr"`` path is an integration's (vLLM's): its cases are marked ``vllm`` and
  run in the vLLM environment (``.ci/run``);
- **kind**: single-turn sampling (``data.environment: null``) and every concrete ``RolloutKind`` of the package
  (``rollout/kind.py``), found by subclass; each needs a small instance to run (``harness.KIND_FACTORIES``), and a
  kind that needs a server of its own (OpenEnv, skyrl-gym) is left out by name (``SERVER_KINDS``), with the reason;
- **modality**: text and every plug-in of ``modality.MODALITY_PLUGINS``;
- **signal**: reward functions (some returning None), the kind's own reward (``data.rewards: []``), a reward model,
  a local teacher;
- **lag**: ``data.schedule.rollout_lag`` 0 and 1.

Whether a case is supported is not decided here: the test runs it, and the package's own checks before training
(``RolloutCollector.check_before_fit``, ``Modality.check_run``, the data module's) refuse it or not. The main suite
runs a pairwise-covering subset (``all_pairs``), the full product runs under ``-m matrix``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import grpo_lightning.integrations.agents  # noqa: F401 - the package's rollout kinds are its subclasses once imported
import grpo_lightning.integrations.environments  # noqa: F401
from grpo_lightning.engines import ENGINES
from grpo_lightning.modality import MODALITY_PLUGINS, TEXT
from grpo_lightning.rollout.kind import RolloutKind
from grpo_lightning.rollout.sample_and_score import SingleTurn

SINGLE_TURN = "single_turn"
SIGNALS = ("reward_functions", "kind_reward", "reward_model", "teacher")
LAGS = (0, 1)
SERVER_KINDS = {
    "OpenEnvEnvironment": "needs an OpenEnv server (tests/environments/test_openenv.py runs one)",
    "SkyRLGymEnvironment": "needs skyrl-gym's registered environments (tests/environments/test_skyrl_gym.py)",
}
AXES = ("engine", "kind", "modality", "signal", "lag")


@dataclass(frozen=True)
class Case:
    """One combination: a value of each axis."""

    engine: str
    kind: str
    modality: str
    signal: str
    lag: int

    @property
    def id(self) -> str:
        return f"{self.engine}-{self.kind}-{self.modality}-{self.signal}-lag{self.lag}"

    @property
    def needs_vllm(self) -> bool:
        """An engine the registry holds as a plug-in path is an integration's (vLLM's): its own environment."""
        return isinstance(ENGINES[self.engine], str)


def engine_axis() -> tuple[str, ...]:
    """One name per distinct engine of the registry (the last name of each: ``auto`` and ``lean`` are one)."""
    by_engine = {engine: name for name, engine in ENGINES.items()}
    return tuple(by_engine.values())


def package_kinds() -> list[type[RolloutKind]]:
    """Every concrete ``RolloutKind`` subclass the package defines (tests' own subclasses are not the package's)."""
    found, todo = [], list(RolloutKind.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo.extend(cls.__subclasses__())
        if (
            not inspect.isabstract(cls)
            and cls.__module__.startswith("grpo_lightning.")
            and cls is not SingleTurn
            and cls not in found
        ):
            found.append(cls)
    return found


def kind_axis() -> tuple[str, ...]:
    """Single-turn sampling, then every package kind that runs in process (by class name)."""
    names = [cls.__name__ for cls in package_kinds() if cls.__name__ not in SERVER_KINDS]
    return (SINGLE_TURN, *sorted(names))


def modality_axis() -> tuple[str, ...]:
    return (TEXT.name, *MODALITY_PLUGINS)


def axes() -> dict[str, tuple]:
    """Each axis's values, from the declarations (see the module docstring)."""
    return {
        "engine": engine_axis(),
        "kind": kind_axis(),
        "modality": modality_axis(),
        "signal": SIGNALS,
        "lag": LAGS,
    }


def full_product(values: dict[str, Sequence] | None = None) -> list[Case]:
    """Every combination of the axes' values."""
    values = values or axes()
    return [Case(*combo) for combo in itertools.product(*(values[a] for a in AXES))]


def all_pairs(values: dict[str, Sequence] | None = None) -> list[Case]:
    """A deterministic, greedy pairwise-covering subset of ``full_product``: every pair of values of any two axes
    appears in at least one case. Each step takes the case that covers the most pairs not yet covered (the first
    such in the product's order)."""
    values = values or axes()
    product = full_product(values)
    uncovered = {pair for case in product for pair in pairs_of(case)}
    chosen: list[Case] = []
    while uncovered:
        best = max(product, key=lambda case: len(pairs_of(case) & uncovered))
        chosen.append(best)
        uncovered -= pairs_of(best)
    return chosen


def pairs_of(case: Case) -> set[tuple[tuple[str, object], tuple[str, object]]]:
    """The (axis, value) pairs of any two axes that ``case`` covers."""
    items = [(axis, getattr(case, axis)) for axis in AXES]
    return set(itertools.combinations(items, 2))
