"""Every numeric setting of ``validation.SETTING_RANGES`` refuses a value outside its range in one line naming it,
and accepts its edge (``check_setting_ranges``, which the CLI runs on the parsed config before anything is built).
"""

from __future__ import annotations

import re

import pytest

from grpo_lightning.config import ConfigError
from grpo_lightning.config_checks import SETTING_RANGES, check_ranges, check_setting_ranges

# One value each range refuses and one it accepts (edges included).
RANGE_CASES = {
    "model.lr": (-1e-6, 0.0),
    "model.weight_decay": (-0.1, 0.0),
    "model.warmup_steps": (-1, 0),
    "model.logprob_batch_size": (0, 1),
    "data.reward_timeout_s": (0.0, None),
    "data.num_iterations": (0, 1),
    "data.prompts_per_round": (0, 1),
    "data.max_sampling_rounds": (0, 1),
    "data.mini_batch_size": (0, None),
    "data.micro_batch_size": (-2, 1),
    "data.val_batch_size": (0, 1),
    "data.val_limit": (-1, 0),
    "data.rollout_lag": (-1, 0),
    "data.rollout_threads": (0, None),
    "data.rollout_timeout_s": (0, 0.5),
    "trainer.accumulate_grad_batches": (0, 1),
    "trainer.gradient_clip_val": (-0.5, 0.0),
    "trainer.check_val_every_n_epoch": (0, None),
    "trainer.val_check_interval": (0, 0.25),
}


@pytest.mark.parametrize("name", sorted(SETTING_RANGES))
def test_each_numeric_range_refuses_a_value_outside_it_and_accepts_its_edge(name):
    section, _, key = name.partition(".")
    bad, good = RANGE_CASES[name]
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)} must be .* \(got {re.escape(repr(bad))}\)$"):
        check_setting_ranges({section: {key: bad}})
    check_setting_ranges({section: {key: good}})
    check_ranges(section, {"some_other_setting": bad})  # only the settings of the table are checked
