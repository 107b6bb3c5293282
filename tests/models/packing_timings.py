"""Timings that stand in for ``models/cpu_packing_rule.measure`` in the tests of the CPU packing: no test times
anything (``tests/conftest.py`` keeps packing off; ``injected`` turns it on with these, for the test files'
``calibration`` fixtures)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from grpo_lightning.models import cpu_packing_rule
from grpo_lightning.models.cpu_packing import GROUPS, onednn_available
from grpo_lightning.models.cpu_packing_rule import Timing

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build cannot pack CPU weights")

PAYS = Timing(plain=1e-3, packed=0.5e-3, reorder=1e-3)  # half the time; the reorder costs one plain product
LOSES = Timing(plain=1e-4, packed=1.2e-4, reorder=3e-4)
MARGINAL = Timing(plain=1e-3, packed=0.95e-3, reorder=0.0)  # faster, but not by ``MARGIN``


class Calibration:
    """Stands in for ``cpu_packing_rule.measure``: returns ``timings`` (one ``Timing`` for every group, one per
    group, or None: a measurement that did not repeat), counting its calls; ``during`` runs inside the
    "measurement" (another process finishing first)."""

    def __init__(self, timings: Timing | dict[str, Timing] | None = PAYS, during=None) -> None:
        self.timings, self.during, self.calls = timings, during, []

    def __call__(self, groups, rows):
        self.calls.append(rows)
        if self.during is not None:
            self.during()
        timings = self.timings
        if timings is None:  # readings that did not repeat
            return None
        return dict(timings) if isinstance(timings, dict) else {name: timings for name in GROUPS}


def injected(monkeypatch: pytest.MonkeyPatch, folder) -> Iterator[Calibration]:
    """Packing on (as outside the suite), on an AVX2 machine of the test's own, with a cache folder of its own
    under ``folder`` and injected timings (every group pays; set ``.timings`` to change them): the decisions are
    the rule's, nothing is timed."""
    monkeypatch.setenv(cpu_packing_rule.SWITCH, "auto")
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "cache"))
    monkeypatch.setattr(cpu_packing_rule, "instruction_set", lambda: "AVX2")
    fake = Calibration()
    monkeypatch.setattr(cpu_packing_rule, "measure", fake)
    cpu_packing_rule.forget()
    yield fake
    cpu_packing_rule.forget()
