"""The settings reference: every key a config can set, generated from the config classes so that it cannot drift.

    python tools/settings_reference.py > /tmp/settings.md

The keys are read from the classes the CLI builds: ``GRPOModule.__init__``'s arguments (``model``),
``RolloutDataModule.__init__``'s (``data``), and on through every settings class their type hints name
(``model.objective`` is an ``ObjectiveConfig``, ``data.rewards`` a list of ``RewardSpec``, ...), as
``tests/cli/test_docs.py`` resolves keys; then the ``sft`` subcommand's ``SFTModule`` / ``SFTDataModule``. For each key:
its type and default (the signature, the dataclass field), its choices (a ``Literal`` hint, or the registry that
resolves the name), its range, and what it does: the attribute docstring of a dataclass field, the ``Args:`` entry of
an ``__init__`` docstring (Google style, read strictly: a line that is no ``name: text`` entry is an error).

Ranges are stated once: ``grpo_lightning.config_checks.SETTING_RANGES`` (the rule and its text side by side) for the
keys checked there, ``STATED_RANGES`` below for those a class checks itself; ``tests/cli/test_settings_reference.py``
probes every bound stated in either (a value just outside is refused with a ``ConfigError``, the bound itself is
not), and fails for a numeric key stated in neither. The policy losses' own settings come from their registry, with
the ranges each loss declares (``grpo_lightning.losses.ranges``).

The docs site renders this page at build time (``docs/hooks/settings_reference.py``); ``docs/reference/settings.md``
in the tree is a stub that says so.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, or imported by the docs hook: the checkout's package
    sys.path.insert(0, str(ROOT))

REQUIRED = object()
"""The default of a setting that has none: the config must give it."""
NOT_STATED = ""
"""A numeric key that takes any value: stated so in ``STATED_RANGES`` (a key left out there is a defect)."""

# The ranges of the numeric settings a class checks itself (``__post_init__``, ``__init__``); the keys in
# ``config_checks.SETTING_RANGES`` take their text from there. Forms the test probes: ``>= a``, ``> a``,
# ``an integer >= a``, ``in [a, b)`` (any brackets; a bound that names another setting is not probed), each
# optionally followed by ``, or null ...`` (null accepted) and a remark. ``sft.`` keys are the ``sft`` subcommand's.
STATED_RANGES: dict[str, str] = {
    "model.logprob_chunk_size": ">= 1, or null for the whole micro-batch at once",
    "model.max_nonfinite_skips": ">= 1",
    "model.tiny_model.hidden_size": "a multiple of num_heads, with an even quotient (each head's size)",
    "model.tiny_model.num_layers": ">= 1",
    "model.tiny_model.num_heads": ">= 1",
    "model.tiny_model.intermediate_size": ">= 1",
    "model.tiny_model.max_position_embeddings": ">= 1",
    "model.objective.beta": ">= 0",
    "model.objective.epsilon_low": "[per loss_type](#losses)",
    "model.objective.epsilon_high": "[per loss_type](#losses)",
    "model.objective.delta": "[per loss_type](#losses)",
    "model.objective.clip_ratio_c": "[per loss_type](#losses)",
    "model.objective.off_policy_mask": ">= 0, or null for off",
    "model.objective.entropy_coef": "within [entropy_coef_min, entropy_coef_max] with use_adaptive_entropy",
    "model.objective.top_entropy_quantile": "in (0, 1]",
    "model.objective.entropy_coef_min": ">= 0, and <= entropy_coef_max",
    "model.objective.entropy_coef_max": ">= entropy_coef_min",
    "model.objective.entropy_coef_delta": "> 0",
    "model.objective.entropy_target": ">= 0",
    "model.objective.tis_cap": "> 0, or null for no correction; > 1 with tis_mode: mask",
    "model.lora.r": ">= 1",
    "model.lora.alpha": "> 0",
    "model.lora.dropout": "in [0, 1)",
    "model.teacher.timeout_s": "> 0",
    "model.teacher.retries": ">= 0",
    "model.teacher.weight": "> 0",
    "model.teacher.weight_rounds": "an integer >= 1 with a linear, cosine or step weight_schedule; unset with constant",
    "model.teacher.temperature": "> 0, or null for the sampling temperature",
    "data.val_fraction": "in (0, 1), or null",
    "data.seed": NOT_STATED,
    "data.rewards.weight": NOT_STATED,
    "data.sampling.group_size": ">= 1; 2 or more with rewards (a group's advantages compare its completions)",
    "data.sampling.max_new_tokens": ">= 1",
    "data.sampling.min_new_tokens": "in [0, max_new_tokens]",
    "data.sampling.temperature": "> 0",
    "data.sampling.top_p": "in (0, 1]",
    "data.sampling.top_k": ">= 0 (0: off)",
    "data.sampling.generation_batch_size": ">= 1",
    "data.advantage.eps": "> 0",
    "data.advantage.k": "in [2, data.sampling.group_size], or null for the group size",
    "data.update.pack_tokens": ">= 1, or null for padded rows",
    "data.curriculum.min_pass_rate": "in [0, max_pass_rate]",
    "data.curriculum.max_pass_rate": "in [min_pass_rate, 1]",
    "data.curriculum.preferred_weight": "> 0",
    "data.curriculum.other_weight": "> 0",
    "data.curriculum.unseen_weight": "> 0",
    "data.curriculum.history": "in [0, 1)",
    "data.curriculum.success_threshold": NOT_STATED,
    "data.eval.num_samples": ">= 0 (0: greedy pass@1 only)",
    "data.eval.temperature": "> 0",
    "sft.model.min_lr_ratio": "in [0, 1]",
    "sft.data.batch_size": ">= 1",
    "sft.data.max_length": NOT_STATED,
    "sft.data.limit": NOT_STATED,
    "sft.data.val_fraction": "in (0, 1), or null",
    "sft.data.seed": NOT_STATED,
}


# ------------------------------------------------------------------------------------------------- the model
@dataclass
class Setting:
    """One key: where it is, what it takes, what it does."""

    key: str
    """Dotted, as a config spells it (``data.sampling.group_size``; a list's items: ``data.rewards[].name``)."""
    hint: Any
    default: Any
    description: str
    group: str | None = None
    """The key of the settings group it holds (a nested section), if any."""

    @property
    def anchor(self) -> str:
        """The page's anchor of the key (``data.rewards[].name`` -> ``data.rewards.name``)."""
        return self.key.replace("[]", "")


@dataclass
class Group:
    """A YAML section: a class's settings (``model``: ``GRPOModule``; ``data.sampling``: ``SamplingConfig``)."""

    key: str
    cls: type
    summary: str
    settings: list[Setting] = field(default_factory=list)
    same_as: str | None = None
    """Documented already under this key (the ``sft`` subcommand's groups that GRPO's share)."""


# ------------------------------------------------------------------------------------------- reading classes
def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings under a class's annotated attributes (``x: int = 1`` then ``\"\"\"...\"\"\"``), bases first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for statement, after in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(after.value.value)
    return docs


def args_section(docstring: str | None, where: str) -> dict[str, str]:
    """The ``Args:`` entries of a Google-style docstring, by name. A line at an entry's indentation that is no
    ``name: text`` entry raises ``ValueError`` naming ``where`` (an entry's description would be cut there)."""
    lines = inspect.cleandoc(docstring or "").splitlines()
    if "Args:" not in [line.strip() for line in lines]:
        return {}
    start = [line.strip() for line in lines].index("Args:") + 1
    entries: dict[str, list[str]] = {}
    base, name = None, None
    for line in lines[start:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        base = indent if base is None else base
        if indent < base:
            break  # the next section
        if indent > base and name is not None:
            entries[name].append(line.strip())
            continue
        match = re.fullmatch(r"\s*\**(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        if not match:
            raise ValueError(f"{where}: the Args: line {line.strip()!r} is no 'name: description' entry")
        name = match.group(1)
        entries[name] = [match.group(2)]
    return {key: " ".join(words).strip() for key, words in entries.items()}


def _default(value: Any) -> Any:
    return REQUIRED if value is inspect.Parameter.empty else value


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def class_settings(cls: type) -> list[tuple[str, Any, Any, str]]:
    """``(name, type hint, default, description)`` of each setting of ``cls``: a dataclass's fields, or its
    ``__init__``'s parameters (``self`` and ``*args``/``**kwargs`` left out). A missing description is ``""``."""
    if dataclasses.is_dataclass(cls):
        hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
        found = []
        for item in dataclasses.fields(cls):
            if not item.init:
                continue
            if item.default_factory is not dataclasses.MISSING:
                default = item.default_factory()
            else:
                default = REQUIRED if item.default is dataclasses.MISSING else item.default
            found.append((item.name, hints.get(item.name, Any), default, docs.get(item.name, "")))
        return found
    hints = typing.get_type_hints(cls.__init__)
    docs = args_section(cls.__init__.__doc__, f"{cls.__qualname__}.__init__")
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = [p for p in inspect.signature(cls.__init__).parameters.values() if p.kind in named][1:]
    return [(p.name, hints.get(p.name, Any), _default(p.default), docs.get(p.name, "")) for p in parameters]


def group_class(hint: Any) -> tuple[type | None, bool]:
    """The settings class a key of type ``hint`` opens (``ObjectiveConfig | None``; ``list[RewardSpec]``), and
    whether the key holds a list of them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, False
    if origin is list and args:
        inner, _ = group_class(args[0])
        return inner, inner is not None
    if _is_union(hint):
        for arg in args:
            inner, many = group_class(arg)
            if inner is not None:
                return inner, many
    return None, False


def collect(key: str, cls: type, documented: dict[type, str] | None = None) -> list[Group]:
    """The group of ``cls`` at ``key`` and every group under it, in the order a reader meets them. A class already
    in ``documented`` (class -> its key) is referred to there instead of listed again."""
    documented = {} if documented is None else documented
    group = Group(key, cls, inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0])
    groups = [group]
    if cls in documented:
        group.same_as = documented[cls]
        return groups
    documented[cls] = key
    for name, hint, default, description in class_settings(cls):
        inner, many = group_class(hint)
        setting = Setting(f"{key}.{name}", hint, default, description)
        group.settings.append(setting)
        if inner is not None:
            setting.group = f"{key}.{name}" + ("[]" if many else "")
            groups += collect(setting.group, inner, documented)
    return groups


def sections() -> dict[str, list[Group]]:
    """The reference's sections: GRPO's ``model`` and ``data``, and the ``sft`` subcommand's."""
    from grpo_lightning.integrations.sft import SFTDataModule, SFTModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.rollout.datamodule import RolloutDataModule

    documented: dict[type, str] = {}
    grpo = collect("model", GRPOModule, documented=documented) + collect(
        "data", RolloutDataModule, documented=documented
    )
    sft = collect("sft.model", SFTModule, documented=documented) + collect(
        "sft.data", SFTDataModule, documented=documented
    )
    return {"grpo": grpo, "sft": sft}


def all_settings(groups: list[Group]) -> list[Setting]:
    """Every key of ``groups``, in order."""
    return [setting for group in groups for setting in group.settings]


def missing_descriptions(groups: list[Group]) -> list[str]:
    """The keys that say nothing about what they do (a defect: write the field's docstring or ``Args:`` entry)."""
    return [setting.key for setting in all_settings(groups) if not setting.description.strip()]


def unstated_ranges(groups: list[Group]) -> list[str]:
    """The numeric keys whose range is stated nowhere (``SETTING_RANGES``, ``STATED_RANGES``)."""
    return [s.key for s in all_settings(groups) if is_numeric(s.hint) and stated_range(s.key) is None]


# ------------------------------------------------------------------------------------------- types and values
def type_text(hint: Any) -> str:
    """A type hint as a config reader sees it: ``int | null``, ``list[int]``, ``mapping``, a class's name."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    if origin is typing.Literal:
        return "str" if all(isinstance(a, str) for a in args) else " | ".join(repr(a) for a in args)
    if _is_union(hint):
        parts = [type_text(a) for a in args if a is not type(None)]
        parts = list(dict.fromkeys(parts)) + (["null"] if type(None) in args else [])
        return " | ".join(parts)
    if origin in (dict, typing.Mapping) or hint is dict:
        return "mapping"
    if origin is list:
        return f"list[{type_text(args[0])}]" if args else "list"
    return getattr(hint, "__name__", str(hint))


def literal_choices(hint: Any) -> list[Any]:
    """The values of the ``Literal`` parts of ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return list(args)
    if origin is not None:
        return [value for arg in args for value in literal_choices(arg)]
    return []


def is_numeric(hint: Any) -> bool:
    """Whether ``hint`` takes a number (``int``, ``float``, ``int | None``, ``int | Literal["auto"]``; not ``bool``)."""
    if hint in (int, float):
        return True
    return _is_union(hint) and any(is_numeric(a) for a in typing.get_args(hint))


def yaml_value(value: Any) -> str:
    """``value`` as YAML writes it (``null``, ``true``, ``[1, 2]``)."""
    if value is REQUIRED:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return str(value)


def stated_range(key: str) -> str | None:
    """The range stated for ``key`` (``SETTING_RANGES``' text, else ``STATED_RANGES``'); None when stated nowhere.
    An ``sft.`` key takes GRPO's ``SETTING_RANGES`` text (the CLI checks every subcommand's config against it)."""
    from grpo_lightning.config_checks import SETTING_RANGES

    plain = key.replace("[]", "")
    checked = plain.removeprefix("sft.")
    if checked in SETTING_RANGES:
        return SETTING_RANGES[checked][1]
    return STATED_RANGES.get(plain)


def registry_choices(key: str) -> str:
    """The names a registry resolves for ``key`` (a plain ``str`` setting whose values are registered names)."""
    from grpo_lightning.advantage_registry import available_advantage_estimators, available_reward_aggregations
    from grpo_lightning.engines import engine_names
    from grpo_lightning.losses import available_policy_losses
    from grpo_lightning.rewards import available

    plain = key.replace("[]", "").removeprefix("sft.")
    registries = {
        "model.objective.loss_type": (available_policy_losses, "or `package.module:function`"),
        "data.advantage.estimator": (available_advantage_estimators, "or `package.module:function`"),
        "data.advantage.multi_objective_aggregation": (available_reward_aggregations, ""),
        "data.engine": (engine_names, "or `{class_path, init_args}` of a `RolloutEngine`"),
        "data.rewards.name": (available, "or an import path `package.module.function`"),
        "data.accuracy_reward": (lambda: [], "the `name` of one of `data.rewards`"),
    }
    if plain not in registries:
        return ""
    names, rest = registries[plain]
    listed = ", ".join(f"`{n}`" for n in names())
    return ", ".join(part for part in (listed, rest) if part)


def values_text(setting: Setting) -> str:
    """What the key takes beyond its type: a ``Literal``'s choices, a registry's names, the stated range."""
    parts = []
    choices = literal_choices(setting.hint)
    if choices:
        listed = ", ".join(f"`{yaml_value(c)}`" for c in choices)
        only = typing.get_origin(setting.hint) is typing.Literal or all(
            typing.get_origin(a) is typing.Literal or a is type(None) for a in typing.get_args(setting.hint)
        )
        parts.append(f"one of {listed}" if only else listed)
    if names := registry_choices(setting.key):
        parts.append(names)
    stated = stated_range(setting.key)
    if stated:
        parts.append(stated.replace(">=", "≥").replace("<=", "≤"))
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------- writing markdown
def _cell(text: str) -> str:
    """``text`` in one table cell: one line, RST's double backticks as markdown's single ones, ``|`` escaped outside
    code spans (Python-Markdown's tables keep a code span's ``|`` as it is, and would show ``\\|`` there)."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def _group_table(group: Group) -> list[str]:
    rows = ["| Key | Type | Default | Values | What it does |", "|---|---|---|---|---|"]
    for setting in group.settings:
        kind = f"`{type_text(setting.hint)}`"
        if setting.group is None:
            key = f'<a id="{setting.anchor}"></a>[`{setting.key}`](#{setting.anchor})'
        else:  # the anchor is its group's heading
            target = setting.group.replace("[]", "")
            key, kind = f"[`{setting.key}`](#{target})", f"[{kind}](#{target})"
        default = "required" if setting.default is REQUIRED else f"`{yaml_value(setting.default)}`"
        cells = [key, kind, default, values_text(setting), setting.description]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return rows


def render_groups(groups: list[Group], level: int = 2) -> list[str]:
    """Each group as a heading (its key, its class) with the key's anchor, its summary and a table of its keys;
    the first group (a section: ``model``) at ``level``, the groups under it one below."""
    lines: list[str] = []
    for index, group in enumerate(groups):
        anchor = group.key.replace("[]", "")
        shown = group.key.removeprefix("sft.")
        heading = "#" * (level if index == 0 else level + 1)
        lines += ["", f'<a id="{anchor}"></a>', "", f"{heading} `{shown}`: {group.cls.__name__}", ""]
        if group.same_as is not None:
            target = group.same_as.replace("[]", "")
            lines.append(f"The same keys as [`{group.same_as}`](#{target}) ({group.cls.__name__}).")
            continue
        if group.summary:
            lines += [_cell(group.summary), ""]
        lines += _group_table(group)
    return lines


def loss_lines() -> list[str]:
    """The policy losses of the registry: each one's aggregation and settings, with their defaults and ranges."""
    from grpo_lightning.losses import GENERIC_SETTINGS, available_policy_losses, get_policy_loss

    lines = [
        "",
        '<a id="losses"></a>',
        "",
        "## Policy losses",
        "",
        "`model.objective.loss_type` picks one; its settings are the function's keyword parameters (the registry, "
        "`grpo_lightning.losses.registry`): the generic ones are set under `model.objective` (null there: the "
        "loss's default), the others under `model.objective.loss_kwargs`. A setting the loss does not read is "
        "refused, and so is a value outside the range the loss declares (`grpo_lightning.losses.ranges`).",
        "",
        "| `loss_type` | Aggregation | Setting | Default | Range |",
        "|---|---|---|---|---|",
    ]
    for name in available_policy_losses():
        loss = get_policy_loss(name)
        aggregation = f"`{loss.aggregation}`" + (" (fixed)" if len(loss.aggregations) == 1 else " (default)")
        first = True
        for setting, parameter in loss.parameters.items():
            where = "model.objective" if setting in GENERIC_SETTINGS else "model.objective.loss_kwargs"
            allowed = loss.ranges.get(setting)
            cells = [
                f'<a id="loss.{name}"></a>`{name}`' if first else "",
                aggregation if first else "",
                f"`{where}.{setting}`",
                f"`{yaml_value(_default(parameter.default))}`",
                str(allowed) if allowed is not None else "",
            ]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
            first = False
        if first:
            lines.append(f'| <a id="loss.{name}"></a>`{name}` | {aggregation} | (none) | | |')
    return lines


def renamed_lines() -> list[str]:
    from grpo_lightning.renamed_keys import REMOVED_IN, RENAMED

    lines = [
        "",
        '<a id="renamed"></a>',
        "",
        "## Moved keys",
        "",
        f"Deprecated: each is still read, with a one-line warning naming its new place, until grpo_lightning "
        f"{REMOVED_IN}. A key under an old one moves with it (`model.sampling.group_size` is "
        "`data.sampling.group_size`).",
        "",
        "| Old key | Now |",
        "|---|---|",
    ]
    for old, new in RENAMED.items():
        lines.append(f"| `{old}` | [`{new}`](#{new}) |")
    return lines


def reference() -> str:
    """The whole page, markdown."""
    found = sections()
    grpo, sft = found["grpo"], found["sft"]
    model = [g for g in grpo if g.key.startswith("model")]
    data = [g for g in grpo if g.key.startswith("data")]
    lines = [
        "# Settings reference",
        "",
        "Every key of a config's `model` and `data` sections, generated from the config classes when the site is "
        "built (`python tools/settings_reference.py` prints this page), so it cannot drift from the code. `trainer` "
        "is Lightning's `Trainer` (its own reference); `seed_everything` and `ckpt_path` sit beside the sections. "
        "A key can be set in a YAML file (`--config`) or on the command line (`--data.sampling.group_size 16`). "
        "Link to a key as `settings.md#data.sampling.group_size`.",
        "",
        *render_groups(model),
        "",
        *render_groups(data),
        *loss_lines(),
        *renamed_lines(),
        "",
        "## The `sft` subcommand",
        "",
        "`python -m grpo_lightning sft` takes `SFTModule` and `SFTDataModule`; their keys are written `model.x` and "
        "`data.x` in its configs (the `sft.` of their anchors keeps them apart from GRPO's).",
        *render_groups([g for g in sft if g.key.startswith("sft.model")], level=3),
        *render_groups([g for g in sft if g.key.startswith("sft.data")], level=3),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
