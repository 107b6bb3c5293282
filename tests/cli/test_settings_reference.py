"""The settings reference (``tools/settings_reference.py``, rendered into the site's ``reference/settings.md``):
every key of every group is on the page with a description; a key added to a settings class appears without a page
being edited; each range the page states holds (a value just outside it is refused with a ``ConfigError``, the bound
itself is not); the stub in the tree names its generator.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from helpers import ROOT, load_tool

from grpo_lightning.config import ConfigError

reference = load_tool("settings_reference")

# What a group needs besides the probed key to be built at all (a teacher needs a model; pass@k's k needs passk).
PROBE_CONTEXT: dict[str, dict[str, Any]] = {
    "model.teacher": {"model_name_or_path": "teacher"},
    "model.teacher.weight_rounds": {"weight_schedule": "linear"},
    "data.advantage.k": {"estimator": "passk"},
    "sft.data": {"dataset": "arithmetic"},
}
FLOAT_STEP = 1e-6  # "just outside" a float bound


@pytest.fixture(scope="module")
def sections() -> dict[str, list]:
    return reference.sections()


@pytest.fixture(scope="module")
def page() -> str:
    return reference.reference()


def _all_groups(sections: dict[str, list]) -> list:
    return [group for groups in sections.values() for group in groups]


def test_every_key_is_on_the_page_with_a_description(sections, page):
    groups = _all_groups(sections)
    missing = reference.missing_descriptions(groups)
    assert not missing, (
        "settings without a description (write the dataclass field's docstring, or the __init__'s Args: entry): "
        + ", ".join(missing)
    )
    keys = reference.all_settings(groups)
    assert len(keys) > 150  # GRPO's model and data, their groups, SFT's: a generator that finds nothing fails
    for setting in keys:
        assert f"[`{setting.key}`](#{setting.anchor})" in page or f"[`{setting.key}`](#" in page, setting.key
        anchor = setting.group.replace("[]", "") if setting.group else setting.anchor
        assert f'<a id="{anchor}"></a>' in page, f"no anchor for {setting.key}"
    for group in groups:  # each group's table, or its pointer to the identical one
        assert f'<a id="{group.key.replace("[]", "")}"></a>' in page


def test_every_anchor_is_unique_and_every_link_lands(page):
    anchors = re.findall(r'<a id="([^"]+)"></a>', page)
    assert len(anchors) == len(set(anchors)), [a for a in anchors if anchors.count(a) > 1]
    targets = set(re.findall(r"\]\(#([^)]+)\)", page))
    assert targets <= set(anchors), sorted(targets - set(anchors))


def test_moved_keys_and_loss_settings_are_listed(page):
    from grpo_lightning.losses import available_policy_losses
    from grpo_lightning.renamed_keys import RENAMED

    for old, new in RENAMED.items():
        assert f"| `{old}` | [`{new}`](#{new}) |" in page
    for name in available_policy_losses():
        assert f'<a id="loss.{name}"></a>`{name}`' in page
    assert "`model.objective.loss_kwargs.tau_pos` | `1.0` | (0, inf)" in page  # sapo's own, with its range


# ------------------------------------------------------------------------------------ a key added to a class
@dataclass
class _Depth:
    """A made-up settings group."""

    depth: int = 2
    """How deep the made-up thing goes."""
    mode: Literal["wide", "narrow"] = "wide"
    """Its made-up mode."""
    undocumented: float = 0.5


@dataclass
class _Step:
    """A made-up item of a list."""

    size: int = 1
    """How large the made-up step is."""


class _Owner:
    """A made-up section."""

    def __init__(self, inner: _Depth | None = None, width: float = 1.0, steps: list[_Step] | None = None) -> None:
        """
        Args:
            inner: the made-up group.
            width: how wide,
                over two lines.
            steps: a list of made-up groups.
        """


def test_a_key_added_to_a_class_appears_without_editing_a_page():
    groups = reference.collect("demo", _Owner)
    assert [g.key for g in groups] == ["demo", "demo.inner", "demo.steps[]"]
    text = "\n".join(reference.render_groups(groups))
    assert "[`demo.inner.depth`](#demo.inner.depth) | `int` | `2` |  | How deep the made-up thing goes. |" in text
    assert "| one of `wide`, `narrow` | Its made-up mode. |" in text
    assert "how wide, over two lines." in text
    assert '<a id="demo.steps"></a>' in text and "[`demo.steps[].size`](#demo.steps.size)" in text
    # A key without a description is named, so the test above fails for it.
    assert reference.missing_descriptions(groups) == ["demo.inner.undocumented"]
    # A numeric key without a stated range is named too.
    expected = ["demo.width", "demo.inner.depth", "demo.inner.undocumented", "demo.steps[].size"]
    assert reference.unstated_ranges(groups) == expected


def test_an_args_entry_the_parser_cannot_read_is_refused():
    broken = """
        Args:
            teacher: a frozen model whose log-prob of
            each token the
                student samples.
        """
    with pytest.raises(ValueError, match="'each token the' is no 'name: description' entry"):
        reference.args_section(broken, "Owner.__init__")


# ---------------------------------------------------------------------------------------------------- ranges
def stated_bounds(text: str) -> tuple[list[tuple[str, float]], bool]:
    """The numeric bounds a stated range opens with (``>= 1``, ``an integer >= 0``, ``in (0, 1]``; a bound that
    names another setting is skipped) and whether it says ``, or null``."""
    bounds: list[tuple[str, float]] = []
    if match := re.match(r"(?:an integer )?(>=|>)\s*(-?[\d.]+)\b", text):
        bounds.append((match.group(1), float(match.group(2))))
    elif match := re.match(r"in ([\[(])\s*([^,\s]+),\s*([^\])\s]+)\s*([\])])", text):
        opening, low, high, closing = match.groups()
        for number, op in ((low, ">=" if opening == "[" else ">"), (high, "<=" if closing == "]" else "<")):
            if re.fullmatch(r"-?[\d.]+", number):
                bounds.append((op, float(number)))
    return bounds, ", or null" in text


def _owners() -> dict[str, type]:
    from grpo_lightning.integrations.sft import SFTDataModule, SFTModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.rollout.datamodule import RolloutDataModule

    return {"model": GRPOModule, "data": RolloutDataModule, "sft.model": SFTModule, "sft.data": SFTDataModule}


def verdict(groups: dict[str, type], key: str, value: Any) -> str:
    """``taken`` or ``refused`` (a ``ConfigError``), or how it failed otherwise, for ``key: value`` where it is
    checked: ``check_ranges`` for a ``SETTING_RANGES`` key (what the CLI and the classes call), else the class that
    holds it (a section's module, a settings group), built with that value alone (and ``PROBE_CONTEXT``)."""
    from grpo_lightning.config_checks import SETTING_RANGES, check_ranges

    plain = key.replace("[]", "")
    checked = plain.removeprefix("sft.")
    parent, _, name = key.rpartition(".")
    try:
        if checked in SETTING_RANGES:
            section, *path = checked.split(".")
            nested: Any = value
            for part in reversed(path):
                nested = {part: nested}
            check_ranges(section, nested)
        elif parent in _owners():
            _owners()[parent](**PROBE_CONTEXT.get(parent, {}), **{name: value})
        else:
            groups[parent](**PROBE_CONTEXT.get(parent, {}), **PROBE_CONTEXT.get(plain, {}), **{name: value})
    except ConfigError:
        return "refused"
    except Exception as err:  # refused, but with a traceback: the page's range is not what the code checks
        return f"{type(err).__name__}: {err}"
    return "taken"


def probes(text: str, integer: bool) -> list[tuple[Any, str]]:
    """``(value, expected verdict)`` at each bound ``text`` states: the bound (or the nearest value inside an open
    one) taken, the nearest value outside refused; null taken where it says so."""
    step = 1 if integer else FLOAT_STEP
    bounds, null = stated_bounds(text)
    found: list[tuple[Any, str]] = [(None, "taken")] if null else []
    for op, bound in bounds:
        inside = {">=": bound, "<=": bound, ">": bound + step, "<": bound - step}[op]
        outside = {">=": bound - step, "<=": bound + step, ">": bound, "<": bound}[op]
        found += [(inside, "taken"), (outside, "refused")]
    return [(int(v) if integer and v is not None else v, expected) for v, expected in found]


def test_every_stated_range_holds_at_its_bounds(sections):
    groups = {group.key: group.cls for group in _all_groups(sections)}
    wrong, probed = [], 0
    for setting in reference.all_settings(_all_groups(sections)):
        text = reference.stated_range(setting.key)
        integer = reference.type_text(setting.hint).startswith("int")
        for value, expected in probes(text or "", integer):
            found = verdict(groups, setting.key, value)
            if found != expected:
                wrong.append(f"{setting.key} = {value!r}: {found}, but the page says {text!r}")
            probed += 1
    assert not wrong, "\n".join(wrong)
    assert probed > 100


def test_every_numeric_key_states_its_range(sections):
    unstated = reference.unstated_ranges(_all_groups(sections))
    assert not unstated, (
        "numeric settings whose range is stated nowhere: add each to config_checks.SETTING_RANGES (checked there) "
        "or to tools/settings_reference.py's STATED_RANGES (checked by its class; NOT_STATED for any value): "
        + ", ".join(unstated)
    )


def test_the_probe_reads_each_form_of_range():
    assert stated_bounds(">= 1, or null for the whole rollout") == ([(">=", 1.0)], True)
    assert stated_bounds("an integer >= 0") == ([(">=", 0.0)], False)
    assert stated_bounds("in (0, 1]") == ([(">", 0.0), ("<=", 1.0)], False)
    assert stated_bounds("in [2, data.sampling.group_size], or null for the group size") == ([(">=", 2.0)], True)
    assert stated_bounds("a multiple of num_heads") == ([], False)
    assert math.isclose(FLOAT_STEP, 1e-6)


# ------------------------------------------------------------------------------------------------ the stub
def test_the_stub_in_the_tree_names_its_generator():
    stub = (ROOT / "docs" / "reference" / "settings.md").read_text()
    assert "tools/settings_reference.py" in stub
    assert "docs/hooks/settings_reference.py" in stub
