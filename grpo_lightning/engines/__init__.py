"""Rollout engines: what samples the completions of a round, behind one interface (``engines/base.py``).

=================  =====================================================================================
``lean``           our sampling loop (``engines/lean.py``): prompt prefilled once per group, preallocated
                   cache; decodes on the lean forward for Llama, Qwen2, Qwen3 and Mistral, on the model's
                   own forward otherwise. Shares the policy's weights. The default (``auto``).
``transformers``   the model's ``generate()`` (``engines/hf.py``), any causal LM. Shares the weights.
``vllm``           vLLM in the training process (``engines/vllm.py``), its own copy of the weights.
``vllm_server``    running vLLM servers (``engines/vllm_server.py``) on their own GPUs or machines, the
                   weights pushed to them after every update (``engines/weight_transfer.py``).
=================  =====================================================================================

``data.engine`` takes a name, or ``{class_path: ..., init_args: {...}}`` for an engine with settings (one of
these classes or your own ``RolloutEngine`` subclass).
"""

from __future__ import annotations

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, concat_completions
from grpo_lightning.engines.hf import TransformersEngine
from grpo_lightning.engines.lean import LeanEngine

ENGINE_NAMES = ("auto", "lean", "transformers", "vllm", "vllm_server")


def build_engine(spec: str | RolloutEngine) -> RolloutEngine:
    """The engine ``data.engine`` names (a fresh instance), or ``spec`` itself when it is an engine already.

    ``auto`` is ``lean``: on every model it was measured faster than ``generate()`` (docs/benchmarks.md), on the
    lean forward where the architecture allows and on the model's own forward elsewhere.
    """
    if isinstance(spec, RolloutEngine):
        return spec
    if spec in ("auto", "lean"):
        return LeanEngine()
    if spec == "transformers":
        return TransformersEngine()
    if spec == "vllm":
        from grpo_lightning.engines.vllm import VLLMEngine  # imports vllm: only when asked for

        return VLLMEngine()
    if spec == "vllm_server":
        from grpo_lightning.engines.vllm_server import VLLMServerEngine  # the standard library's HTTP only

        return VLLMServerEngine()
    raise ConfigError(
        f"data.engine: unknown engine {spec!r}; choose one of {', '.join(ENGINE_NAMES)}, or give "
        "{class_path: ..., init_args: {...}} for a RolloutEngine subclass"
    )


__all__ = [
    "ENGINE_NAMES",
    "Completions",
    "LeanEngine",
    "RolloutEngine",
    "SamplingParams",
    "TransformersEngine",
    "build_engine",
    "concat_completions",
]
