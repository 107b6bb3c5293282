"""KL control and reference-model sync: the two callbacks that change β or π_ref during a run.

They act through ``GRPOModule``'s public methods (``set_beta``, ``update_reference``). ``KLController`` keeps
the controlled β in its checkpoint state; a moved π_ref is saved by the module itself.
"""

from __future__ import annotations

from typing import Any

from lightning import Callback, LightningModule, Trainer

from grpo_lightning.config import ConfigError
from grpo_lightning.rollout.datamodule import latest_rollout


def adaptive_beta(beta: float, kl: float, target: float, num_samples: int, horizon: int) -> float:
    """One step of the adaptive KL controller (Ziegler et al. 2019, used by PPO-RLHF):

    β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n / horizon)
    """
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * num_samples / horizon)


class KLController(Callback):
    """Logs the round's KL to the reference model and, when ``target_kl`` is set, adapts β towards it.

    The KL of a round is the mean of the ``train/kl`` values of its optimizer steps; ``n`` in the update is the
    number of completions the round trained on.
    """

    def __init__(self, target_kl: float | None = None, horizon: int = 10_000) -> None:
        if target_kl is not None and target_kl <= 0:
            raise ConfigError(f"KLController.target_kl must be > 0 (got {target_kl})")
        if horizon <= 0:
            raise ConfigError(f"KLController.horizon must be > 0 (got {horizon})")
        self.target_kl, self.horizon = target_kl, horizon
        self.beta: float | None = None  # the controlled β, restored from checkpoints
        self._kls: list[float] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.target_kl is not None and pl_module.objective.beta <= 0:
            raise ConfigError("KLController.target_kl needs model.objective.beta > 0 to start from (and a reference)")
        if self.beta is not None:
            pl_module.set_beta(self.beta)  # resumed: continue from the controlled value

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        kl = trainer.callback_metrics.get("train/kl")
        if kl is not None:
            self._kls.append(float(kl))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._kls:
            return
        kl = sum(self._kls) / len(self._kls)
        self._kls.clear()
        pl_module.log("train/kl_round", kl)
        if self.target_kl is not None:
            rollout = latest_rollout(trainer)
            num_samples = len(rollout) * trainer.world_size if rollout is not None else 1
            self.beta = adaptive_beta(pl_module.beta, kl, self.target_kl, num_samples, self.horizon)
            pl_module.set_beta(self.beta)
        pl_module.log("train/beta", pl_module.beta)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.beta = state_dict.get("beta")


class ReferenceSync(Callback):
    """Every ``sync_steps`` optimizer steps, π_ref ← α·π_θ + (1 − α)·π_ref (TR-DPO style reference updates).

    The reference then differs from the starting weights, so the module keeps it in its checkpoints.
    """

    def __init__(self, sync_steps: int = 64, alpha: float = 0.6) -> None:
        if sync_steps < 1:
            raise ConfigError(f"ReferenceSync.sync_steps must be >= 1 (got {sync_steps})")
        if not 0 < alpha <= 1:
            raise ConfigError(f"ReferenceSync.alpha must be in (0, 1] (got {alpha})")
        self.sync_steps, self.alpha = sync_steps, alpha
        self._last_synced: int | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if pl_module.ref is None:
            raise ConfigError("ReferenceSync needs a reference model: set model.objective.beta > 0 (without LoRA)")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        # global_step counts optimizer steps; with gradient accumulation it repeats across micro-batches.
        step = trainer.global_step
        if step == 0 or step % self.sync_steps or self._last_synced == step:
            return
        self._last_synced = step
        pl_module.update_reference(self.alpha)
        pl_module.log("train/ref_synced_at", float(step))
