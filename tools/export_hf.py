"""Export a GRPO checkpoint's policy as a Hugging Face model folder.

    python tools/export_hf.py runs/quickstart/checkpoints/last.ckpt exported/quickstart
    python tools/export_hf.py CKPT OUT_DIR --dtype bfloat16
    python tools/export_hf.py --for-vllm MODEL_DIR OUT_DIR    # a model folder vLLM can serve (LLaVA)

The weights keep the dtype they were trained in (the checkpoint's: ``bfloat16`` after ``precision: bf16-true``,
``float32`` after ``32-true`` or ``bf16-mixed``) unless ``--dtype`` says otherwise.

The folder holds the weights (``model.safetensors``), ``config.json``, the tokenizer and a ``generation_config.json``
carrying the run's sampling settings (``data.sampling``, kept in the checkpoint's DataModule state), and loads
with ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` (a vision-language model: ``AutoModelForImageTextToText``,
and its processor, image settings and chat template, with ``AutoProcessor``). A LoRA
policy (a ``peft`` model) is merged into its base weights first, so the folder needs no ``peft`` to load.

The checkpoint rebuilds its module from its hyperparameters, so ``model.model_name_or_path`` must still resolve
(run from the training run's folder, or pass ``--model-name-or-path``).

``--for-vllm`` writes the weights under the names vLLM's loader wants
(``grpo_lightning/integrations/vision/vllm_weights.py``), for ``vllm serve``: the folder to start the servers of
``data.engine: vllm_server`` from. It matters for LLaVA only (with a CLIP or SigLIP tower): transformers 5 saves its
tower flat (``vision_tower.embeddings.*``), vLLM 0.32 loads it nested (``vision_tower.vision_model.*``) and refuses to
start on the flat names; other models' weights are written as they are. Its source may then also be a Hugging Face model
folder instead of a checkpoint (the model a run starts from), copied whole, weights renamed. transformers reads such a
folder back into the same weights.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from grpo_lightning.integrations.vision.vllm_weights import copy_for_vllm, rename_for_vllm
from grpo_lightning.module import GRPOModule


def merged_policy(policy: torch.nn.Module) -> PreTrainedModel:
    """The policy as a plain ``transformers`` model: a ``peft`` model has its adapters merged in (in place)."""
    try:
        from peft import PeftModel
    except ImportError:  # without peft installed the policy cannot be a peft model
        return policy
    if isinstance(policy, PeftModel):
        return policy.merge_and_unload()
    return policy


def trained_dtype(state_dict: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype of the policy's floating-point weights in a checkpoint's ``state_dict`` (the most common one);
    None when it holds none."""
    counts = Counter(
        value.dtype
        for key, value in state_dict.items()
        if key.startswith("policy.") and isinstance(value, torch.Tensor) and value.is_floating_point()
    )
    return counts.most_common(1)[0][0] if counts else None


def export_module(
    module: GRPOModule,
    out_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    sampling: Mapping[str, Any] | None = None,
    for_vllm: bool = False,
) -> Path:
    """Write ``module``'s policy, tokenizer and generation config to ``out_dir`` as a Hugging Face folder.

    Args:
        module: a module whose policy is built (``configure_model`` ran, as ``load_from_checkpoint`` does).
        out_dir: the folder to write (created if needed).
        dtype: cast the weights to this ``torch`` dtype (or its name: ``bfloat16``, ``float16``, ...); default:
            the policy's as it is.
        sampling: the run's sampling settings (``SamplingConfig`` fields) for the generation config; None keeps
            the model's own.
        for_vllm: write the weights under vLLM's names (``integrations/vision/vllm_weights.py: rename_for_vllm``), a
        folder
            ``vllm serve`` loads (LLaVA's tower nested under ``vision_model``).
    """
    if module.policy is None:
        module.configure_model()
    policy = merged_policy(module.policy).eval()
    if dtype is not None:
        policy = policy.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    tokenizer = module.tokenizer
    generation = policy.generation_config
    generation.pad_token_id, generation.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    if sampling is not None:
        # The sampling the policy was trained with: generate() on the exported model then behaves like a rollout.
        generation.do_sample, generation.temperature = True, sampling["temperature"]
        generation.top_p, generation.top_k = sampling["top_p"], sampling["top_k"]
        generation.max_new_tokens = sampling["max_new_tokens"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out_dir)
    module.modality.save_processor(
        tokenizer, out_dir
    )  # a vision-language model's processor whole: AutoProcessor reloads it
    if for_vllm:
        rename_for_vllm(out_dir, policy.config)
    return out_dir


def export_checkpoint(
    ckpt_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    model_name_or_path: str | None = None,
    for_vllm: bool = False,
) -> Path:
    """Load a Lightning checkpoint of ``GRPOModule`` (on CPU) and ``export_module`` its policy.

    ``dtype`` None keeps the dtype the weights were trained in: the module is rebuilt in float32 and the
    checkpoint's weights are loaded into it, so the checkpoint's own dtype is restored on export.

    The checkpoint is unpickled in full (``weights_only=False``), as ``trainer.fit/validate --ckpt_path`` does: its
    hyperparameters hold the run's config objects. Export only checkpoints you trust.
    """
    # Memory-mapped: only the dtypes of the tensors and the small entries are read.
    checkpoint = torch.load(str(ckpt_path), map_location="cpu", mmap=True, weights_only=False)
    if dtype is None:
        dtype = trained_dtype(checkpoint.get("state_dict") or {})
    sampling = (checkpoint.get("RolloutDataModule") or {}).get("sampling")
    del checkpoint
    overrides = {} if model_name_or_path is None else {"model_name_or_path": model_name_or_path}
    module = GRPOModule.load_from_checkpoint(str(ckpt_path), map_location="cpu", weights_only=False, **overrides)
    return export_module(module, out_dir, dtype=dtype, sampling=sampling, for_vllm=for_vllm)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``export_hf.py CKPT OUT_DIR [--dtype D] [--model-name-or-path P] [--for-vllm]``, or
    ``export_hf.py --for-vllm MODEL_DIR OUT_DIR``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="Lightning checkpoint (.ckpt) of a GRPO run (with --for-vllm: or a model folder)")
    parser.add_argument("out_dir", help="folder to write the Hugging Face model to")
    parser.add_argument("--dtype", help="cast the weights, e.g. bfloat16 (default: as trained, the checkpoint's)")
    parser.add_argument("--model-name-or-path", help="override the base model path recorded in the checkpoint")
    parser.add_argument(
        "--for-vllm", action="store_true", help="weights under the names vLLM loads (a LLaVA tower's), for vllm serve"
    )
    args = parser.parse_args(argv)
    if args.dtype is not None and not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        parser.error(f"--dtype: {args.dtype!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    if (Path(args.ckpt) / "config.json").is_file():  # a Hugging Face model folder (an FSDP checkpoint has none)
        if not args.for_vllm or args.dtype is not None or args.model_name_or_path is not None:
            parser.error(
                f"{args.ckpt} is a model folder, not a checkpoint: it is only copied, with --for-vllm (weights "
                "renamed for vLLM); --dtype and --model-name-or-path are for checkpoints"
            )
        try:
            renamed = copy_for_vllm(args.ckpt, args.out_dir)
        except ValueError as error:
            parser.error(str(error))
        print(f"copied to {args.out_dir} for vLLM ({renamed} weights renamed)")
        return
    out = export_checkpoint(
        args.ckpt, args.out_dir, dtype=args.dtype, model_name_or_path=args.model_name_or_path, for_vllm=args.for_vllm
    )
    print(f"exported to {out}")


if __name__ == "__main__":
    main()
