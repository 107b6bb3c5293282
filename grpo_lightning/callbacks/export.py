"""``SaveHFModel``: the trained policy as a Hugging Face folder at the end of ``fit``."""

from __future__ import annotations

import copy
import os

from lightning import Callback, LightningModule, Trainer

from grpo_lightning.lora import is_peft_model
from grpo_lightning.strategies import gathered


class SaveHFModel(Callback):
    """At the end of ``fit``, write the policy and tokenizer as a Hugging Face folder (``save_pretrained``); a
    vision-language model's processor (image settings, chat template) goes with it.

    Works for ``SFTModule`` and ``GRPOModule`` alike; the folder is what the next stage's
    ``model.model_name_or_path`` takes. A LoRA policy is merged into a copy of its base weights first.
    """

    def __init__(self, dirpath: str) -> None:
        """
        Args:
            dirpath: the folder to write (created if needed).
        """
        self.dirpath = dirpath

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with gathered(pl_module.policy):  # sharded weights: gathered on every rank, written by rank 0
            if not trainer.is_global_zero:
                return
            policy = pl_module.policy
            if is_peft_model(policy):
                policy = copy.deepcopy(policy).merge_and_unload()
            os.makedirs(self.dirpath, exist_ok=True)
            policy.save_pretrained(self.dirpath)
            # The tokenizer, or what the policy's modality saves for it (a vision-language model's processor whole).
            pl_module.modality.save_processor(pl_module.tokenizer, self.dirpath)
