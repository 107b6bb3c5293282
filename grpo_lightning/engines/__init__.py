"""Rollout engines: what samples the completions of a round, behind one interface (``engines/base.py``).

=================  =====================================================================================
``lean``           our sampling loop (``engines/lean.py``): prompt prefilled once per group, preallocated
                   cache; decodes on the lean forward for Llama, Qwen2, Qwen3 and Mistral, on the model's
                   own forward otherwise. Shares the policy's weights. The default (``auto``).
``transformers``   the model's ``generate()`` (``engines/hf.py``), any causal LM. Shares the weights.
``vllm``           vLLM in the training process (``integrations/vllm/engine.py``), its own copy of the weights.
``vllm_server``    running vLLM servers (``integrations/vllm/server.py``) on their own GPUs or machines, the
                   weights pushed to them after every update (``integrations/vllm/weight_transfer.py``).
=================  =====================================================================================

``data.engine`` takes a name, or ``{class_path: ..., init_args: {...}}`` for an engine with settings (one of
these classes or your own ``RolloutEngine`` subclass). The names are one table, ``ENGINES``: the core's engines
as classes, vLLM's as ``"module:attr"`` paths that ``plugins.load_plugin`` imports when a run names them (the core
imports no vLLM module). ``register_engine("mine", MyEngine)`` (or ``"my_pkg.engines:MyEngine"``) adds a name.
"""

from __future__ import annotations

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, concat_completions
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.engines.lean import LeanEngine
from grpo_lightning.plugins import load_plugin

# name -> the engine class, or the ``"module:attr"`` path of an integration's (loaded only when named).
ENGINES: dict[str, type[RolloutEngine] | str] = {
    "auto": LeanEngine,
    "lean": LeanEngine,
    "transformers": TransformersEngine,
    "vllm": "grpo_lightning.integrations.vllm.engine:VLLMEngine",  # imports vllm: only when asked for
    "vllm_server": "grpo_lightning.integrations.vllm.server:VLLMServerEngine",  # the standard library's HTTP only
}


def register_engine(name: str, engine: type[RolloutEngine] | str) -> None:
    """Make ``data.engine: name`` build ``engine`` (with no arguments: an engine with settings is given as
    ``{class_path, init_args}`` instead).

    Args:
        name: the name a config gives (``data.engine: name``).
        engine: a ``RolloutEngine`` subclass, or its ``"module:attr"`` path, imported only when a run names it
            (``plugins.load_plugin``): registering costs no import.

    Raises:
        ValueError: ``name`` is registered already to another engine (the same engine again is fine).
    """
    if name in ENGINES and ENGINES[name] != engine:
        raise ValueError(f"engine {name!r} is already registered ({ENGINES[name]!r})")
    ENGINES[name] = engine


def engine_names() -> tuple[str, ...]:
    """The names ``data.engine`` takes, in the table's order (the built-in ones first)."""
    return tuple(ENGINES)


def __getattr__(name: str) -> tuple[str, ...]:
    # ``ENGINE_NAMES``: the table's names as they are now, registered ones included.
    if name == "ENGINE_NAMES":
        return engine_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def engine_class(name: str) -> type[RolloutEngine]:
    """The engine class ``data.engine: name`` builds (a plug-in path imported now), refused in one line when the
    name is not registered or names no ``RolloutEngine`` subclass."""
    if name not in ENGINES:
        raise ConfigError(
            f"data.engine: unknown engine {name!r}; choose one of {', '.join(engine_names())}, or give "
            "{class_path: ..., init_args: {...}} for a RolloutEngine subclass"
        )
    engine = ENGINES[name]
    found = load_plugin(engine) if isinstance(engine, str) else engine
    if not (isinstance(found, type) and issubclass(found, RolloutEngine)):
        raise ConfigError(f"data.engine: {name!r} names {engine!r}, which is not a RolloutEngine subclass")
    return found


def build_engine(spec: str | RolloutEngine) -> RolloutEngine:
    """The engine ``data.engine`` names (a fresh instance), or ``spec`` itself when it is an engine already.

    ``auto`` is ``lean``: on every model it was measured faster than ``generate()`` (docs/benchmarks.md), on the
    lean forward where the architecture allows and on the model's own forward elsewhere.
    """
    if isinstance(spec, RolloutEngine):
        return spec
    return engine_class(spec)()


__all__ = [
    "ENGINES",
    "ENGINE_NAMES",
    "Completions",
    "LeanEngine",
    "RolloutEngine",
    "SamplingParams",
    "TransformersEngine",
    "build_engine",
    "engine_class",
    "concat_completions",
    "engine_names",
    "register_engine",
]
