"""Supervised fine-tuning on prompt/response pairs: the cold start before GRPO, and SFT on rejection-sampled data.

``SFTModule`` trains next-token cross-entropy on the response tokens only. It builds its model with GRPO's own
``build_policy`` and is evaluated with GRPO's held-out evaluation (``val/accuracy``); ``SFTDataModule`` encodes
prompts with the same ``PromptEncoder`` a rollout uses, so an SFT model is encoded and evaluated exactly as GRPO
will see it. A vision-language model's examples are a rollout's rows (``encode_image_examples``: the prompt and its
images through the processor, the response as the completion) and its loss is the rollout's log-prob pass over them
(``completion_logprobs`` with each row's image inputs). It reads prompt/response rows (a ``.jsonl`` such as
``tools/rejection_sample.py`` writes, or a built-in task with ``response_column: answer``).
``grpo_lightning.callbacks.SaveHFModel`` writes the trained policy as a Hugging Face folder at the end of ``fit``:
the next stage's ``model.model_name_or_path``.

    python -m grpo_lightning sft fit --config configs/pipeline/1_cold_start_sft.yaml
    python -m grpo_lightning sft validate --config configs/pipeline/1_cold_start_sft.yaml --ckpt_path ...
"""

from __future__ import annotations

import functools
import math
import random
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from datasets import Dataset
from lightning import LightningDataModule, LightningModule
from torch import Tensor
from torch.utils.data import DataLoader

from grpo_lightning.callbacks.checkpointing import default_checkpoint
from grpo_lightning.cli import GRPOCLI
from grpo_lightning.config import ConfigError, EvalConfig, SamplingConfig
from grpo_lightning.engines import RolloutEngine, build_engine
from grpo_lightning.evaluation import HeldOutMetrics
from grpo_lightning.integrations.vision.images import IMAGE_COLUMNS
from grpo_lightning.lora import LoraConfig
from grpo_lightning.models.build import load_tokenizer, model_modality
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.models.policy_and_reference import attached_trainer, build_policy, context_length, sampling_context
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.data_sources import PromptData
from grpo_lightning.rollout.policy_side import PolicySide
from grpo_lightning.rollout.prompts import Prompt, PromptEncoder, check_prompt_rows, rename_prompt_column, response_text

IGNORE_INDEX = -100  # label of the tokens the loss skips (prompt and padding), as in Hugging Face models


def response_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Mean next-token cross-entropy over the labelled tokens, and how many there were.

    ``labels`` ``[B, T]`` is aligned with the inputs: ``labels[:, t]`` is the token at position ``t`` where it is
    a response token and ``IGNORE_INDEX`` elsewhere, so logits at ``t - 1`` are scored against it.
    """
    targets = labels[:, 1:]
    count = (targets != IGNORE_INDEX).sum()
    total = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / count.clamp(min=1), count


class EngineHandle:
    """The engine of ``data.engine`` for evaluation alone (``SFTDataModule``; a GRPO run's belongs to its
    ``RolloutCollector``), set up on the module's policy at first use (and again if the module builds a new
    policy, e.g. a second ``fit`` in the same process)."""

    def __init__(self, spec: str | RolloutEngine) -> None:
        self.engine = build_engine(spec)  # an unknown name is refused now, before any model loads

    def get(self, module: PolicySide) -> RolloutEngine:
        """The engine, sampling from ``module.policy``."""
        if self.engine.policy is not module.policy:
            self.engine.setup(module.policy, module.tokenizer, module.modality)
        return self.engine

    def current(self, module: PolicySide) -> RolloutEngine:
        """The engine on ``module``'s current weights (pushed first if it holds a stale copy)."""
        engine = self.get(module)
        if not engine.is_current(module.global_step):
            engine.load_weights(module.policy, module.global_step)
        return engine


