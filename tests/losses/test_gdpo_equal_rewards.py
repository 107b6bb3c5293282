"""Where every reward of a group is equal, TRL's advantages are rounding noise and ours exactly 0, as
docs/coming_from_trl.md and docs/losses.md say where they claim the match with TRL (``test_gdpo.py``'s cross-check).

TRL 1.16 subtracts a float32 ``nanmean`` that is an ulp off the rewards (0.9 six times) and divides the residue
by ``std + 1e-4``: in a group that alone gives ~6e-4; under GDPO the batch normalisation divides those residues by
their own spread, so a batch whose every group has equal rewards gets advantages of order 1 from nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gdpo import ours, trl_advantages

ROOT = Path(__file__).resolve().parents[2]
GROUP = 6
# Six groups of six, each group's rewards equal: 0.9 (not exactly its float32 mean) once, 0.5 (exact) five times.
EQUAL_GROUPS = {"gdpo_a": [0.9] * GROUP + [0.5] * (5 * GROUP)}


@pytest.mark.parametrize(
    ("aggregation", "noise"), [("sum_then_normalize", (1e-4, 1e-3)), ("normalize_then_sum", (1.0, 2.0))]
)
def test_groups_of_equal_rewards_get_trl_noise_and_exactly_zero_here(aggregation, noise):
    theirs = trl_advantages(GROUP, EQUAL_GROUPS, [1.0], aggregation)
    low, high = noise
    assert low < theirs.abs().max().item() < high  # GDPO: 1.53 here; it grows with the batch's groups
    assert torch.equal(ours(EQUAL_GROUPS, [1.0], GROUP, aggregation, std="sample"), torch.zeros(6 * GROUP))


@pytest.mark.parametrize("page", ["docs/coming_from_trl.md", "docs/losses.md"])
def test_the_docs_say_so_where_they_claim_the_match(page):
    """Each sentence that claims GDPO matches TRL to 1e-6 names the exception (TRL's noise, our exact 0)."""
    text = " ".join((ROOT / page).read_text().split())
    at = [i for i in range(len(text)) if text.startswith("1e-6", i)]
    # the claim's own paragraph or table cell: the text before it, back to the cell's border
    claims = [i for i in at if "TRL" in text[i - 150 : i] and "GDPO" in text[i - 700 : i].rpartition(" | ")[2]]
    assert claims, f"{page}: no claim that GDPO matches TRL to 1e-6 found"
    for i in claims:
        after = text[i : i + 500]
        assert "exactly 0" in after and "noise" in after, text[i - 200 : i + 300]
