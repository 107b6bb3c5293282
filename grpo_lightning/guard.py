"""The non-finite guard: a NaN/Inf loss or gradient never reaches the weights.

``GRPOModule.training_step`` queues each micro-batch's loss (:meth:`NonFiniteGuard.check_later`); before each
optimizer step :class:`NonFiniteGuard` checks those losses and the gradients together, with one device sync per
step (none per micro-batch; plus the ranks' agreement under data parallelism), names what was non-finite
(:func:`nonfinite_inputs`, :func:`nonfinite_terms`), and when anything was drops the gradients (the optimizer
then leaves every weight, and its own state, as they were), logs the round and the culprit, and stops the run
after ``max_skips`` such steps in a row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from lightning import LightningModule
from torch import Tensor

from grpo_lightning.errors import NonFiniteError as NonFiniteError  # re-exported: raised here

log = logging.getLogger(__name__)


def _local(t: Tensor) -> Tensor:
    # FSDP2 gradients are DTensors: each rank checks its own shard (the decision is then shared).
    return t.to_local() if hasattr(t, "to_local") else t


def _finite(values: Tensor, mask: Tensor | None = None) -> bool:
    values = _local(values)
    if mask is not None and mask.shape == values.shape:
        values = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return bool(torch.isfinite(values).all())


def nonfinite_inputs(batch: Mapping[str, Tensor]) -> list[str]:
    """The rollout inputs of a micro-batch that hold a NaN/Inf where the loss reads them."""
    mask = batch.get("loss_mask")
    names = {
        "advantages": "advantages (from the rewards)",
        "old_logprobs": "old-policy log-probs",
        "ref_logprobs": "reference log-probs (the KL term)",
    }
    return [label for key, label in names.items() if batch.get(key) is not None and not _finite(batch[key], mask)]


def nonfinite_terms(terms: Mapping[str, Tensor | None], mask: Tensor | None = None) -> list[str]:
    """The names of ``terms`` (log-probs, entropy, loss parts) that are not finite (under ``mask``, if given)."""
    return [name for name, value in terms.items() if value is not None and not _finite(value.detach(), mask)]


class NonFiniteGuard:
    """Per-step bookkeeping of non-finite values; see the module docstring."""

    def __init__(self, max_skips: int = 3) -> None:
        """
        Args:
            max_skips: stop the run once this many optimizer steps in a row were skipped.
        """
        self.max_skips = max_skips
        self.consecutive = 0  # skipped steps in a row
        self.total = 0  # skipped steps in the whole run
        self._culprits: list[str] = []  # what the micro-batches of the pending optimizer step found
        # (loss is finite, as a device tensor; what names the culprits) of each micro-batch of the pending step
        self._pending: list[tuple[Tensor, Callable[[], Sequence[Iterable[str]]]]] = []
        self.last_skipped = False  # whether the latest optimizer step was skipped (the LR schedule waits too)

    def before_step(self, module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """``on_before_optimizer_step``: skip the step (drop every gradient) if anything was non-finite."""
        trainer = module.trainer
        # Under fp16 AMP the GradScaler itself skips steps with inf gradients and lowers its scale, routinely at
        # the start of a run: counting those would stop healthy runs. The loss and its inputs are still checked.
        scaled = str(trainer.precision).startswith("16")
        culprits = self.should_skip(self.check_pending([] if scaled else module.named_parameters()))
        # Every rank skips if any has to: the replicas must stay identical.
        self.last_skipped = bool(trainer.strategy.reduce_boolean_decision(bool(culprits), all=False))
        module.log("train/nonfinite_skips", float(self.total + self.last_skipped), on_step=True, batch_size=1)
        if not self.last_skipped:
            self.stepped()
            return
        # The optimizer passes over parameters without a gradient: no update, no weight decay, no moment change.
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
        self.skipped(culprits, trainer.current_epoch + 1, trainer.global_step)

    def check_later(self, loss: Tensor, find_culprits: Callable[[], Sequence[Iterable[str]]]) -> None:
        """Queue a micro-batch's loss for the check before its optimizer step: no device sync now.

        ``find_culprits`` runs only if the loss was not finite; it returns the stages, from cause to effect
        (inputs, then the loss terms computed from them), that name what was non-finite: the first non-empty
        one is kept.
        """
        self._pending.append((torch.isfinite(loss.detach()).all(), find_culprits))

    def clear_pending(self) -> None:
        """Forget the losses and culprits queued for a step that will not come (a fit stopped mid-window)."""
        self._pending, self._culprits = [], []

    def check_pending(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
        """Checks the queued losses and the gradients (one device sync for all); records the micro-batches'
        culprits and returns the names of the parameters whose gradient holds a NaN/Inf."""
        pending, self._pending = self._pending, []
        grads = [(name, _local(p.grad)) for name, p in named_parameters if p.grad is not None]
        flags = [finite for finite, _ in pending] + [torch.isfinite(g).all() for _, g in grads]
        if not flags:
            return []
        finite = torch.stack(flags)
        if bool(finite.all()):
            return []
        finite = finite.tolist()
        for (_, find_culprits), ok in zip(pending, finite):
            if not ok:
                stages = find_culprits()
                for culprit in next((list(stage) for stage in stages if stage), []):
                    if culprit not in self._culprits:
                        self._culprits.append(culprit)
        return [name for (name, _), ok in zip(grads, finite[len(pending) :]) if not ok]

    def should_skip(self, bad_gradients: list[str]) -> list[str]:
        """The culprits of the pending step (empty: take it); clears them for the next step.

        Only the most upstream ones are named: a NaN advantage makes the loss and every gradient NaN too, and
        naming those would hide the cause.
        """
        culprits, self._culprits = self._culprits, []
        if culprits:
            return culprits
        if bad_gradients:
            more = len(bad_gradients) - 3
            shown = ", ".join(bad_gradients[:3]) + (f" and {more} more" if more > 0 else "")
            return [f"gradients of {shown} (the loss was finite)"]
        return []

    def skipped(self, culprits: list[str], round_index: int, step: int) -> None:
        """Count a skipped step and log it; raise :class:`NonFiniteError` after ``max_skips`` in a row."""
        self.consecutive += 1
        self.total += 1
        what = "; ".join(culprits) if culprits else "a value on another rank"
        log.warning(
            "round %d, optimizer step %d: non-finite %s; step skipped, weights unchanged (%d in a row, at most %d)",
            round_index,
            step,
            what,
            self.consecutive,
            self.max_skips,
        )
        if self.consecutive >= self.max_skips:
            raise NonFiniteError(
                f"{self.consecutive} optimizer step{'s' if self.consecutive > 1 else ''} in a row had non-finite "
                f"values (last: round {round_index}, "
                f"step {step}: {what}); stopped so that no NaN reaches the weights. Raise "
                "model.max_nonfinite_skips to tolerate more, or lower model.lr"
            )

    def stepped(self) -> None:
        """A step was taken: the run of skips is over."""
        self.consecutive = 0

    def state_dict(self) -> dict[str, int]:
        """Counts to keep in checkpoints."""
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore :meth:`state_dict`'s counts."""
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
