"""Config keys that moved: still read, for one release, with a one-line warning naming the new key.

Config keys are public API: a YAML written for an earlier layout keeps working. The rollout side of the algorithm
(sampling, rewards, advantages, μ, evaluation) moved from ``model`` to ``data`` when the rollout became the
DataModule's; ``data``'s own settings then moved into the groups the YAML already had (``data.update``,
``data.schedule``, ``data.sampling``, ``data.eval``), a key that moved twice straight to its last place.
``migrate`` moves the old keys of a loaded YAML document (a ``--config`` file, or a whole config given inline) to
their places; ``migrate_command_line`` does the same for ``--model.sampling.group_size 4``-style flags. The CLI's
parsers read every document through ``migrate`` (the ``grpo_yaml`` parser mode below). An old key and its new one
set differently in one document, or both as flags, are refused in the same line (``both_set``); a flag still
overrides a file, whichever key either uses.
"""

from __future__ import annotations

import logging
from typing import Any

import jsonargparse
import yaml
from lightning.pytorch.utilities import rank_zero_only

from grpo_lightning.config import ConfigError

log = logging.getLogger(__name__)

REMOVED_IN = "0.2.0"  # the release that stops reading them

# old key -> its place now
RENAMED: dict[str, str] = {
    "model.sampling": "data.sampling",
    "model.rewards": "data.rewards",
    "model.accuracy_reward": "data.accuracy_reward",
    "model.reward_on_error": "data.reward_on_error",
    "model.reward_timeout_s": "data.reward_timeout_s",
    "model.use_chat_template": "data.use_chat_template",
    "model.seed": "data.seed",  # the sampling generator's seed; data.seed seeds it (and the prompt order) now
    "model.eval_num_samples": "data.eval.num_samples",
    "model.eval_temperature": "data.eval.temperature",
    "model.eval_pass_k": "data.eval.pass_k",
    "model.eval_answer_fn": "data.eval.answer_fn",
    "model.objective.num_iterations": "data.update.num_iterations",
    "model.objective.old_logprobs": "data.update.old_logprobs",
    "model.objective.mask_truncated_completions": "data.update.mask_truncated_completions",
    "model.objective.advantage_baseline": "data.advantage.baseline",
    "model.objective.advantage_scale": "data.advantage.scale",
    "model.objective.advantage_std": "data.advantage.std",
    "model.objective.advantage_eps": "data.advantage.eps",
    # ``data``'s settings grouped as the YAML groups them (issue 51): the update half of a round, the lag's settings,
    # how a round samples, held-out evaluation.
    "data.num_iterations": "data.update.num_iterations",
    "data.mini_batch_size": "data.update.mini_batch_size",
    "data.micro_batch_size": "data.update.micro_batch_size",
    "data.balance_micro_batches": "data.update.balance_micro_batches",
    "data.pack_tokens": "data.update.pack_tokens",
    "data.old_logprobs": "data.update.old_logprobs",
    "data.mask_truncated_completions": "data.update.mask_truncated_completions",
    "data.rollout_lag": "data.schedule.rollout_lag",
    "data.off_policy_correction": "data.schedule.off_policy_correction",
    "data.rollout_threads": "data.schedule.rollout_threads",
    "data.rollout_timeout_s": "data.schedule.rollout_timeout_s",
    "data.dynamic_sampling": "data.sampling.dynamic_sampling",
    "data.max_sampling_rounds": "data.sampling.max_sampling_rounds",
    "data.val_batch_size": "data.eval.batch_size",
    "data.val_limit": "data.eval.limit",
}

SUBCOMMANDS = ("fit", "validate", "test", "predict")
# The top-level keys of a whole config: a document with any other key is a setting's value (say, an engine's
# init_args given inline) and is never rewritten, even when it happens to hold a ``model`` mapping.
CONFIG_KEYS = {"model", "data", "trainer", "seed_everything", "ckpt_path", "optimizer", "lr_scheduler", *SUBCOMMANDS}
PARSER_MODE = "grpo_yaml"
_warned: set[str] = set()  # each key once per process (the CLI may parse the same command line twice)


def warn_renamed(old: str, new: str) -> None:
    """One line, once per process, on rank 0."""
    if old in _warned:
        return
    _warned.add(old)
    if rank_zero_only.rank == 0:
        log.warning(
            "deprecated: %s is now %s; the old key is read until grpo_lightning %s, rename it", old, new, REMOVED_IN
        )


