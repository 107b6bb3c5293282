"""The environment interface of multi-turn rollouts: reset from a dataset row, then one ``step`` per policy turn.

A trajectory alternates policy turns and environment answers, all in token space
(``integrations/environments/multiturn.py``):

    prompt → [first observation] → turn 1 → observation 1 → turn 2 → ... → final turn (EOS, or ``done``)

The environment sees text: the row it was reset from and each turn's decoded text; it answers with an observation
(text that is tokenized once and appended: in the model's context, out of the loss), reward parts and whether the
trajectory is over. The rollout makes one copy of the configured environment per trajectory (``spawn``), so an
environment may keep per-trajectory state on ``self``; what ``shared`` names (the tokenizer) is shared, not copied.

The limits of a trajectory (``max_turns``, tokens per turn, observation tokens) are settings of every environment;
the total length limit is ``data.sampling.max_new_tokens``, everything after the prompt counted. An observation
must fit ``max_observation_tokens``: ``fit_observation`` cuts the *text* inside its frame (a tool result inside its
closing tag and the next turn's header) and says so; the rollout cuts an oversize observation's tokens only as a
last resort, which cuts the frame too.

An ``Environment`` is a rollout kind (``rollout/kind.py: RolloutKind``): the round asks it for its scored rows and
it runs its trajectories through ``integrations/environments/multiturn.py``; what the round asks of a kind besides (its
reward weights, the data's checks, the tokenizer it is bound to, ``close``) is declared here with the environments'
answers.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.environments import multiturn, partial_turns
from grpo_lightning.rollout.kind import RolloutKind, check_rollout_kind

if TYPE_CHECKING:
    import torch

    from grpo_lightning.engines.base import RolloutEngine, SamplingParams
    from grpo_lightning.rewards.scorer import Scorer
    from grpo_lightning.rollout.batch import RolloutBatch
    from grpo_lightning.rollout.partial import Group
    from grpo_lightning.rollout.prompts import PromptEncoder

CUT_MARKER = "... [cut: {count} more characters]"
SHORT_CUT_MARKER = "..."  # where the full marker does not fit (a character per token, a tight limit)


def cut_marker(count: int) -> str:
    """What replaces the end of a text cut to fit: says how many characters were left out."""
    return CUT_MARKER.format(count=count)


@dataclass
class Step:
    """What the environment answers to one policy turn."""

    observation: str | None = None
    """Text appended after the turn (tokenized on its own, never merged with the turn's tokens); None = nothing."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward parts earned by this turn; summed over the trajectory, added to its reward as ``env/<name>``."""
    done: bool = False
    """The trajectory is over (the turn was the final answer)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counts to log (e.g. ``tool_calls``, ``tool_errors``, ``tool_seconds``): summed per trajectory, logged as
    ``rollout/<name>`` = their mean over the round's trajectories."""


class Environment(RolloutKind):
    """One trajectory's environment: ``reset(row)``, then ``step(turn_text)`` after every policy turn but the last.

    Subclasses implement ``reset`` and ``step``; ``stop_texts`` lists texts after which a turn ends early (a tool
    call's close tag), so that the environment can answer it before the policy goes on. An observation that may be
    long is best returned through ``fit_observation`` (its text cut to ``max_observation_tokens``, its frame kept).
    """

    gives_rewards = True  # its reward parts (``Step.rewards``, ``final_rewards``) are a learning signal
    multi_turn = True
    takes_process_rewards = False  # a trajectory's steps are not scored one by one yet
    names_vary_by_rank = True  # its metrics and parts are named by what a rank's trajectories did (a tool call)
    partial_rollouts_refused = None  # its trajectories span weight pushes: ``partial_turns.py``
    replays_exactly: bool = True
    """``reset`` on a row, then ``step`` on the same turns' texts, brings a fresh copy to the same state with the same
    observations (a deterministic environment): how a run resumed with partial rollouts restores its trajectories in
    flight (``partial_turns.py``; each replayed observation is checked). False (a server whose sessions do not
    restart alike): such a resume is refused in one line."""
    max_concurrency: int = 1
    """Active trajectories' environments stepped at once (in threads) in a turn; 1: one at a time, in this thread
    (an environment that waits on a server or a process sets more: OpenEnv's, skyrl-gym's ``max_concurrency``).
    With partial rollouts whose ``tokens_per_push`` is below ``max_new_tokens`` (and ``steps_in_threads`` or more than
    1 here) every step runs in a thread pool of this many threads, in the background of the segments
    (``partial_turns.py``): a pool keeps N × ⌈max_new_tokens / tokens_per_push⌉ groups in flight, so an environment
    that waits on I/O needs about that × G to step them at once."""
    steps_in_threads: bool = False
    """Its steps may run in a thread other than the main one even at ``max_concurrency`` 1 (they bound their time
    without SIGALRM, which works in the main thread only: ``ToolEnvironment``). With partial rollouts the steps of an
    environment that declares so, or whose ``max_concurrency`` is above 1, run in the background of the segments
    (``partial_turns.steps_in_background``); the others' inside the segment that ended their turn, as a round's."""
    tokenizer: Any = None
    """The policy's tokenizer, once ``setup`` (None before)."""
    shared: tuple[str, ...] = ("tokenizer",)
    """Attributes every trajectory's copy shares instead of copying: heavy and read-only (a subclass may add to it)."""
    chat_template_kwargs: dict[str, Any] = {}  # noqa: RUF012 - replaced, never mutated
    """``data.chat_template_kwargs`` (set by the data module before ``setup``): what renders a frame with the chat
    template (a tool result and the next assistant header) passes to it, as the prompts' rendering does."""

    def __init__(
        self, max_turns: int = 4, max_turn_tokens: int | None = None, max_observation_tokens: int = 64
    ) -> None:
        """
        Args:
            max_turns: policy turns per trajectory at most (the last one is scored whatever it holds).
            max_turn_tokens: tokens one policy turn may generate; None = ``data.sampling.max_new_tokens``.
            max_observation_tokens: tokens of one observation at most (``fit_observation`` cuts the text to fit).
        """
        for name, value in (("max_turns", max_turns), ("max_observation_tokens", max_observation_tokens)):
            if value < 1:
                raise ConfigError(f"data.environment.init_args.{name} must be >= 1 (got {value})")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ConfigError(
                f"data.environment.init_args.max_turn_tokens must be >= 1 or null (got {max_turn_tokens})"
            )
        self.max_turns, self.max_turn_tokens = max_turns, max_turn_tokens
        self.max_observation_tokens = max_observation_tokens

    def setup(self, tokenizer: Any) -> None:
        """Called once with the policy's tokenizer before the first rollout (e.g. to render a chat template)."""
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------------------------ the rollout kind
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
        """G trajectories per row against copies of this environment, scored on their final turns
        (``integrations/environments/multiturn.py: environment_rollout``)."""
        return multiturn.environment_rollout(
            self, rows, engine=engine, encoder=encoder, scorer=scorer, params=params, generator=generator,
            return_logprobs=return_logprobs, device=device, timings=timings,
        )  # fmt: skip

    def decode_segment(
        self,
        groups: list[Group],
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
        """A segment of partial rollouts over the trajectories in flight (``partial_turns.decode_segment``)."""
        return partial_turns.decode_segment(
            self, groups, engine=engine, encoder=encoder, params=params, budget=budget, version=version,
            generator=generator, return_logprobs=return_logprobs, device=device, held=held,
        )  # fmt: skip

    def settle_segment(self, held: dict[Any, Any]) -> float:
        """Wait for the steps the last segment launched in the background (``partial_turns.settle``)."""
        return partial_turns.settle(held)

    def pushes_spanned(self, max_new_tokens: int, tokens_per_push: int) -> int:
        """⌈max_new_tokens / tokens_per_push⌉, + ``max_turns`` when its steps run in the background
        (``partial_turns.pushes_spanned``)."""
        return partial_turns.pushes_spanned(self, max_new_tokens, tokens_per_push)

    def score_segment(
        self,
        groups: list[Group],
        *,
        encoder: PromptEncoder,
        scorer: Scorer,
        params: SamplingParams,
        device: torch.device | str,
        held: dict[Any, Any],
        timings: dict[str, float],
    ) -> RolloutBatch:
        """The ended groups of a segment, scored as a round's (``partial_turns.score_segment``)."""
        return partial_turns.score_segment(
            self, groups, encoder=encoder, scorer=scorer, params=params, device=device, held=held, timings=timings
        )

    def set_chat_template_kwargs(self, chat_template_kwargs: dict[str, Any]) -> None:
        """Kept as ``chat_template_kwargs``, for ``setup``'s frames."""
        self.chat_template_kwargs = chat_template_kwargs

    def bind(self, tokenizer: Any) -> None:
        """``setup(tokenizer)`` unless this environment was set up with that tokenizer already."""
        multiturn.setup_environment(self, tokenizer)

    def spawn(self) -> Environment:
        """A fresh copy for one trajectory: a deep copy, except the attributes ``shared`` names (the tokenizer)."""
        memo = {id(value): value for value in (getattr(self, name, None) for name in self.shared) if value is not None}
        return copy.deepcopy(self, memo)

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` tokenized on its own, as the rollout tokenizes an observation (needs ``setup``)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def fit_observation(
        self, text: str, render: Callable[[str], str] | None = None, max_chars: int | None = None
    ) -> str:
        """``render(text)`` within ``max_observation_tokens`` tokens, ``text`` cut to fit and the frame kept.

        ``render`` wraps the text in its frame (``<result>...</result>``, or the chat template's tool message up to
        the next assistant header); when the whole does not fit, or ``text`` is longer than ``max_chars``
        characters, the longest prefix of ``text`` that fits is kept, followed by ``cut_marker`` (how many
        characters were left out), or by ``...`` where that marker leaves no room. A binary search over the prefix
        length: O(log n) tokenizations. When even the frame and ``...`` do not fit, they are returned as they are
        (the rollout then cuts the tokens, a last resort).
        """
        render = render or (lambda inner: inner)
        keep = len(text) if max_chars is None else min(len(text), max_chars)

        def candidate(k: int, short: bool = False) -> str:
            marker = SHORT_CUT_MARKER if short else cut_marker(len(text) - k)
            return render(text if k >= len(text) else text[:k] + marker)

        def fits(k: int, short: bool = False) -> bool:
            return self.count_tokens(candidate(k, short)) <= self.max_observation_tokens

        if self.tokenizer is None or fits(keep):  # not set up (nothing to count with), or fits
            return candidate(keep)
        short = not fits(0)  # the full marker leaves no room: the short one
        if short and not fits(0, short):  # the frame alone is too long: the rollout's last resort cuts it
            return candidate(0, short)
        low, high = 0, keep - 1  # fits(low) holds, fits(keep) does not: the largest k that fits
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle, short) else (low, middle - 1)
        return candidate(low, short)

    @property
    def stop_texts(self) -> tuple[str, ...]:
        """Texts that end a policy turn (kept in it) so the environment can answer; none by default."""
        return ()

    def required_columns(self) -> tuple[str, ...]:
        """Dataset columns ``reset`` reads (checked before training)."""
        return ()

    def check_rows(self, data: Any, where: str) -> None:
        """Refuses, in one line (``ConfigError`` naming ``where`` and the row), rows of ``data`` (a ``Dataset`` with
        the ``required_columns``) that ``reset`` cannot start from; called before training. Accepts all by default."""
        return None

    def prompt_tools(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The function schemas the chat template lists in ``row``'s prompt (``apply_chat_template``'s ``tools``);
        None (the default): the prompt is rendered without tools. Reads only the columns ``required_columns``
        names (the check before training passes those alone)."""
        return None

    def trajectory_prompt(self, prompt: Any) -> Any:
        """The prompt this trajectory starts from, asked after ``reset``: the row's ``prompt`` by default (TRL's
        environments append reset's observation to its last message instead of answering after the prompt)."""
        return prompt

    def reward_view(self) -> Any:
        """This trajectory's entry of the ``environments`` column the reward functions get (TRL's reward functions
        read their rollouts' environment instances by that name): this copy of the environment by default."""
        return self

    def final_rewards(self) -> dict[str, float]:
        """Reward parts of the whole trajectory, asked once when it ends (however it ends: final answer, turn or
        length limit); added to the turns' ``Step.rewards``. None (an empty dict) by default."""
        return {}

    def reward_weights(self) -> dict[str, float]:
        """Each reward part's weight, by the part's name: the scorer weighs the part's column ``env_<name>`` with
        it where it weighs ``data.rewards`` (``rewards/scorer.py``), so that every advantage estimator sees it alike
        (GDPO normalises a column before weighing it). A part not named here weighs 1; none by default.

        A part is the environment's value as it is: a trajectory whose environment gave no part of a name (no turn
        earned it, ``final_rewards`` left it out) has None, "not applicable", in that column, as a reward function's
        None (TRL's rule for its environments' ``get_reward``)."""
        return {}

    def close(self) -> None:
        """Let go of what the environment holds across trajectories (sessions, a server the run started), asked
        when the run ends, also after an error; a later use may start them again. Nothing by default."""
        return None

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> str | None:
        """Start a trajectory (called on this trajectory's own copy, ``spawn``, once ``setup``).

        Args:
            row: the dataset row: ``prompt`` and the other columns (those ``required_columns`` names are checked
                before training).

        Returns:
            The first observation, appended after the prompt before the first policy turn, or None for none.
        """

    @abstractmethod
    def step(self, turn: str) -> Step:
        """Answer one policy turn (every turn but the last: the trajectory's final turn is scored, not answered).

        Args:
            turn: the turn's decoded text, special tokens left out; it ends at an end token, at one of
                ``stop_texts`` (kept) or at the turn's length limit.

        Returns:
            The observation to append (fit it with ``fit_observation``), this turn's reward parts and metrics,
                and whether the trajectory is over.
        """


def check_environment(environment: Any) -> RolloutKind | None:
    """``data.environment`` as given, refused with one line when it is not a rollout kind (``rollout/kind.py``)."""
    return check_rollout_kind(environment)
