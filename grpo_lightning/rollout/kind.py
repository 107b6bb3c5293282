"""``RolloutKind``: the one interface of a round's rollout: a round's rows in, a scored ``RolloutBatch`` out.

Every way the run samples is an implementation of it, and the core calls this interface without knowing which:

- single-turn sampling, the core's own (``rollout/sample_and_score.py: SingleTurn``): what ``data.environment:
  null`` means;
- multi-turn environments (``integrations/environments/base.Environment`` and its subclasses: tools, OpenEnv, skyrl-gym,
  TRL's classes), through ``integrations/environments/multiturn.py``;
- agents that run their own loop (``integrations/agents/environment.AgentEnvironment``), through
  ``integrations/agents/rollout.py``;
- a user's class: ``data.environment: {class_path: my_pkg.MyRollout, init_args: {...}}``.

Every implementation scores through the round's ``Scorer``: reward functions and the kind's own reward parts (an
environment's, an agent's return) are columns of one rule (``rewards/combine.combine_columns``: None is left out of
the total and the baseline; a row no column scores is unscorable); ``score_completions`` in
``rollout/sample_and_score.py`` is that path for completions a kind sampled itself.

What else the core asks of the rollout is declared here, each with the default of single-turn sampling: the class
attributes (what the kind gives or needs) and the methods (checks of the data before training, the tokenizer it is
bound to, what it holds until the run ends).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from grpo_lightning.config import ConfigError, pushes_per_sequence

if TYPE_CHECKING:
    import torch

    from grpo_lightning.engines.base import RolloutEngine, SamplingParams
    from grpo_lightning.rewards.scorer import Scorer
    from grpo_lightning.rollout.batch import RolloutBatch
    from grpo_lightning.rollout.prompts import PromptEncoder


class RolloutKind(ABC):
    """How a round's rows become scored completions (see the module docstring).

    To add one: subclass it, implement ``rollout`` and override what differs from single-turn sampling (the class
    attributes declare what the kind gives or needs; the methods are the checks before training, the tokenizer it is
    bound to, what it holds until the run ends). Its ``__init__`` arguments are its settings
    (``data.environment: {class_path: my_pkg.MyRollout, init_args: {...}}``). For a multi-turn rollout against an
    environment that answers each turn, subclass ``integrations.environments.Environment`` instead: it implements
    ``rollout`` for you. At a rollout lag the kind is pickled into the background process with the rest of
    ``data``: its settings must pickle.
    """

    gives_rewards: bool = False
    """Scores its rows with reward parts of its own (an environment's, an agent's return): a learning signal
    without ``data.rewards`` (the checks before training count it as one)."""
    multi_turn: bool = False
    """Samples later turns with the whole context so far as their prompt (a prefix language model's passes read the
    first prompt alone as its prefix: refused with one)."""
    carries_images: bool = True
    """Gives the policy the prompt's images (a vision-language model's); an agent's calls carry text only."""
    takes_process_rewards: bool = True
    """Its completions can be scored step by step (process rewards); a multi-turn trajectory cannot yet."""
    names_vary_by_rank: bool = False
    """The names of its metrics and reward parts depend on what a rank's rows did (a tool call): ranks agree on
    them before the advantages (``rollout/round.py: finish_round``), a collective the others skip."""
    partial_rollouts_refused: str | None = "it implements no decode_segment and score_segment"
    """Why its rollouts cannot continue across a weight push (``data.schedule.partial_rollouts``: refused in one line
    before training, this reason in it); None: they can: single-turn sampling (``rollout/partial.py``), a multi-turn
    kind through ``decode_segment`` and ``score_segment``."""

    @abstractmethod
    def rollout(
        self,
        rows: dict[str, list[Any]],
        *,
        engine: RolloutEngine,
        encoder: PromptEncoder,
        scorer: Scorer,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
        device: torch.device | str = "cpu",
        timings: dict[str, float] | None = None,
    ) -> RolloutBatch:
        """``params.group_size`` completions or trajectories (one when greedy) for each row of ``rows``, scored.

        Sample with ``engine`` (set up and on the current weights: the core pushed them), never by other means: the
        loss models the engine's distribution. Score through ``scorer`` (``rollout/sample_and_score.py:
        score_completions`` does it for completions the kind sampled itself), so that reward functions and the
        kind's own reward parts meet under one rule. The core then computes the advantages, π_old and π_ref.

        Args:
            rows: the round's rows, by column: ``prompt`` and the dataset's other columns, one value per row.
            engine: the rollout engine to sample with.
            encoder: turns the rows' prompts into left-padded ids (``encode_rows``) and completions into text
                (``decode``).
            scorer: the round's reward functions, with their settings (on error, time limit).
            params: what to sample: group size, lengths, temperature, filters (``greedy`` for evaluation).
            generator: the round's random stream, to pass to ``engine.generate``: a resumed run then samples what
                an uninterrupted one would have.
            return_logprobs: keep the engine's log-probs of the sampled tokens (``RolloutBatch.engine_logprobs``).
            device: where the batch's tensors go.
            timings: when given, accumulates seconds under ``generate`` and ``score`` (and ``environment``: the
                part of generating spent outside the engine).

        Returns:
            The scored rows, ``len(rows["prompt"]) × group_size`` trajectories, a row's group adjacent, in the
                rows' order (more rows where one trajectory makes several: ``RolloutBatch.trajectory``).
        """

    def decode_segment(
        self,
        groups: list[Any],
        *,
        engine: RolloutEngine,
        encoder: PromptEncoder,
        params: SamplingParams,
        budget: int,
        version: int,
        generator: torch.Generator | None,
        return_logprobs: bool,
        device: torch.device | str,
        held: dict[Any, Any],
    ) -> float:
        """One segment of partial rollouts for a multi-turn kind (``multi_turn``; ``rollout/partial.py:
        run_segment``): every unfinished sequence of ``groups`` (``rollout/partial.py: Group``) decoded at most
        ``budget`` more model tokens under the weights ``version`` the engine holds, its ``Sample`` updated in place
        (each token's μ, policy log-prob and version; the kind's own state, plain data, in ``Sample.state``).
        ``held``: what the kind keeps between segments in the background process (live environments), by ``(group
        number, sample)``; a resumed run starts with it empty. Returns the seconds spent outside the engine."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode a segment of partial rollouts")

    def settle_segment(self, held: dict[Any, Any]) -> float:
        """Before a segment of partial rollouts (its first act: ``rollout/partial.py: run_segment``): wait for what
        the last segment left running in the background (``held``: an environment's steps). The seconds waited."""
        return 0.0

    def pushes_spanned(self, max_new_tokens: int, tokens_per_push: int) -> int:
        """The most weight pushes one of its rollouts spans with partial rollouts (what ``max_staleness`` must cover,
        checked before training): ⌈max_new_tokens / tokens_per_push⌉, a sequence's."""
        return pushes_per_sequence(max_new_tokens, tokens_per_push)

    def score_segment(
        self,
        groups: list[Any],
        *,
        encoder: PromptEncoder,
        scorer: Scorer,
        params: SamplingParams,
        device: torch.device | str,
        held: dict[Any, Any],
        timings: dict[str, float],
    ) -> RolloutBatch:
        """The ended ``groups`` (every sample ended; ``decode_segment``'s) scored as ``rollout`` scores its rows: G
        rows per group, adjacent, in order."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a segment of partial rollouts")

    def reward_weights(self) -> dict[str, float]:
        """Each of the kind's own reward parts' weight, by the part's name (a part not named weighs 1); none by
        default."""
        return {}

    def set_chat_template_kwargs(self, chat_template_kwargs: dict[str, Any]) -> None:
        """``data.chat_template_kwargs``, given once when the data module is built (before ``bind``): what renders
        the kind's own text with the chat template passes to it, as the prompts' rendering does. Unused by
        default."""
        return None

    def bind(self, tokenizer: Any) -> None:
        """The policy's tokenizer, given before the data's checks (and again whenever it is another object); a
        chat format the kind cannot tell, or a limit it cannot keep, is refused here. Nothing by default."""
        return None

    def required_columns(self) -> tuple[str, ...]:
        """Dataset columns the kind reads (checked before training); none by default."""
        return ()

    def check_rows(self, data: Any, where: str) -> None:
        """Refuses, in one line (``ConfigError`` naming ``where`` and the row), rows of ``data`` (a ``Dataset``
        with the ``required_columns``) the kind cannot start from; called before training. Accepts all by
        default."""
        return None

    def prompt_tools(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The function schemas the chat template lists in ``row``'s prompt (their tokens count in the length
        check before training); None (the default): none."""
        return None

    def close(self) -> None:
        """Let go of what the kind holds across rounds (sessions, a server the run started), asked when the run
        ends, also after an error. Nothing by default."""
        return None


def check_rollout_kind(value: Any) -> RolloutKind | None:
    """``data.environment`` as given (None: single-turn sampling), refused in one line when it is not a
    ``RolloutKind``."""
    if value is None or isinstance(value, RolloutKind):
        return value
    raise ConfigError(
        "data.environment must be {class_path: ..., init_args: {...}} of a "
        "grpo_lightning.integrations.environments.Environment "
        f"or grpo_lightning.rollout.kind.RolloutKind subclass (got {type(value).__name__})"
    )