def migrate(document: Any) -> Any:
    """``document`` (a loaded YAML config, or a subcommand's part of one) with every key of ``RENAMED`` moved to its
    new place; anything else is returned unchanged. Both the old key and its new one set to different values is
    refused in one line."""
    if not isinstance(document, dict) or not set(document) <= CONFIG_KEYS:
        return document
    for name in SUBCOMMANDS:  # a config for the whole command line: `--config all.yaml fit`
        if isinstance(document.get(name), dict):
            migrate(document[name])
    if not isinstance(document.get("model"), dict) and not isinstance(document.get("data"), dict):
        return document
    for old, new in RENAMED.items():
        found, value = _pop(document, old.split("."))
        if not found:
            continue
        parent = _settings(document, new.split(".")[:-1], create=True)
        leaf = new.rsplit(".", 1)[1]
        if parent is None:  # e.g. `data: data.yaml`: the old key cannot be merged into a file name here
            raise ConfigError(f"{old} is deprecated and cannot be moved to {new} here: set {new} instead")
        if leaf in parent and parent[leaf] != value:
            raise both_set(old, new, new)
        parent[leaf] = value
        warn_renamed(old, new)
    return document


def respell(key: str) -> tuple[str, str] | None:
    """``(old, key as spelled now)`` when the dotted ``key`` is an old key of ``RENAMED`` or lies under one
    (``model.sampling.group_size`` -> ``data.sampling.group_size``); None otherwise."""
    for old, new in RENAMED.items():
        if key == old or key.startswith(old + "."):
            return old, new + key[len(old) :]
    return None


def both_set(old: str, now: str, new: str) -> ConfigError:
    """The one-line refusal of an old key (``now`` as spelled today) and the new key ``new`` set differently, in a
    file or as flags alike."""
    return ConfigError(f"{old} (deprecated, now {now}) and {new} are both set, differently: keep only {new}")


def migrate_command_line(argv: list[str]) -> list[str]:
    """``argv`` with every ``--old.key[.sub][=value]`` flag of ``RENAMED`` spelled with its new key.

    An old flag and a new one that set the same setting to different values are refused as in a file (``migrate``),
    whichever comes first: read as today's flag, the later would win without a word. A flag's value is compared as
    YAML, also inside a mapping given to the enclosing key (``--model.sampling '{group_size: 4}'``).
    """
    out, olds, news = [], [], []
    for at, token in enumerate(argv):
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            given = value if eq else _next_value(argv, at)
            if found := respell(name):
                olds.append((name, found, given))
                token = f"--{found[1]}{eq}{value}"
            else:
                news.append((name, given))
        out.append(token)
    for old, (_, now), old_value in olds:
        for new, new_value in news:
            if _differ(now, old_value, new, new_value):
                raise both_set(old, now, new)
    for _, (moved, _), _ in olds:
        warn_renamed(moved, RENAMED[moved])
    return out


def _next_value(argv: list[str], at: int) -> str | None:
    return argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("--") else None


def _differ(old_key: str, old_value: str | None, new_key: str, new_value: str | None) -> bool:
    """Whether flags for ``old_key`` (spelled as now) and ``new_key`` set a setting they share differently: one
    flag's key is the other's, or a setting inside the mapping the other gives."""
    if old_value is None or new_value is None:
        return False
    pairs = ((old_key, old_value, new_key, new_value), (new_key, new_value, old_key, old_value))
    for outer, outer_value, inner, inner_value in pairs:
        if inner == outer or inner.startswith(outer + "."):
            found, at = _inside(_yaml_value(outer_value), inner[len(outer) :])
            return found and at != _yaml_value(inner_value)
    return False


def _inside(value: Any, suffix: str) -> tuple[bool, Any]:
    """The setting at the dotted ``suffix`` (``.group_size``, or empty: ``value`` itself) of a flag's value."""
    for key in suffix.split(".")[1:]:
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _settings(document: dict, path: list[str], *, create: bool = False) -> dict | None:
    """The mapping of settings at ``path`` (inside its ``init_args`` when given as ``{class_path, init_args}``),
    created when missing with ``create``; None when it is missing or not a mapping."""
    node: Any = document
    for key in path:
        child = node.get(key)
        if child is None and create:
            child = node[key] = {}
        if not isinstance(child, dict):
            return None
        if "class_path" in child:
            if not isinstance(child.get("init_args"), dict):
                if not create:
                    return None
                child["init_args"] = {}
            child = child["init_args"]
        node = child
    return node


def _pop(document: dict, path: list[str]) -> tuple[bool, Any]:
    parent = _settings(document, path[:-1])
    if parent is None or path[-1] not in parent:
        return False, None
    return True, parent.pop(path[-1])


_yaml_load = jsonargparse.get_loader("yaml")


def _load(text: str) -> Any:
    return migrate(_yaml_load(text))


# jsonargparse's own YAML loading, then the old keys moved: the parser mode of the CLI's parsers (``cli.GRPOCLI``).
# Dumping (the run's config.yaml) falls back to jsonargparse's YAML, in the new layout.
jsonargparse.set_loader(PARSER_MODE, _load, exceptions=(yaml.YAMLError,))
