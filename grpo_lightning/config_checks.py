"""Up-front checks: settings, data and checkpoints that cannot work are refused before training, in one line.

Each check raises :class:`~grpo_lightning.config.ConfigError` with a message that names the setting or the data
row at fault (the CLI prints it as ``error: ...``), or fixes what is safe to fix and says so in a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from grpo_lightning.config import ConfigError, SamplingConfig, ScheduleConfig, UpdateConfig, pushes_per_sequence
from grpo_lightning.update_plan import UpdatePlan, plan_update

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)

# Settings that decide the shape of the weights: a checkpoint made with other values cannot be loaded.
STRUCTURAL_HPARAMS = ("model_name_or_path", "tiny_model", "lora")


# ------------------------------------------------------------------------------------------ numeric settings
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_least(low: float, null: bool = False) -> Callable[[Any], bool]:
    return lambda v: (null and v is None) or (_number(v) and v >= low)


def _integer_at_least(low: int, null: bool = False) -> Callable[[Any], bool]:
    return lambda v: (null and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low)


def _above(low: float, null: bool = False) -> Callable[[Any], bool]:
    return lambda v: (null and v is None) or (_number(v) and v > low)


# Numeric settings that the class taking them does not refuse itself, or not before torch or Lightning fail on
# them with a traceback (or accept them and misbehave: a negative gradient_clip_val flips the gradients). Each:
# (accepts the value, what it must be). ``check_setting_ranges`` applies them to the parsed config.
SETTING_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.lr": (_at_least(0), ">= 0"),
    "model.weight_decay": (_at_least(0), ">= 0"),
    "model.warmup_steps": (_at_least(0), ">= 0"),
    "model.logprob_batch_size": (_at_least(1), ">= 1"),
    "data.reward_timeout_s": (_above(0, null=True), "> 0, or null for no limit"),
    "data.prompts_per_round": (_at_least(1), ">= 1"),
    "data.sampling.max_sampling_rounds": (_at_least(1), ">= 1"),
    "data.update.num_iterations": (_at_least(1), ">= 1"),
    "data.update.mini_batch_size": (_at_least(1, null=True), ">= 1, or null for the whole rollout"),
    "data.update.micro_batch_size": (_at_least(1, null=True), ">= 1, or null for the whole mini-batch"),
    "data.eval.batch_size": (_at_least(1), ">= 1"),
    "data.eval.limit": (_at_least(0, null=True), ">= 0, or null for all held-out prompts"),
    "data.schedule.rollout_lag": (_integer_at_least(0), "an integer >= 0"),
    "data.schedule.rollout_threads": (_at_least(1, null=True), ">= 1, or null for half of this process's threads"),
    "data.schedule.rollout_timeout_s": (_above(0), "> 0"),
    "data.schedule.max_staleness": (_integer_at_least(1), "an integer >= 1"),
    "data.schedule.tokens_per_push": (
        _integer_at_least(1, null=True),
        "an integer >= 1, or null for a quarter of max_new_tokens",
    ),
    "trainer.accumulate_grad_batches": (_at_least(1), ">= 1"),
    "trainer.gradient_clip_val": (_at_least(0, null=True), ">= 0, or null for no clipping"),
    "trainer.check_val_every_n_epoch": (_at_least(1, null=True), ">= 1, or null"),
    # An int counts training batches (0 divides by zero in Lightning's loop), a float is a fraction of an epoch.
    "trainer.val_check_interval": (
        lambda v: not _number(v) or (v >= 1 if isinstance(v, int) else v > 0),
        "> 0 (a fraction of an epoch, or >= 1 batches), or null",
    ),
}


def check_ranges(section: str, settings: Mapping[str, Any] | Any) -> None:
    """Refuse the settings of ``section`` (``model``, ``data``, ``trainer``) outside ``SETTING_RANGES``.

    ``settings``: the section's values (a mapping, a parsed-config namespace, or a class's ``hparams``), a group's
    settings inside it (``data.update.mini_batch_size``) as a mapping or a settings object; settings it does not
    hold are not checked. The message names the setting, in one line.
    """
    settings = _plain(settings)
    for name, (accepts, must_be) in SETTING_RANGES.items():
        group, _, key = name.partition(".")
        if group != section:
            continue
        found, value = _setting_at(settings, key.split("."))
        if found and not accepts(value):
            raise ConfigError(f"{name} must be {must_be} (got {value!r})")


def _setting_at(settings: Any, path: list[str]) -> tuple[bool, Any]:
    """The value at ``path`` inside plain ``settings`` (a group left unset, None, holds nothing to check)."""
    for key in path:
        if not isinstance(settings, Mapping) or key not in settings:
            return False, None
        settings = settings[key]
    return True, settings


def check_batch_sizes(plan: UpdatePlan, accumulate: int) -> int:
    """The rollout splits into mini-batches (optimizer steps) of micro-batches (forwards), one accumulation each.

    Returns the gradient accumulation the plan implies, ``mini / micro``. ``accumulate`` (the Trainer's) must equal
    it, or be 1 (Lightning's default: unset), which the caller then replaces by it.
    """
    plan.check()
    wanted = plan.micro_batches_per_step
    if accumulate not in (1, wanted):
        raise ConfigError(
            f"trainer.accumulate_grad_batches = {accumulate} contradicts data.update.mini_batch_size / "
            f"data.update.micro_batch_size = {wanted}: leave it unset (it is derived) or make them agree"
        )
    return wanted


def check_accumulation(accumulate: int, plan: UpdatePlan) -> None:
    """The Trainer's gradient accumulation against the round's plan (``check_batch_sizes``), before training.

    ``mini / micro`` micro-batches make an optimizer step; Lightning steps every ``accumulate_grad_batches``. The
    data side checks they agree and never sets the Trainer's setting: the CLI derives it from the batch sizes when
    the config leaves it unset (``derive_accumulation``); a ``Trainer`` built in Python is given it.
    """
    wanted = check_batch_sizes(plan, accumulate)
    if accumulate != wanted:
        raise ConfigError(
            f"trainer.accumulate_grad_batches = {accumulate}, but data.update.mini_batch_size / "
            f"data.update.micro_batch_size = {wanted} micro-batches make an optimizer step: set "
            f"Trainer(accumulate_grad_batches={wanted}) (the CLI derives it when unset)"
        )


def derive_accumulation(config: Any) -> None:
    """The CLI's ``trainer.accumulate_grad_batches`` from ``data``'s batch sizes, where the config leaves it unset
    (1, Lightning's default): asking for it twice would only make room for a contradiction, which is refused."""
    data, trainer = config.get("data"), config.get("trainer")
    if data is None or trainer is None:
        return
    sampling, update = data.get("sampling"), data.get("update")
    group_size = sampling.get("group_size") if sampling is not None else None
    if not isinstance(group_size, int):
        group_size = SamplingConfig().group_size
    sizes = UpdateConfig()  # ``data.update`` left unset: its defaults
    if update is not None:
        sizes = UpdateConfig(
            num_iterations=update.get("num_iterations") or 1,
            mini_batch_size=update.get("mini_batch_size"),
            micro_batch_size=update.get("micro_batch_size"),
        )
    plan = plan_update(sizes, prompts_per_round=data.get("prompts_per_round"), group_size=group_size)
    accumulate = trainer.get("accumulate_grad_batches") or 1
    wanted = check_batch_sizes(plan, accumulate)
    if accumulate != wanted:
        log.info(
            "trainer.accumulate_grad_batches = %d (data.update.mini_batch_size / data.update.micro_batch_size)", wanted
        )
        trainer["accumulate_grad_batches"] = wanted


def check_round_settings(*, engine: Any, update: UpdateConfig, schedule: ScheduleConfig, curriculum: bool) -> None:
    """What a round cannot do, refused in one line before training: π_old from log-probs that are not the
    policy's, and the combinations a rollout lag cannot take."""
    old_logprobs, rollout_lag = update.old_logprobs, schedule.rollout_lag
    if old_logprobs == "sampler" and rollout_lag > 0:
        raise ConfigError(
            "data.update.old_logprobs: sampler takes π_old from the engine, which at data.schedule.rollout_lag > 0 "
            "sampled an older policy; set data.schedule.off_policy_correction: behaviour for a ratio to the sampler, "
            "or old_logprobs: auto"
        )
    if curriculum and rollout_lag > 0:
        raise ConfigError(
            "data.curriculum picks each round's prompts from the latest pass rates, which a background process "
            "sampling rounds ahead (data.schedule.rollout_lag > 0) does not have yet; use one or the other"
        )
    if old_logprobs == "sampler" and not engine.shares_weights:
        raise ConfigError(
            f"data.update.old_logprobs: sampler takes π_old from the {engine.name} engine, whose log-probs are not "
            "the trainer's; use auto or recompute (the ratio needs the trainer's π_old)"
        )


def check_partial_rollouts(
    schedule: ScheduleConfig, *, sampling: SamplingConfig, engine: Any, environment: Any
) -> None:
    """Refuse, in one line before training, what ``data.schedule.partial_rollouts`` cannot take (yet): no background
    process, another lag, an engine that cannot continue a sequence under new weights, a rollout kind
    (``environment``, None: single-turn) whose rollouts cannot span a push (an agent's: its
    ``partial_rollouts_refused`` says why), dynamic sampling, and a staleness bound that the longest sequence always
    exceeds. (A curriculum is refused at any lag: ``check_round_settings``.)"""
    if not schedule.partial_rollouts:
        return
    if schedule.rollout_lag != 1:
        raise ConfigError(
            f"data.schedule.partial_rollouts runs in the background process one segment per weight push: set "
            f"data.schedule.rollout_lag: 1 (got {schedule.rollout_lag}; max_staleness bounds how old a group may be)"
        )
    if not engine.supports_partial_rollouts:
        raise ConfigError(
            f"data.engine {engine.name} cannot continue a sequence under new weights with data.schedule."
            "partial_rollouts: use the lean, transformers, vllm or vllm_server engine, or partial_rollouts: false"
        )
    reason = None if environment is None else environment.partial_rollouts_refused
    if reason:
        raise ConfigError(
            f"data.environment {type(environment).__name__} does not combine with data.schedule.partial_rollouts: "
            f"{reason}"
        )
    if sampling.dynamic_sampling:
        raise ConfigError(
            "data.sampling.dynamic_sampling does not combine with data.schedule.partial_rollouts yet (groups arrive "
            "one by one, not as draws to refill): set one of them false"
        )
    # (their ranges, integers >= 1: SETTING_RANGES, checked when the config is read)
    budget = schedule.segment_tokens(sampling.max_new_tokens)
    pushes = pushes_per_sequence(sampling.max_new_tokens, budget)
    spanned = pushes if environment is None else environment.pushes_spanned(sampling.max_new_tokens, budget)
    if schedule.max_staleness < spanned:
        turns = "" if spanned == pushes else f" (+ {spanned - pushes}: its environment steps, collected a push later)"
        raise ConfigError(
            f"data.schedule.max_staleness {schedule.max_staleness} is below the {spanned} pushes a sequence of "
            f"data.sampling.max_new_tokens {sampling.max_new_tokens} spans at tokens_per_push {budget}{turns}: every "
            f"such sequence would be dropped; set max_staleness >= {spanned} or a larger tokens_per_push"
        )


def check_weights_can_leave(strategy: Any, engine: Any, rollout_lag: int) -> None:
    """Refuse, before training, a strategy whose weights cannot be sent to a copy outside the trainer.

    DeepSpeed ZeRO-3 partitions every parameter across the processes (each holds an empty placeholder); an
    engine with its own copy of the weights (vLLM, vLLM servers) or the background process of a rollout lag would
    be sent those placeholders. FSDP2 gathers one weight at a time for such a push; ZeRO-2 keeps full weights.
    """
    if not getattr(strategy, "zero_stage_3", False):
        return
    if not engine.shares_weights:
        who = f"data.engine {engine.name} holds its own copy of the weights"
    elif rollout_lag > 0:
        who = "data.schedule.rollout_lag > 0 sends the weights to a background process"
    else:
        return
    raise ConfigError(
        f"trainer.strategy: DeepSpeed ZeRO-3 partitions the weights, and {who}, which cannot take them; use "
        "configs/strategies/fsdp.yaml (FSDP2 gathers one weight at a time for the push) or DeepSpeed stage 2"
    )


def check_setting_ranges(config: Any) -> None:
    """``check_ranges`` for every section of a parsed config (one subcommand's: ``model``, ``data``, ``trainer``)."""
    for section in ("model", "data", "trainer"):
        values = config.get(section) if hasattr(config, "get") else getattr(config, section, None)
        if values is not None:
            check_ranges(section, values)


# --------------------------------------------------------------------------------------------------- data


def check_prompts(
    data: Dataset,
    where: str,
    *,
    token_lengths: Callable[[list[str]], list[int]] | None = None,
    context_length: int | None = None,
    max_new_tokens: int = 0,
    context_name: str = "the model's context",
) -> None:
    """Every prompt is a non-empty string, and the longest one plus the completion fits the context (the model's,
    or the engine's where it is shorter: vLLM's ``max_model_len``), ``context_name`` in the error.

    ``token_lengths(prompts)``: each prompt's token count as the model is given it (``PromptEncoder``).
    """
    prompts = data["prompt"]
    for row, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where} row {row}: the prompt is {prompt!r}; every row needs a non-empty prompt")
    if context_length is None or token_lengths is None:
        return
    lengths = token_lengths(list(prompts))
    row = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[row] + max_new_tokens > context_length:
        raise ConfigError(
            f"{where} row {row}: its prompt of {lengths[row]} tokens + data.sampling.max_new_tokens="
            f"{max_new_tokens} exceed {context_name} of {context_length} tokens; shorten the prompts or lower "
            "max_new_tokens" + ("" if context_name == "the model's context" else ", or raise it")
        )


# ---------------------------------------------------------------------------------------------- checkpoints
def _plain(value: Any) -> Any:
    """``value`` as plain data, whatever form it came in: settings objects (dataclasses), jsonargparse Namespaces
    (a checkpoint's saved hyperparameters, in ``class_path`` form or not) and dicts of them, also inside lists."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace, from the parsed config
        value = value.as_dict()
    if isinstance(value, dict) and "init_args" in value:  # class_path form
        value = value["init_args"]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "__subclasses_disabled__"}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def structural_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that decide the weights' shapes, normalised (defaults filled in) so that equal means same."""
    from grpo_lightning.lora import LoraConfig
    from grpo_lightning.models.tiny import TinyModelConfig

    name = hparams.get("model_name_or_path")
    # The tiny model's size matters only when it is the model.
    tiny = None if name is not None else _normalised(TinyModelConfig, hparams.get("tiny_model") or {})
    lora = hparams.get("lora")
    return {
        "model_name_or_path": name,
        "tiny_model": tiny,
        "lora": None if lora is None else _normalised(LoraConfig, lora),
    }


def _normalised(cls: type, value: Any) -> Any:
    """``value`` (instance, dict or parsed namespace) as the dict of a ``cls`` built from it, defaults filled in."""
    value = _plain(value)
    if not isinstance(value, dict):
        return value
    known = {f.name for f in fields(cls)}
    try:
        return asdict(cls(**{k: v for k, v in value.items() if k in known}))
    except Exception:  # a value the settings class refuses: compare as given (it differs, or fails elsewhere)
        return value


def check_checkpoint_hparams(saved: Mapping[str, Any], current: Mapping[str, Any], source: str) -> list[str]:
    """Refuse a checkpoint whose model differs from the configured one; return the other settings that differ.

    ``source`` names the checkpoint in the message.
    """
    if not saved:
        return []  # a checkpoint without hyperparameters: the weights' shapes are still checked on load
    old, new = structural_hparams(saved), structural_hparams(current)
    for key in STRUCTURAL_HPARAMS:
        if old[key] != new[key]:
            raise ConfigError(
                f"checkpoint {source} was made with model.{key}={old[key]!r}, the config has "
                f"model.{key}={new[key]!r}: it belongs to another model"
            )
    return sorted(
        f"model.{key}"
        for key in saved
        if key in current
        and key not in STRUCTURAL_HPARAMS
        and _settings(key, saved[key]) != _settings(key, current[key])
    )


def _settings(key: str, value: Any) -> Any:
    from grpo_lightning.config import ObjectiveConfig

    # Defaults filled in: a setting left out (or added to the class since the checkpoint) is not a change.
    if key == "objective" and value is not None:
        plain = _plain(value)
        if isinstance(plain, dict):
            known = {f.name for f in fields(ObjectiveConfig)}
            try:
                return ObjectiveConfig(**{k: v for k, v in plain.items() if k in known}).resolved()
            except Exception:  # a value the settings class refuses: compare as given (it differs, or fails elsewhere)
                return plain
    return _plain(value)


def check_state_dict_shapes(saved: Mapping[str, Any], expected: Mapping[str, Tensor], source: str) -> None:
    """Refuse a checkpoint whose weights do not fit the model (another model, or a resized vocabulary)."""
    for key, value in saved.items():
        if key in expected and hasattr(value, "shape") and tuple(value.shape) != tuple(expected[key].shape):
            raise ConfigError(
                f"checkpoint {source}: {key} has shape {list(value.shape)}, the model's is "
                f"{list(expected[key].shape)}: another model or vocabulary"
            )
    if any(k.startswith("policy.") for k in saved):
        missing = [k for k in expected if k.startswith("policy.") and k not in saved]
        if missing:
            raise ConfigError(f"checkpoint {source} has no {missing[0]}: it belongs to another model")


def check_checkpoint_fits(
    checkpoint: dict[str, Any],
    *,
    hparams: Mapping[str, Any],
    expected_state: Mapping[str, Tensor],
    has_reference: bool,
    source: str,
) -> None:
    """On load: refuse a checkpoint of another model (settings, then weight shapes); warn of changed settings.

    ``hparams``: the module's own settings; ``expected_state``: its ``state_dict()``; ``has_reference``: whether
    it has a reference model now (a saved one is dropped when β became 0); ``source`` names the checkpoint.
    """
    saved = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not k.startswith("_")}
    current = {k: v for k, v in hparams.items() if not k.startswith("_")}
    changed = check_checkpoint_hparams(saved, current, source)
    if changed:
        log.warning("checkpoint %s was made with other values of %s; the config's apply", source, ", ".join(changed))
    state = checkpoint.get("state_dict")
    if state is not None:
        if not has_reference:  # β is 0 now: no reference model to load a saved one into
            for key in [k for k in state if k.startswith("ref.")]:
                del state[key]
        check_state_dict_shapes(state, expected_state, source)


def read_checkpoint_hparams(path: str) -> Mapping[str, Any] | None:
    """The ``hyper_parameters`` of a local checkpoint file, read without loading its tensors (memory-mapped)."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:
        if "Weights only load failed" in str(err):
            return None  # objects beyond plain data: Lightning's own load decides (see its weights_only setting)
        # Not a checkpoint at all: say so in one line.
        raise ConfigError(f"ckpt_path: cannot read {path!r} as a checkpoint ({type(err).__name__})") from None
    return checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
