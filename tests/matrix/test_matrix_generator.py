"""The matrix's generator (``matrix_cases.py``): every pair of axis values covered, every kind of the package
accounted for, and a capability added later joining the matrix by its declaration alone."""

from __future__ import annotations

import pytest
from matrix_cases import SERVER_KINDS, all_pairs, axes, engine_axis, full_product, package_kinds, pairs_of
from matrix_harness import KIND_FACTORIES, build_models, run_case

from grpo_lightning.config import ConfigError
from grpo_lightning.engines import ENGINES, LeanEngine, register_engine


def test_the_pairwise_subset_covers_every_pair_and_is_deterministic():
    values = axes()
    chosen = all_pairs(values)
    every = {pair for case in full_product(values) for pair in pairs_of(case)}
    assert set().union(*(pairs_of(case) for case in chosen)) == every
    assert chosen == all_pairs(values) and len(chosen) < len(full_product(values)) / 4


def test_every_rollout_kind_of_the_package_is_in_the_matrix_or_left_out_with_a_reason():
    names = {cls.__name__ for cls in package_kinds()}
    assert names - set(SERVER_KINDS) <= set(KIND_FACTORIES), "a new kind needs a small instance in matrix_harness"
    assert set(axes()["kind"]) == {"single_turn", *(names - set(SERVER_KINDS))}


class TextOnlyEngine(LeanEngine):
    """A later engine: the lean loop under another name, declaring (by the base class's default) no images."""

    name = "text_only"


@pytest.fixture
def text_only_engine():
    register_engine("matrix_text_only", TextOnlyEngine)
    yield "matrix_text_only"
    del ENGINES["matrix_text_only"]


def test_an_engine_registered_later_joins_the_matrix_by_its_declaration(text_only_engine, tmp_path_factory, tmp_path):
    """Registered through the engine registry: the generator yields its cases (and the pairwise subset has them),
    and its image cases are refused before training in one line naming the engine and the images."""
    assert text_only_engine in engine_axis()
    assert not TextOnlyEngine.takes_images and not TextOnlyEngine.takes_row_inputs
    cases = [case for case in full_product() if case.engine == text_only_engine]
    assert len(cases) == len(full_product()) // len(axes()["engine"])
    assert any(case.engine == text_only_engine for case in all_pairs())
    image = next(c for c in cases if c.modality == "image" and c.kind == "single_turn" and c.lag == 0)
    outcome = run_case(image, build_models(tmp_path_factory.mktemp("matrix")), tmp_path)
    assert isinstance(outcome.error, ConfigError) and "\n" not in str(outcome.error)
    assert "data.engine: text_only" in str(outcome.error) and "image" in str(outcome.error)
    assert outcome.trainer.global_step == 0 and outcome.data.train_data is None
