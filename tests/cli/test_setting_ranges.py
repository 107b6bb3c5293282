"""Every numeric setting of ``validation.SETTING_RANGES`` refuses a value outside its range in one line naming it,
and accepts its edge (``check_setting_ranges``, which the CLI runs on the parsed config before anything is built).
"""

from __future__ import annotations

import re

import pytest

from grpo_lightning.config import ConfigError, ScheduleConfig, UpdateConfig
from grpo_lightning.config_checks import SETTING_RANGES, check_ranges, check_setting_ranges

# One value each range refuses and one it accepts (edges included).
RANGE_CASES = {
    "model.lr": (-1e-6, 0.0),
    "model.weight_decay": (-0.1, 0.0),
    "model.warmup_steps": (-1, 0),
    "model.logprob_batch_size": (0, 1),
    "data.reward_timeout_s": (0.0, None),
    "data.update.num_iterations": (0, 1),
    "data.prompts_per_round": (0, 1),
    "data.sampling.max_sampling_rounds": (0, 1),
    "data.update.mini_batch_size": (0, None),
    "data.update.micro_batch_size": (-2, 1),
    "data.eval.batch_size": (0, 1),
    "data.eval.limit": (-1, 0),
    "data.schedule.rollout_lag": (-1, 0),
    "data.schedule.rollout_threads": (0, None),
    "data.schedule.rollout_timeout_s": (0, 0.5),
    "data.schedule.max_staleness": (0, 1),
    "data.schedule.tokens_per_push": (0, None),
    "trainer.accumulate_grad_batches": (0, 1),
    "trainer.gradient_clip_val": (-0.5, 0.0),
    "trainer.check_val_every_n_epoch": (0, None),
    "trainer.val_check_interval": (0, 0.25),
}


def nested(path: str, value) -> dict:
    """``{"update": {"mini_batch_size": value}}`` for ``update.mini_batch_size``: a group's setting inside it."""
    *groups, key = path.split(".")
    out = {key: value}
    for group in reversed(groups):
        out = {group: out}
    return out


@pytest.mark.parametrize("name", sorted(SETTING_RANGES))
def test_each_numeric_range_refuses_a_value_outside_it_and_accepts_its_edge(name):
    section, _, key = name.partition(".")
    bad, good = RANGE_CASES[name]
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)} must be .* \(got {re.escape(repr(bad))}\)$"):
        check_setting_ranges({section: nested(key, bad)})
    check_setting_ranges({section: nested(key, good)})
    check_ranges(section, {"some_other_setting": bad})  # only the settings of the table are checked


def test_a_groups_ranges_are_checked_on_its_settings_object_too():
    """The DataModule checks its arguments, the groups given as settings objects (``check_ranges("data", ...)``)."""
    with pytest.raises(ConfigError, match=r"^data.update.num_iterations must be >= 1 \(got 0\)$"):
        check_ranges("data", {"update": UpdateConfig(num_iterations=0)})
    check_ranges("data", {"update": None, "schedule": ScheduleConfig()})  # a group left unset: its defaults