class SFTModule(LightningModule):
    """Supervised fine-tuning of a causal LM on prompt/response pairs, loss on response tokens only."""

    def __init__(
        self,
        model_name_or_path: str | None = None,
        tiny_model: TinyModelConfig | None = None,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "linear", "cosine"] = "constant",
        min_lr_ratio: float = 0.0,
        lora: LoraConfig | None = None,
        gradient_checkpointing: bool = False,
        disable_dropout: bool = False,
    ) -> None:
        """
        Args:
            model_name_or_path: a Hugging Face causal LM (Hub name or local folder); unset = the tiny Llama of
                ``tiny_model`` with the built-in character tokenizer, randomly initialised.
            tiny_model: size of the built-in tiny Llama.
            lr: AdamW peak learning rate.
            weight_decay: AdamW weight decay.
            warmup_steps: linear warm-up, in optimizer steps.
            lr_schedule: after warm-up: ``constant``, or ``linear``/``cosine`` decay to ``min_lr_ratio × lr`` at the
                last step (``trainer.max_steps`` or ``max_epochs``).
            min_lr_ratio: final learning rate of the decaying schedules, as a fraction of ``lr``.
            lora: train LoRA adapters only (needs PEFT).
            gradient_checkpointing: recompute activations in the backward pass.
            disable_dropout: set the model's dropout to 0; off by default: supervised training has no ratio that
                dropout would bias, and the model's own dropout regularises it as usual.
        """
        super().__init__()
        if lr_schedule not in ("constant", "linear", "cosine"):
            raise ConfigError(f"model.lr_schedule must be constant, linear or cosine (got {lr_schedule!r})")
        if not 0 <= min_lr_ratio <= 1:
            raise ConfigError(f"model.min_lr_ratio must be in [0, 1] (got {min_lr_ratio})")
        self.save_hyperparameters()
        self.tiny_model, self.lora = tiny_model or TinyModelConfig(), lora
        self.modality = model_modality(model_name_or_path)  # what rows add to their ids (grpo_lightning/modality.py)
        self.tokenizer = load_tokenizer(model_name_or_path, modality=self.modality)
        self.policy: torch.nn.Module | None = None
        self.evaluator = HeldOutMetrics()

    def configure_model(self) -> None:
        if self.policy is None:
            self.policy, _ = build_policy(
                self.hparams.model_name_or_path,
                self.tiny_model,
                self.tokenizer,
                trainer=attached_trainer(self),
                mesh=self.device_mesh,
                no_dropout=self.hparams.disable_dropout,
                gradient_checkpointing=self.hparams.gradient_checkpointing,
                lora=self.lora,
                modality=self.modality,
            )

    # the policy side of held-out evaluation (``rollout/policy_side.py``)
    def rollout_context(self) -> AbstractContextManager[None]:
        return sampling_context(attached_trainer(self), self.policy)

    def context_length(self) -> int | None:
        return context_length(self.hparams.model_name_or_path, self.tiny_model)

    def loss(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """The mean cross-entropy of ``batch``'s response tokens, and how many there were. A vision-language model's
        batch (``image_batch``) is scored as a rollout's log-prob pass scores a completion, with each row's images."""
        if "vision" in batch:
            mask = batch["completion_mask"]
            logprobs, _ = completion_logprobs(
                self.policy, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask,
                vision=batch["vision"], modality=self.modality,
            )  # fmt: skip
            count = mask.sum()
            return -(logprobs * mask).sum() / count.clamp(min=1), count
        # Without an attention mask the model derives a block-diagonal causal mask from position ids that restart
        # at each packed example (transformers' packed-sequence detection), so packed examples never see each other.
        logits = self.policy(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
        return response_loss(logits, batch["labels"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, count = self.loss(batch)
        size = len(batch["labels"] if "labels" in batch else batch["completion_ids"])
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=size)
        self.log("train/response_tokens", count.float(), reduce_fx="sum", batch_size=size)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=size)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with linear warm-up, then constant, linear or cosine decay to ``min_lr_ratio``."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup, schedule = self.hparams.warmup_steps, self.hparams.lr_schedule
        total = max(int(self.trainer.estimated_stepping_batches), warmup + 1) if schedule != "constant" else 0
        floor = self.hparams.min_lr_ratio

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if schedule == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
            return floor + (1.0 - floor) * decay

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """``batch``: held-out completions generated and scored by the DataModule (``HeldOutSampler``)."""
        self.evaluator.update_and_log(self, batch, "val", "evaluator")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.evaluator.update_and_log(self, batch, "test", "evaluator")


def encode_examples(
    encoder: PromptEncoder, prompts: list[Prompt], responses: list[str]
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` per pair: the prompt encoded exactly as a rollout encodes it for generation
    (chat template or special tokens included), then the response's tokens and EOS, which is where a sampled
    completion ends. Labels are ``IGNORE_INDEX`` on the prompt."""
    tokenizer = encoder.tokenizer
    eos = tokenizer.eos_token_id
    # Completions are generated after the prompt's last token, so the response is tokenized on its own.
    response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    examples = []
    for prompt, response in zip(encoder.token_ids(prompts), response_ids, strict=True):
        answer = [*response, eos]
        examples.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
    return examples


def encode_image_examples(
    encoder: PromptEncoder, rows: dict[str, list[Any]], responses: list[str], max_length: int | None, where: str
) -> list[dict[str, Any]]:
    """A vision-language model's pairs as a rollout's rows: ``{"prompt", "response", "vision"}`` per row of ``rows``
    (columns ``prompt`` and the images'), the prompt and its images through the processor exactly as a rollout
    encodes them (``VisionPromptEncoder.encode_rows``: each image marker expanded, the row's image inputs), the
    response's tokens and EOS after it. ``max_length`` cuts the response, never the prompt: a prompt that fills it
    (its image tokens would lose their image) is refused in one line naming the row."""
    eos = encoder.tokenizer.eos_token_id
    response_ids = encoder.tokenizer(responses, add_special_tokens=False)["input_ids"]
    columns = [name for name in ("prompt", *IMAGE_COLUMNS) if name in rows]
    examples = []
    for row, response in enumerate(response_ids):
        prompt_ids, _, vision = encoder.encode_rows({name: [rows[name][row]] for name in columns})
        prompt, answer = prompt_ids[0].tolist(), [*response, eos]
        if max_length:
            if len(prompt) >= max_length:
                raise ConfigError(
                    f"data.max_length {max_length}: {where} row {row}'s prompt is {len(prompt)} tokens with its "
                    "images, and a vision-language model's prompt is never cut; raise data.max_length or leave the row "
                    "out"
                )
            answer = answer[: max_length - len(prompt)]
        examples.append({"prompt": prompt, "response": answer, "vision": dict(vision[0])})
    return examples


def image_batch(examples: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """``encode_image_examples``' examples as a rollout's rows: prompts left-padded (``prompt_ids``,
    ``prompt_mask``), responses right-padded (``completion_ids``, ``completion_mask``), each row's image inputs."""
    prompts, responses = [e["prompt"] for e in examples], [e["response"] for e in examples]
    width, length = max(map(len, prompts)), max(map(len, responses))
    batch = {
        "prompt_ids": torch.full((len(examples), width), pad_token_id, dtype=torch.long),
        "prompt_mask": torch.zeros((len(examples), width), dtype=torch.long),
        "completion_ids": torch.full((len(examples), length), pad_token_id, dtype=torch.long),
        "completion_mask": torch.zeros((len(examples), length), dtype=torch.long),
    }
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        batch["prompt_ids"][row, width - len(prompt) :] = torch.tensor(prompt)
        batch["prompt_mask"][row, width - len(prompt) :] = 1
        batch["completion_ids"][row, : len(response)] = torch.tensor(response)
        batch["completion_mask"][row, : len(response)] = 1
    return {**batch, "vision": [e["vision"] for e in examples]}


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` and ``position_ids`` of unpacked examples."""
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (ids, labs) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        mask[row, : len(ids)] = 1
    positions = torch.arange(length).expand(len(examples), length).clone()
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "position_ids": positions}


def pack_examples(
    examples: list[tuple[list[int], list[int]]], length: int, pad_token_id: int
) -> list[dict[str, Tensor]]:
    """Concatenate examples, in order, into rows of ``length`` tokens; position ids restart at every example.

    An example never spans two rows (one longer than ``length`` must have been truncated before). The rest of a
    row is padding: labels ``IGNORE_INDEX``, positions restarting at 0, so it forms a segment of its own.
    """
    rows: list[dict[str, Tensor]] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def close() -> None:
        fill = length - len(ids)
        row = {"input_ids": ids + [pad_token_id] * fill, "labels": labels + [IGNORE_INDEX] * fill}
        row["position_ids"] = positions + list(range(fill))
        rows.append({key: torch.tensor(values) for key, values in row.items()})
        ids.clear(), labels.clear(), positions.clear()

    for example_ids, example_labels in examples:
        if len(example_ids) > length:
            raise ValueError(f"an example of {len(example_ids)} tokens does not fit a packed row of {length}")
        if len(ids) + len(example_ids) > length:
            close()
        ids.extend(example_ids)
        labels.extend(example_labels)
        positions.extend(range(len(example_ids)))
    if ids:
        close()
    return rows


class SFTDataModule(PromptData, LightningDataModule):
    """Prompt/response pairs for ``SFTModule``; the held-out prompts of its evaluation."""

    def __init__(
        self,
        dataset: str,
        subset: str | None = None,
        task_kwargs: dict[str, Any] | None = None,
        train_split: str = "train",
        prompt_column: str = "prompt",
        response_column: str = "response",
        use_chat_template: bool | Literal["auto"] | None = "auto",
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        val_dataset: str | None = None,
        val_split: str | None = "test",
        val_fraction: float | None = None,
        batch_size: int = 32,
        packing: bool = False,
        max_length: int | None = None,
        limit: int | None = None,
        rewards: list[RewardSpec] | None = None,
        accuracy_reward: str | None = None,
        engine: str | RolloutEngine = "auto",
        sampling: SamplingConfig | None = None,
        eval: EvalConfig | None = None,
        seed: int = 0,
    ) -> None:
        """
        Args:
            dataset: a local ``.jsonl/.json/.parquet/.csv`` file, a built-in task name, or a Hub dataset.
            subset: the Hub dataset's configuration name.
            task_kwargs: options of the built-in task (also for a built-in ``val_dataset``).
            train_split: split of ``dataset`` (a local file is one split: the file).
            prompt_column: the column with the prompt: a string, or a list of ``{role, content}`` messages.
            response_column: the column with the target response (``answer`` for a built-in task): a string, or
                one ``{role: assistant, content}`` message.
            use_chat_template: render prompts with the tokenizer's chat template, as the GRPO stage will (a string
                as a user message); ``auto``: when the tokenizer has one.
            system_prompt: a system message put first in every prompt that has none (needs the chat template).
            chat_template_kwargs: further arguments of ``apply_chat_template`` (e.g. ``enable_thinking: false``).
            val_dataset: held-out prompts (same kinds as ``dataset``; needs the columns the rewards read). Unset:
                ``dataset``'s ``val_split`` for a built-in task or Hub dataset, none for a local file.
            val_split: held-out split; ``None`` disables evaluation.
            val_fraction: hold out this share of the training rows (drawn by ``seed``, never trained on) for
                evaluation instead (``rollout/data_sources.py``).
            batch_size: rows per optimizer step (per micro-batch with ``trainer.accumulate_grad_batches``).
            packing: concatenate examples into rows of ``max_length`` tokens (each still attends only to itself).
            max_length: the packed row length; without packing, examples longer than this lose their end.
            limit: train on the first ``limit`` rows only.
            rewards: reward terms of the evaluation only (``val/accuracy``, ``val/reward_mean``).
            accuracy_reward: the reward whose value >= 1 counts as correct (default: the first).
            engine: what generates the held-out completions (see ``RolloutDataModule``).
            sampling: generation settings of evaluation (``max_new_tokens``; top-p/top-k of the k samples).
            eval: k samples per held-out prompt for pass@k / maj@k, prompts per evaluation batch, the first
                ``limit`` held-out prompts only.
            seed: seed of the shuffling (a fresh order per epoch, and the order of packing) and of evaluation.
        """
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1 (got {batch_size})")
        if packing and not max_length:
            raise ConfigError("data.packing needs data.max_length, the length of a packed row in tokens")
        self.init_prompts(locals())  # the sources of the rows, the prompts' chat settings (``PromptData``)
        self.response_column = response_column
        self.batch_size, self.packing, self.max_length, self.limit = batch_size, packing, max_length, limit
        self.scorer = Scorer(rewards, accuracy_reward=accuracy_reward)
        self.engine = EngineHandle(engine)
        self.sampling, self.eval = sampling or SamplingConfig(), eval or EvalConfig()
        self.seed = seed
        self.train_examples: list[Any] | None = None
        self.val_data: Dataset | None = None

    @property
    def policy_side(self) -> PolicySide:
        """The LightningModule, as far as generation needs it (see ``rollout/policy_side.py``)."""
        return self.trainer.lightning_module

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.train_examples is None:
            data = rename_prompt_column(self.sources.training_rows(), self.prompt_column, self.sources.train_where)
            if self.response_column not in data.column_names:
                raise ConfigError(
                    f"data.dataset ({self.source}) has no response column {self.response_column!r} "
                    f"(columns: {', '.join(data.column_names)}); set data.response_column"
                )
            if self.limit is not None:
                data = data.select(range(min(self.limit, len(data))))
            encoder = self.encoder()
            check_prompt_rows(data, self.sources.train_where, encoder)
            responses = [response_text(r) for r in data[self.response_column]]
            if self.takes_images:
                self.train_examples = self._image_examples(encoder, data, responses)
            else:
                self.train_examples = self._text_examples(encoder, data, responses)
        self._setup_held_out()

    def _text_examples(self, encoder: PromptEncoder, data: Dataset, responses: list[str]) -> list[Any]:
        examples = encode_examples(encoder, data["prompt"], responses)
        if self.max_length:
            examples = [(ids[: self.max_length], labels[: self.max_length]) for ids, labels in examples]
        if self.packing:
            # Packed once, in a seeded shuffle; the DataLoader then shuffles the rows every epoch.
            random.Random(self.seed).shuffle(examples)
            examples = pack_examples(examples, self.max_length, self.policy_side.tokenizer.pad_token_id)
        return examples

    @property
    def takes_images(self) -> bool:
        """Whether the policy's rows carry inputs beyond their ids (its modality's: a vision-language model's)."""
        return self.policy_side.modality.has_row_inputs

    def _image_examples(self, encoder: PromptEncoder, data: Dataset, responses: list[str]) -> list[dict[str, Any]]:
        if self.packing:
            raise ConfigError(
                "data.packing: a vision-language model's examples are not packed (its forward places each example's "
                "image features by that example's own placeholders); set data.packing false"
            )
        rows = {name: list(data[name]) for name in ("prompt", *IMAGE_COLUMNS) if name in data.column_names}
        return encode_image_examples(encoder, rows, responses, self.max_length, self.sources.train_where)

    def _setup_held_out(self) -> None:
        held_out = self.sources.held_out(self.eval.limit) if self.val_data is None else None
        if held_out is not None:
            data, where = held_out
            data = rename_prompt_column(data, self.prompt_column, where)
            self.scorer.check_columns(data.column_names, where)
            check_prompt_rows(data, where, self.encoder())
            self.val_data = data

    def train_dataloader(self) -> DataLoader:
        pad = self.policy_side.tokenizer.pad_token_id
        # Packed rows are equal-length tensors already (the default collate stacks them); others are padded.
        collate = None if self.packing else functools.partial(pad_batch, pad_token_id=pad)
        if self.takes_images:  # a rollout's rows, with their images
            collate = functools.partial(image_batch, pad_token_id=pad)
        return DataLoader(
            self.train_examples,
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=collate,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_data is None:
            if self.trainer is not None and self.trainer.state.fn == "fit":
                return []  # no held-out data (see ``PromptSource``): training goes on without evaluation
            raise self.sources.no_held_out_error()
        return self.held_out_loader(self.val_data, lambda: self.engine.current(self.policy_side))

    test_dataloader = val_dataloader  # ``test`` evaluates the same held-out prompts


class SFTCLI(GRPOCLI):
    """The CLI of ``python -m grpo_lightning sft``: ``SFTModule`` and ``SFTDataModule``, with Lightning's usual
    Trainer defaults (GRPO's one-rollout-per-epoch settings do not apply to SFT). The command line finds it by
    its path (``cli.SUBCOMMANDS``)."""

    epochs_are_rounds = False  # epochs over a dataset: Lightning's accumulation, the summary counts epochs

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args and "model_class" not in kwargs:
            args = (SFTModule, SFTDataModule)
        kwargs.setdefault("trainer_defaults", {"num_sanity_val_steps": 0})
        super().__init__(*args, **kwargs)

    def default_callbacks(self, trainer: Any, callbacks: list[Any]) -> list[Any]:
        """Unless ``trainer.enable_checkpointing`` is false, a ``ModelCheckpoint`` keeping ``last.ckpt``."""
        checkpoint = default_checkpoint(trainer, callbacks, rounds=False)
        return [checkpoint] if checkpoint is not None else []

    def before_fit(self) -> None:
        pass
