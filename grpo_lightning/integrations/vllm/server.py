"""The ``vllm_server`` engine: generation on running vLLM servers (their own GPUs or machines), weights pushed to
them after every update.

Each server is a plain ``vllm serve`` (docs/vllm.md, "vLLM servers"); this engine is its client:

- **Generation.** Each prompt goes to one server as token ids (``/v1/completions``, ``n`` = G, a seed drawn from
  the round's generator, every sampling setting sent explicitly so that none of the model's generation defaults
  applies), prompts spread over the servers in turn; token ids and their log-probs come back (no re-tokenizing).
  The rows are exactly those the in-process ``vllm`` engine would give: the same requests to the same engine.
  A vision-language model's prompts go to ``/inference/v1/generate`` instead (``vllm serve --enable-scale-out``):
  ids with one placeholder per image, and the images (``integrations/vision/vllm_inputs.py``).
- **Weights.** After every update trainer rank 0 pushes every weight (LoRA merged, FSDP2 gathered one tensor at a
  time) through vLLM's weight-transfer API (``integrations/vllm/weight_transfer.py``: NCCL on GPUs, gloo on CPU); the
  other ranks take part in the gathers and wait at a barrier, so that no rank samples from a half-pushed model.
  A push ends with every server's prefix cache cleared (vLLM keys it by token ids alone: it would otherwise serve
  the KV of prefixes it saw before from the old weights).
  Each server then reports the pushed version; a round checks it first, so a server that restarted (and lost the
  pushed weights) stops the run instead of sampling from the wrong model.
- **Faults.** Every request is retried (same seed: the same completions) ``retries`` times, then the run stops with
  one line naming the server (``ServerError``). Before retrying on a server, its version is checked again.
- **Log-probs.** As every engine's (``engines/base.py``): the sampling distribution's. The server must be started
  with ``--logprobs-mode processed_logprobs`` (vLLM's default gives them before the temperature); ``setup``
  checks that with two one-token requests and refuses a server started without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, completions_from_rows
from grpo_lightning.engines.http import ServerClient, ServerError
from grpo_lightning.engines.weights import policy_weights, policy_weights_meta
from grpo_lightning.integrations.vision.inputs import placeholder_token_ids
from grpo_lightning.integrations.vision.vllm_inputs import (
    GENERATE_ROUTE,
    engine_prompts,
    expansion_mismatch,
    generate_body,
    generated_rows,
    image_token_id,
    placeholder_bias,
)
from grpo_lightning.integrations.vision.vllm_weights import vllm_name
from grpo_lightning.integrations.vllm.engine import request_min_tokens
from grpo_lightning.integrations.vllm.weight_transfer import TRANSPORTS, WeightChannel, address_towards, held_version
from grpo_lightning.lora import is_peft_model
from grpo_lightning.modality import TEXT, Modality

SERVE_FLAGS = (
    "VLLM_SERVER_DEV_MODE=1 vllm serve <model> --logprobs-mode processed_logprobs --weight-transfer-config "
    '\'{"backend": "checked_nccl"}\' (gloo on CPU)'
)

# Every sampling setting a request does not set otherwise, neutral: a server started without
# ``--generation-config vllm`` applies the model folder's generation_config defaults (Qwen2.5-Instruct's
# repetition penalty, top-k, top-p) to whatever a request leaves out.
NEUTRAL = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


class VLLMServerEngine(RolloutEngine):
    """Running vLLM servers at ``base_urls``, fed the policy's weights after every update."""

    name = "vllm_server"
    shares_weights = False
    # generate(vision=...): a vision-language model's prompts go to GENERATE_ROUTE, ids and images together
    takes_images = True
    remote = True
    # A continued sequence is a prompt like any other; every push ends with each server's prefix cache cleared
    supports_partial_rollouts = True
    context_name = "the vLLM servers' max_model_len (vllm serve --max-model-len)"

    def __init__(
        self,
        base_urls: str | list[str] = "http://127.0.0.1:8000",
        weight_transport: str = "auto",
        trainer_address: str | None = None,
        transfer_port: int = 0,
        connect_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        push_timeout_s: float = 600.0,
        retries: int = 3,
        max_concurrent_requests: int = 256,
    ) -> None:
        """
        Args:
            base_urls: the servers, ``http://host:port`` each; a round's prompts are spread over them.
            weight_transport: ``nccl`` (GPU servers), ``gloo`` (CPU servers), ``auto``: nccl when this trainer has
                a GPU, gloo otherwise. The servers' ``--weight-transfer-config`` must name the same.
            trainer_address: this machine's address as the servers reach it (default: found from the route to
                the first server; 127.0.0.1 when they all run here).
            transfer_port: the port trainer rank 0 opens for the weight group (0: a free one). Open it to the
                servers only.
            connect_timeout_s: how long to wait for a server at start (it may still be loading its model).
            request_timeout_s: how long one request may take (all of a prompt's G completions) before a retry.
            push_timeout_s: the time limit of a weight push (and of forming the weight group).
            retries: how many times a failed request is retried (1, 2, 4, ... s apart) before the run stops.
            max_concurrent_requests: requests in flight at once, all servers together.
        """
        super().__init__()
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls or any(urlparse(u).scheme not in ("http", "https") or not urlparse(u).netloc for u in urls):
            raise ConfigError(
                f"data.engine.init_args.base_urls: give the servers as http://host:port (got {base_urls!r})"
            )
        if weight_transport not in ("auto", *TRANSPORTS):
            raise ConfigError(
                f"data.engine.init_args.weight_transport: {weight_transport!r} is none of auto, {', '.join(TRANSPORTS)}"
            )
        for name, value in (
            ("connect_timeout_s", connect_timeout_s),
            ("request_timeout_s", request_timeout_s),
            ("push_timeout_s", push_timeout_s),
            ("max_concurrent_requests", max_concurrent_requests),
        ):
            if not value > 0:
                raise ConfigError(f"data.engine.init_args.{name} must be > 0 (got {value})")
        if retries < 0:
            raise ConfigError(f"data.engine.init_args.retries must be >= 0 (got {retries})")
        self.base_urls = urls
        self.weight_transport = weight_transport
        self.trainer_address, self.transfer_port = trainer_address, transfer_port
        self.connect_timeout_s, self.request_timeout_s = connect_timeout_s, request_timeout_s
        self.push_timeout_s, self.retries = push_timeout_s, retries
        self.max_concurrent_requests = max_concurrent_requests
        self._servers: list[ServerClient] | None = None
        self._model_ids: list[str] = []
        self._context: int | None = None
        self._channel: WeightChannel | None = None
        self.pushed_version: int | None = None  # what the servers report after the trainer's latest push
        self.placeholders: list[int] = []  # a vision-language model's image placeholder ids (setup)
        self.image_token: int | None = None

    def __getstate__(self) -> dict[str, Any]:  # sent to a background rollout process: no live connections
        return {**self.__dict__, "_channel": None, "policy": None}

    # ------------------------------------------------------------------------------------------ life cycle
    @property
    def servers(self) -> list[ServerClient]:
        """The servers, waited for (``connect_timeout_s``) and checked at first use."""
        if self._servers is None:
            servers = [ServerClient(u, timeout_s=self.request_timeout_s, retries=self.retries) for u in self.base_urls]
            for server in servers:
                server.wait_until_up(self.connect_timeout_s)
            models = [server.get("/v1/models")["data"][0] for server in servers]
            self._model_ids = [m["id"] for m in models]
            self._context = min(int(m.get("max_model_len") or 0) or 1 << 30 for m in models)
            self._servers = servers
        return self._servers

    def setup(self, policy: nn.Module, tokenizer: Any, modality: Modality = TEXT) -> None:
        """Connect to the servers and check that they can serve this run (log-probs mode, weight routes)."""
        super().setup(policy, tokenizer, modality)
        base = policy.get_base_model() if is_peft_model(policy) else policy
        config = getattr(base.config, "text_config", None) or base.config
        self.vocab_size = int(config.vocab_size)
        if getattr(base.config, "vision_config", None) is not None:  # a vision-language model: GENERATE_ROUTE
            self.placeholders, self.image_token = placeholder_token_ids(base), image_token_id(base.config)
        for server, model_id in zip(self.servers, self._model_ids):
            self._check_server(server, model_id)
            if self.placeholders:
                check_generate_route(server, model_id)
        self.weights_version = self.pushed_version = None  # the servers' weights are not this policy's until a push

    def _check_server(self, server: ServerClient, model_id: str) -> None:
        try:
            server.get("/weight_info")
        except ServerError as err:
            if err.status != 404:
                raise
            raise ConfigError(
                f"data.engine: the vLLM server {server} has no weight-transfer routes; start it as {SERVE_FLAGS}"
            ) from None
        # The first step's top log-probs at two temperatures: vLLM's default mode (raw_logprobs) takes them before
        # the temperature, so they come back equal; processed_logprobs (the sampling distribution) differ. (A flat
        # distribution, which no temperature changes, says nothing either way.)
        prompt = [(i * 7919) % self.vocab_size for i in range(1, 9)]
        probe = {"model": model_id, "prompt": prompt, "max_tokens": 1, "logprobs": 5, "seed": 0, **NEUTRAL}
        tops = [
            server.post("/v1/completions", {**probe, "temperature": t})["choices"][0]["logprobs"]["top_logprobs"][0]
            for t in (1.0, 0.5)
        ]
        common = tops[0].keys() & tops[1].keys()
        spread = max(tops[0].values()) - min(tops[0].values())
        if spread > 1e-4 and all(abs(tops[0][k] - tops[1][k]) < 1e-6 for k in common):
            raise ConfigError(
                f"data.engine: the vLLM server {server} returns log-probs taken before the temperature (vLLM's "
                "default); start it with --logprobs-mode processed_logprobs"
            )

    def max_context(self, model_context: int | None) -> int | None:
        """The longest prompt + completion the servers take: the smallest ``--max-model-len`` among them."""
        self.servers  # noqa: B018 - connects, reads each server's max_model_len
        return self._context if model_context is None else min(model_context, self._context or model_context)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        super().close()

    # -------------------------------------------------------------------------------------------- weights
    def load_weights(self, policy: nn.Module, version: int) -> None:
        """Push the policy's weights to every server (from trainer rank 0; the other ranks join the gathers)."""
        rank = _rank()
        _barrier()  # every rank is done sampling from the servers' current weights
        # Under the names vLLM's loader wants where they differ (a LLaVA tower's: integrations/vision/vllm_weights.py).
        config = getattr(policy, "config", None)
        weights = ((vllm_name(config, name), tensor) for name, tensor in policy_weights(policy))
        if rank == 0:
            meta = [(vllm_name(config, name), dtype, shape) for name, dtype, shape in policy_weights_meta(policy)]
            self._weight_channel().push(weights, meta, version)
            for server in self.servers if self.placeholders else []:  # image features of the old vision weights
                server.post("/reset_encoder_cache", {})
                server.post("/reset_mm_cache", {})
        elif any(hasattr(p, "full_tensor") for p in policy.parameters()):
            for _ in weights:  # the FSDP2 gathers are collectives: every rank takes part
                pass
        _barrier()  # no rank samples before the servers hold the new weights
        super().load_weights(policy, version)
        self.pushed_version = version

    def follow(self, version: int, pushed_version: int) -> None:
        """In a background rollout process: the trainer pushed the servers ``pushed_version`` (its optimizer step),
        which this process's rounds count as ``version``."""
        self.weights_version, self.pushed_version = version, pushed_version

    def _weight_channel(self) -> WeightChannel:
        if self._channel is None:
            transport = self.weight_transport
            if transport == "auto":
                transport = "nccl" if torch.cuda.is_available() else "gloo"
            self._channel = WeightChannel(
                self.servers,
                transport=transport,
                address=self.trainer_address or address_towards(self.servers),
                port=self.transfer_port,
                timeout_s=self.push_timeout_s,
            )
        return self._channel

    def _check_versions(self) -> None:
        for server in self.servers:
            self._check_version(server)

    def _check_version(self, server: ServerClient) -> None:
        held = held_version(server)
        if held != str(self.pushed_version):
            raise ServerError(
                f"the vLLM server {server} holds weights {held!r}, not the pushed version {self.pushed_version}: it "
                "restarted (or another trainer pushed to it); resume the run from its last checkpoint (ckpt_path), "
                "which pushes the checkpoint's weights first"
            )

    # ----------------------------------------------------------------------------------------- generation
    def logprobs_match_policy(self, policy: nn.Module) -> bool:
        return False  # vLLM's kernels: π_old is recomputed, these weigh the loss (TIS)

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
        prompt encoder made them: each prompt goes to ``GENERATE_ROUTE`` as its ids with one placeholder per image
        and its images (``integrations/vision/vllm_inputs.py``); the server's expansion must be ``prompt_ids``'."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        if vision is not None and len(vision) != len(prompts):
            raise ValueError(f"{len(vision)} rows of image inputs for {len(prompts)} prompts")
        media = engine_prompts(prompts, vision, self.image_token) if vision is not None else None
        if any(not 0 <= token < self.vocab_size for ids in prompts for token in ids):
            raise ValueError(f"a prompt holds a token id outside the model's vocabulary of {self.vocab_size}")
        servers = self.servers
        longest = max((len(p) for p in prompts), default=0)
        if self._context is not None and longest + params.max_new_tokens > self._context:
            raise ConfigError(
                f"data.engine: a prompt of {longest} tokens + max_new_tokens={params.max_new_tokens} exceed the vLLM "
                f"servers' max_model_len of {self._context}; start them with a larger --max-model-len or lower "
                "data.sampling.max_new_tokens"
            )
        if self.pushed_version is not None:
            self._check_versions()
        group = 1 if params.greedy else params.group_size
        min_new = request_min_tokens(params)
        seeds = (
            torch.randint(2**31 - 1, (len(prompts),), generator=generator, device=generator.device).tolist()
            if generator is not None
            else [0] * len(prompts)
        )
        # As in the in-process engine: a one-token stop sequence is a stop token only without a minimum length
        # (vLLM bans stop tokens before min_tokens); longer ones are cut afterwards (``completions_from_tokens``).
        one_token = [s[0] for s in params.stop_sequences if len(s) == 1] if min_new == 0 else []
        settings = {
            **NEUTRAL,
            "n": group,
            "max_tokens": params.max_new_tokens,
            "min_tokens": min_new,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": -1 if params.greedy or params.top_k == 0 else params.top_k,
            "stop_token_ids": list(dict.fromkeys([*self.eos_token_ids, *one_token])),
            "ignore_eos": False,
            "skip_special_tokens": False,
            "return_token_ids": True,
            **({"logprobs": 0} if return_logprobs else {}),
        }

        # GENERATE_ROUTE takes vLLM's own sampling settings: the same ones, less the completions API's extras, with
        # the image placeholders biased out (as the in-process engine does)
        sampling = {k: v for k, v in settings.items() if k != "return_token_ids"}
        sampling.update(
            detokenize=False, logit_bias={str(t): b for t, b in placeholder_bias(self.placeholders).items()}
        )

        def ask(i: int) -> list[tuple[list[int], list[float]]]:
            k = i % len(servers)
            server = servers[k]
            check = (lambda: self._check_version(server)) if self.pushed_version is not None else None
            if media is None:
                body = {"model": self._model_ids[k], "prompt": prompts[i], "seed": int(seeds[i]), **settings}
                answer = server.request("POST", "/v1/completions", body, before_retry=check)
                choices = sorted(answer["choices"], key=lambda c: c["index"])
                rows = [
                    (list(c["token_ids"]), list(c["logprobs"]["token_logprobs"]) if return_logprobs else [])
                    for c in choices
                ]
            else:
                body = generate_body(self._model_ids[k], media[i], {**sampling, "seed": int(seeds[i])})
                answer = server.request("POST", GENERATE_ROUTE, body, before_retry=check)
                if problem := expansion_mismatch([prompts[i]], [answer.get("prompt_token_ids")]):
                    raise RuntimeError(f"{server}: {problem.replace('row 0', f'row {i}')}")
                rows = generated_rows(answer, return_logprobs)
            if len(rows) != group:
                raise ServerError(f"the vLLM server {server} answered {len(rows)} completions where {group} were asked")
            return rows

        workers = max(1, min(self.max_concurrent_requests, len(prompts)))
        with ThreadPoolExecutor(workers, thread_name_prefix="grpo-vllm-server") as pool:
            answers = list(pool.map(ask, range(len(prompts))))
        rows = [row for answer in answers for row in answer]
        return completions_from_rows(
            prompt_ids,
            prompt_mask,
            [ids for ids, _ in rows],
            [lps for _, lps in rows] if return_logprobs else None,
            params,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )


def check_generate_route(server: ServerClient, model_id: str) -> None:
    """Refuse, in one line, a server that does not serve ``GENERATE_ROUTE`` (started without --enable-scale-out:
    vLLM answers 403; an older vLLM: 404), probed with a one-token request."""
    probe = {"model": model_id, "token_ids": [0], "sampling_params": {"max_tokens": 1, "detokenize": False}}
    try:
        server.post(GENERATE_ROUTE, probe, retry=False)
    except ServerError as err:
        if err.status not in (403, 404):
            raise
        raise ConfigError(
            f"data.engine: the vLLM server {server} does not serve {GENERATE_ROUTE}, the route that takes a "
            "vision-language model's token ids with its images; start it with --enable-scale-out (vLLM >= 0.32), "
            "or set data.engine: vllm"
        ) from None


def _rank() -> int:
    return (
        torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    )


def _barrier() -> None:
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        torch.distributed.barrier()


__all__ = ["ServerError", "VLLMServerEngine"]
