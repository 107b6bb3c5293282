"""``UpdatePlan``: the update half of a round, μ passes × mini-batches (optimizer steps) × micro-batches: one place.

DeepSeekMath's Algorithm 1 (GRPO), for each rollout of B prompts × G completions::

    for GRPO iteration = 1, ..., μ:              # ``num_iterations`` passes over the rollout, each reshuffled
        update π_θ by maximising the objective    # one pass: rows / mini_batch_size optimizer steps

which is PPO's "K epochs × minibatches of size M" over the rollout: a pass cuts the rollout into mini-batches, each
one optimizer step; a mini-batch is trained in micro-batches (one forward/backward each) whose gradients accumulate
into that step (``micro_batches_per_step``, Lightning's ``accumulate_grad_batches``). So a round makes
``optimizer_steps = μ × rows / mini`` steps and ``micro_batches_per_round = optimizer_steps × mini / micro``
forwards — the number of batches the DataModule serves per epoch.

Every consumer reads these numbers from the plan: the collector (the round's optimizer steps, π_old's need),
``RolloutBatch.micro_batches`` (the cut), the DataModule (the epoch's length), the config checks (the sizes must
divide, the Trainer's accumulation must agree) and ``GRPOModule.training_step`` (where a micro-batch stands, the
loss's scale). ``plan_update`` builds it from ``data.update``; nothing else computes them.

Rows are planned on trajectories: an agent's session may make several rows, and dynamic sampling keeps the rollout
at its planned size, so the counts never depend on what a round sampled (see ``RolloutBatch.micro_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_lightning.config import ConfigError, UpdateConfig


@dataclass(frozen=True)
class Place:
    """Where micro-batch ``index`` of a round stands in its plan (all counted from 0)."""

    index: int
    """The micro-batch's number in the round."""
    iteration: int
    """The pass over the rollout (of μ)."""
    mini_batch: int
    """The mini-batch of that pass: one optimizer step."""
    micro_batch: int
    """The micro-batch of that mini-batch (of ``micro_batches_per_step``)."""
    ends_step: bool
    """The mini-batch's last micro-batch: its gradients are complete and the optimizer steps after it."""


@dataclass(frozen=True)
class UpdatePlan:
    """One round's update: μ passes over ``rows_per_round`` trajectories in mini-batches of micro-batches."""

    num_iterations: int
    """μ: optimisation passes over each rollout (DeepSeekMath Alg. 1's inner loop, PPO's epochs)."""
    rows_per_round: int
    """Trajectories per rank per round: ``prompts_per_round × G`` (fixed, also with dynamic sampling)."""
    mini_batch_size: int
    """Trajectories per optimizer step (the whole rollout when unset)."""
    micro_batch_size: int
    """Trajectories per forward/backward (the whole mini-batch when unset)."""

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches whose gradients make one optimizer step: the gradient accumulation."""
        return self.mini_batch_size // self.micro_batch_size

    @property
    def mini_batches_per_pass(self) -> int:
        """Optimizer steps per pass over the rollout."""
        return self.rows_per_round // self.mini_batch_size

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per round: μ passes × mini-batches per pass."""
        return self.num_iterations * self.mini_batches_per_pass

    @property
    def micro_batches_per_round(self) -> int:
        """Forwards per round: optimizer steps × micro-batches per step (the batches of an epoch)."""
        return self.optimizer_steps * self.micro_batches_per_step

    def check(self) -> None:
        """Refuse sizes that do not divide (a pass would end inside a mini-batch, or a step inside a micro-batch)."""
        if self.rows_per_round % self.mini_batch_size:
            raise ConfigError(
                f"data.update.mini_batch_size ({self.mini_batch_size}) must divide the rollout of prompts_per_round × "
                f"group_size = {self.rows_per_round}"
            )
        if self.mini_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"data.update.micro_batch_size ({self.micro_batch_size}) must divide data.update.mini_batch_size "
                f"({self.mini_batch_size})"
            )

    def place(self, index: int) -> Place:
        """Where the round's micro-batch ``index`` stands: its pass, mini-batch and micro-batch."""
        step, micro = divmod(index, self.micro_batches_per_step)
        iteration, mini = divmod(step, self.mini_batches_per_pass)
        return Place(index, iteration, mini, micro, ends_step=micro == self.micro_batches_per_step - 1)


def plan_update(update: UpdateConfig, *, prompts_per_round: int, group_size: int) -> UpdatePlan:
    """The plan of ``data.update`` for a rollout of ``prompts_per_round × group_size`` (an unset mini-batch is the
    rollout, an unset micro-batch the mini-batch). Not checked here (``UpdatePlan.check``): the data side refuses
    bad sizes before training."""
    rows = prompts_per_round * group_size
    mini = update.mini_batch_size or rows
    return UpdatePlan(update.num_iterations, rows, mini, update.micro_batch_size or mini)
