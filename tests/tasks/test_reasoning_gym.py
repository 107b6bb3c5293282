"""reasoning-gym as a task source: ``data.dataset: reasoning_gym:<task>`` and the ``reasoning_gym`` reward.

Rows of several kinds of task (arithmetic, a puzzle whose checker takes many answers, string and logic tasks) are
scored by reasoning-gym's own checkers through our columns; a mixture keeps its weights; held-out rows never repeat
a training question; a curriculum's levels become a ``level`` column; bad settings are refused in one line; a short
run trains on a task with the reward from reasoning-gym's scorer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from importlib.util import find_spec

import pytest
import yaml

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.reasoning_gym.rewards import decode, encode, extract_answer
from grpo_lightning.rewards import RewardError, RewardSpec, register
from grpo_lightning.tasks import load_task

needs_rg = pytest.mark.skipif(
    find_spec("reasoning_gym") is None, reason='reasoning-gym is not installed: pip install -e ".[reasoning-gym]"'
)
COLUMNS = ("task", "metadata", "answer", "task_config")


def score(rows, completions, **kwargs):
    """The ``reasoning_gym`` reward, built from its spec as a run builds it, on ``completions`` of ``rows``."""
    fn = RewardSpec("reasoning_gym", kwargs=kwargs).build()
    columns = {name: rows[name] for name in rows.column_names if name != "prompt"}
    return fn(prompts=rows["prompt"], completions=completions, **columns)


def tagged(answers):
    return [f"<think>…</think> <answer>{a}</answer>" for a in answers]


# ------------------------------------------------------------------------------ resolution, the optional package
def test_naming_a_task_family_imports_nothing_until_it_is_built():
    code = (
        "import sys\n"
        "import grpo_lightning.cli\n"
        "from grpo_lightning.rollout import data_sources\n"
        "from grpo_lightning.rewards import RewardSpec, available\n"
        "from grpo_lightning.tasks import is_task\n"
        "assert is_task('reasoning_gym:basic_arithmetic') and is_task('arithmetic') and not is_task('gym:x')\n"
        "assert 'reasoning_gym' in available()\n"
        "RewardSpec('exact_answer').build()\n"
        "assert 'reasoning_gym' not in sys.modules, 'reasoning_gym imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_missing_package_is_refused_in_one_line_saying_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` now fails
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[reasoning-gym\]"') as err:
        load_task("reasoning_gym:basic_arithmetic")
    assert "\n" not in str(err.value)
    with pytest.raises(RewardError, match=r'pip install -e "\.\[reasoning-gym\]"'):
        RewardSpec("reasoning_gym").build()


@needs_rg
def test_a_bad_task_name_is_refused_in_one_line_saying_how_to_list_the_names():
    with pytest.raises(ConfigError) as err:
        load_task("reasoning_gym:basic_arithmatic")
    message = str(err.value)
    assert "\n" not in message and "did you mean basic_arithmetic" in message
    command = message.rsplit("list them: ", 1)[1]
    listed = subprocess.run(command.split(), capture_output=True, text=True, check=True, timeout=120).stdout
    names = [line.split()[0] for line in listed.splitlines()]
    assert "reasoning_gym:basic_arithmetic" in names and "reasoning_gym:composite" in names
    assert "reasoning_gym:basic_arithmetic  (5 levels)" in listed.splitlines()


@needs_rg
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"max_termz": 3},
            r"data\.task_kwargs: basic_arithmetic has no setting 'max_termz'; its settings: .*min_terms",
        ),
        ({"min_terms": 0}, r"reasoning-gym refuses these settings: min_terms must be positive"),
        ({"size": 0}, r"data\.task_kwargs\.size must be an integer >= 1"),
        ({"template": "Q: {q}"}, r"data\.task_kwargs\.template must hold \{question\}"),
        ({"levels": [0, 9]}, r"levels must be a list of distinct level numbers from 0 to 4"),
        ({"levels": [1], "max_terms": 3}, r"data\.task_kwargs\.max_terms: .*curriculum sets it"),
    ],
)
def test_bad_settings_are_refused_in_one_line_naming_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_task("reasoning_gym:basic_arithmetic", **kwargs)
    assert "\n" not in str(err.value)


@needs_rg
def test_settings_reasoning_gym_cannot_make_rows_with_are_refused_in_one_line():
    """Its own refusal (some curricula's top levels ask for settings it refuses), and a failure to make an item."""
    with pytest.raises(ConfigError, match=r"caesar_cipher at level 2: reasoning-gym refuses .* choose other") as err:
        load_task("reasoning_gym:caesar_cipher", levels=[0, 2], size=4, test_size=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"spell_backward: reasoning-gym cannot make rows .*IndexError") as err:
        load_task("reasoning_gym:spell_backward", min_word_len=15, max_word_len=15, size=4, test_size=2)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------- tasks of different kinds, scored
@needs_rg
@pytest.mark.parametrize(
    "task,settings",
    [
        ("basic_arithmetic", {"min_terms": 2, "max_terms": 3}),  # arithmetic
        ("countdown", {"min_numbers": 3, "max_numbers": 4}),  # a puzzle: any expression that reaches the target
        ("mini_sudoku", {}),  # a puzzle with a grid answer over several lines
        ("spell_backward", {}),  # a string task
        ("knights_knaves", {"n_people": 2}),  # logic, an answer in words
    ],
)
def test_each_kind_of_task_scores_its_right_answers_one_and_wrong_ones_less(task, settings):
    data = load_task(f"reasoning_gym:{task}", size=12, test_size=6, seed=3, **settings)
    for split in ("train", "test"):
        rows = data[split]
        assert set(COLUMNS) <= set(rows.column_names) and set(rows["task"]) == {task}
        assert all(isinstance(p, str) and p for p in rows["prompt"]) and all(a for a in rows["answer"])
        assert score(rows, tagged(rows["answer"])) == [1.0] * len(rows)
        assert all(s < 1.0 for s in score(rows, tagged(["no idea"] * len(rows))))
        others = rows["answer"][1:] + rows["answer"][:1]  # each row given the next row's answer
        scores = score(rows, tagged(others))
        assert all(s < 1.0 for s, own, other in zip(scores, rows["answer"], others) if other != own)


@needs_rg
def test_a_checker_that_takes_many_answers_takes_one_that_is_not_the_reference():
    rows = load_task("reasoning_gym:countdown", size=8, test_size=2, min_numbers=3, max_numbers=4)["train"]
    others = [f"({answer})" for answer in rows["answer"]]  # the same value, not the reference's text
    assert score(rows, tagged(others)) == [1.0] * len(rows)
    numbers = [decode(m)["numbers"] for m in rows["metadata"]]
    assert all(s < 1.0 for s in score(rows, tagged(["+".join(map(str, n[:-1])) for n in numbers])))  # one unused
    logic = load_task("reasoning_gym:knights_knaves", size=4, test_size=2, n_people=2)["train"]
    swapped = [", and ".join(reversed(a.rstrip(".").split(", and "))) + "." for a in logic["answer"]]
    assert swapped != logic["answer"] and score(logic, tagged(swapped)) == [1.0] * len(logic)


@needs_rg
@pytest.mark.parametrize("task", ["arc_agi", "graph_color", "codeio", "knights_knaves", "basic_arithmetic"])
def test_metadata_survives_the_columns_exactly(task):
    """Tuples, integer keys and numpy values come back as the task made them, so its checker sees the same entry."""
    import reasoning_gym

    rows = load_task(f"reasoning_gym:{task}", size=3, test_size=1, seed=11)["train"]
    made = reasoning_gym.create_dataset(task, size=3, seed=11)
    for i, text in enumerate(rows["metadata"]):
        original = made[i]["metadata"]
        assert decode(text) == original and repr(decode(text)) == repr(_py(original))
        assert rows["answer"][i] == made[i]["answer"] and rows["prompt"][i] == made[i]["question"]
    answers = [a if a is not None else "x" for a in rows["answer"]]
    ours = score(rows, tagged(answers))
    theirs = [made.score_answer(a, made[i]) for i, a in enumerate(answers)]
    assert ours == theirs


def _py(value):
    """``value`` with numpy scalars as Python ones (what the columns keep of them)."""
    if isinstance(value, dict):
        return {k: _py(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_py(v) for v in value)
    return value.item() if type(value).__module__ == "numpy" else value


def test_encode_keeps_tuples_sets_and_keys_that_json_has_no_form_for():
    value = {"a": (1, (2, 3)), "b": {4, 5}, 7: [None, "x"], "__tuple__": 1, "c": {"d": [(True, 1.5)]}}
    back = decode(encode(value))
    assert back == value and repr(back["a"]) == "(1, (2, 3))" and 7 in back
    with pytest.raises(TypeError, match="no JSON form"):
        encode({"x": object()})


# ------------------------------------------------------------------------------------------- answer extraction
def test_the_extraction_modes_take_the_answer_where_they_say():
    text = "<answer> 3 </answer> wait, no.\n<answer>\n-61\n</answer>\nso \\boxed{\\frac{1}{2}}\n\n  last line  \n"
    assert extract_answer(text, "answer_tag") == "-61"
    assert extract_answer(text, "boxed") == "\\frac{1}{2}"
    assert extract_answer(text, "last_line") == "last line"
    for mode in ("answer_tag", "boxed", "last_line"):
        assert extract_answer("   \n", mode) is None
    if find_spec("reasoning_gym") is not None:  # the tag mode reads the tag as reasoning-gym's own helper does
        from reasoning_gym.utils import extract_answer as theirs

        for sample in (text, "<answer>a</answer><answer> b c </answer>", "<answer>x", "none"):
            assert extract_answer(sample, "answer_tag") == theirs(sample)


@needs_rg
def test_each_extraction_mode_scores_and_no_answer_scores_zero():
    rows = load_task("reasoning_gym:basic_arithmetic", size=4, test_size=1, seed=5)["train"]
    answers = rows["answer"]
    assert score(rows, [f"I think {a}" for a in answers]) == [0.0] * 4  # no tag: nothing taken, even if it is there
    assert score(rows, [f"I think\n{a}\n" for a in answers], extract="last_line") == [1.0] * 4
    assert score(rows, [f"so \\boxed{{{a}}}." for a in answers], extract="boxed") == [1.0] * 4
    assert score(rows, [f"<answer>{a}</answer>" for a in answers], extract="boxed") == [0.0] * 4
    with pytest.raises(RewardError, match="unknown extract 'json'; use one of answer_tag, last_line, boxed"):
        RewardSpec("reasoning_gym", kwargs={"extract": "json"}).build()


# ----------------------------------------------------------------------------------- mixtures, held-out rows
@needs_rg
def test_a_composite_mixture_keeps_each_tasks_share_close_to_its_weight():
    datasets = [
        {"name": "basic_arithmetic", "weight": 1},
        {"name": "spell_backward", "weight": 3, "config": {"min_word_len": 3, "max_word_len": 5}},
        {"name": "leg_counting", "weight": 4},
    ]
    data = load_task("reasoning_gym:composite", datasets=datasets, size=1600, test_size=160, seed=2)
    shares = Counter(data["train"]["task"])
    for spec in datasets:
        assert abs(shares[spec["name"]] / 1600 - spec["weight"] / 8) < 0.04, shares
    assert set(data["test"]["task"]) == {"basic_arithmetic", "spell_backward", "leg_counting"}
    spelled = [
        json.loads(c) for t, c in zip(data["train"]["task"], data["train"]["task_config"]) if t == "spell_backward"
    ]
    assert spelled[0] == {"min_word_len": 3, "max_word_len": 5}  # each row carries its own task's settings
    rows = data["test"]
    assert score(rows, tagged(rows["answer"])) == [1.0] * len(rows)  # each row scored by its own task's checker
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.weight must be a number > 0"):
        load_task("reasoning_gym:composite", datasets=[datasets[0], {**datasets[1], "weight": 0}])
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.config: basic_arithmetic has no setting 'terms'"):
        load_task(
            "reasoning_gym:composite", datasets=[{"name": "basic_arithmetic", "weight": 1, "config": {"terms": 2}}]
        )


@needs_rg
def test_held_out_rows_never_repeat_a_training_question():
    """Few distinct questions (one-digit sums): a second seed repeats training ones, which the test split skips."""
    import reasoning_gym

    settings = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    settings.update(allow_negation=False, allow_parentheses=False)  # 121 questions: "Calculate 2 + 3." ...
    data = load_task("reasoning_gym:basic_arithmetic", size=60, test_size=20, seed=0, **settings)
    train, test = set(data["train"]["prompt"]), data["test"]["prompt"]
    assert len(test) == 20 and len(set(test)) == 20 and not train & set(test)
    again = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=0 + 2**31, **settings)
    assert any(item["question"] in train for item in again)  # what was skipped: without it, the splits would share
    with pytest.raises(ConfigError, match="every held-out question of reasoning_gym:basic_arithmetic is a training"):
        load_task("reasoning_gym:basic_arithmetic", size=3000, test_size=5, seed=0, **settings)


# -------------------------------------------------------------------------------------------------- levels
@needs_rg
def test_levels_make_rows_of_each_difficulty_scored_by_their_own_settings():
    import reasoning_gym

    from grpo_lightning.integrations.reasoning_gym.rewards import curriculum_context

    data = load_task("reasoning_gym:basic_arithmetic", curriculum=True, size=50, test_size=10, seed=1)
    train = data["train"]
    assert Counter(train["level"]) == {level: 10 for level in range(5)}  # every level, equal shares
    sizes = [
        (level, decode(m)["num_terms"], decode(m)["num_digits"]) for level, m in zip(train["level"], train["metadata"])
    ]
    for level in range(5):  # within the curriculum's ranges for the level, as reasoning-gym makes them
        curriculum = reasoning_gym.factory.create_curriculum("basic_arithmetic")
        curriculum.set_global_level(level)
        config = curriculum.generate_configuration({}, curriculum_context())
        assert all(
            terms <= config.max_terms and digits <= config.max_digits for k, terms, digits in sizes if k == level
        )
    assert {(terms, digits) for k, terms, digits in sizes if k == 0} == {(2, 1)}  # the easiest only
    assert max(terms for k, terms, _ in sizes if k == 4) >= 4  # harder ones at the top
    assert score(train, tagged(train["answer"])) == [1.0] * 50
    assert not set(data["test"]["prompt"]) & set(train["prompt"])
    chosen = load_task("reasoning_gym:basic_arithmetic", levels=[3, 1], size=4, test_size=2, seed=1)["train"]
    assert chosen["level"] == [1, 1, 3, 3]
    same = [p for p, level in zip(train["prompt"], train["level"]) if level == 1][:2]
    assert chosen["prompt"][:2] == same  # a level's rows do not depend on which other levels are made
    assert "level" not in load_task("reasoning_gym:basic_arithmetic", size=4, test_size=2)["train"].column_names


@needs_rg
def test_a_run_with_a_curriculum_gets_rows_of_every_level():
    from grpo_lightning import RolloutDataModule
    from grpo_lightning.rollout.curriculum import CurriculumConfig

    settings = {"dataset": "reasoning_gym:basic_arithmetic", "task_kwargs": {"size": 10, "test_size": 5, "seed": 8}}
    sources = RolloutDataModule(**settings, curriculum=CurriculumConfig()).sources
    rows, (held, _) = sources.training_rows(), sources.held_out()
    assert sorted(set(rows["level"])) == sorted(set(held["level"])) == [0, 1, 2, 3, 4]
    assert not set(held["prompt"]) & set(rows["prompt"])
    assert "level" not in RolloutDataModule(**settings).sources.training_rows().column_names


@needs_rg
def test_each_task_of_a_mixture_takes_its_own_levels():
    import reasoning_gym

    from grpo_lightning.integrations.reasoning_gym.rewards import curriculum_context

    datasets = [
        {"name": "basic_arithmetic", "weight": 2, "levels": [3, 0]},
        {"name": "spell_backward", "weight": 1},
        {"name": "list_functions", "weight": 1},  # no reasoning-gym curriculum: its own settings, level None
    ]
    data = load_task("reasoning_gym:composite", datasets=datasets, size=80, test_size=20, seed=5)
    train = data["train"]
    made = Counter(zip(train["task"], train["level"]))
    assert set(made) == {("basic_arithmetic", 0), ("basic_arithmetic", 3), ("spell_backward", None)} | {
        ("list_functions", None)
    }
    for level in (0, 3):  # each row within its level's settings, as the task's curriculum makes them
        curriculum = reasoning_gym.factory.create_curriculum("basic_arithmetic")
        curriculum.set_global_level(level)
        config = curriculum.generate_configuration({}, curriculum_context())
        sizes = [decode(m) for t, k, m in zip(train["task"], train["level"], train["metadata"]) if k == level]
        assert all(s["num_terms"] <= config.max_terms and s["num_digits"] <= config.max_digits for s in sizes)
        if level == 0:
            assert {(s["num_terms"], s["num_digits"]) for s in sizes} == {(2, 1)}  # the easiest only
    assert max(decode(m)["num_terms"] for k, m in zip(train["level"], train["metadata"]) if k == 3) >= 4
    configs = {c for t, c in zip(train["task"], train["task_config"]) if t == "basic_arithmetic"}
    assert configs == {"{}"}  # the task's own settings; its levels are the level column
    for rows in (train, data["test"]):  # each row scored by its own task's checker at its own level
        assert score(rows, tagged(rows["answer"])) == [1.0] * len(rows)
    assert not set(data["test"]["prompt"]) & set(train["prompt"])
    assert {level for t, level in zip(data["test"]["task"], data["test"]["level"]) if t == "basic_arithmetic"} == {0, 3}

    under_curriculum = load_task("reasoning_gym:composite", curriculum=True, datasets=datasets, size=80, seed=5)
    levels = Counter(zip(under_curriculum["train"]["task"], under_curriculum["train"]["level"]))
    assert {k for t, k in levels if t == "spell_backward"} == {0, 1, 2, 3, 4}  # every level of the task's curriculum
    assert {k for t, k in levels if t == "basic_arithmetic"} == {0, 3}  # its own levels still
    assert {k for t, k in levels if t == "list_functions"} == {None}
    plain = load_task("reasoning_gym:composite", datasets=[datasets[1]], size=4, test_size=2)["train"]
    assert "level" not in plain.column_names  # no levels asked for: reasoning-gym's composite, as before


@needs_rg
@pytest.mark.parametrize(
    "change,match",
    [
        ({0: {"levels": [5]}}, r"datasets\[0\]\.levels must be a list of distinct level numbers from 0 to 4"),
        ({1: {"levels": [0]}}, r"datasets\[1\]\.levels: reasoning_gym:list_functions has no reasoning-gym curriculum"),
        ({0: {"config": {"max_terms": 3}}}, r"datasets\[0\]\.config\.max_terms: .*curriculum sets it"),
        ({0: {"levels": [0], "size": 3}}, r"datasets\[0\] must be \{name, weight, config, levels\}"),
    ],
)
def test_bad_levels_of_a_mixtures_task_are_refused_in_one_line_naming_the_key(change, match):
    datasets = [{"name": "basic_arithmetic", "weight": 1, "levels": [0]}, {"name": "list_functions", "weight": 1}]
    for i, update in change.items():
        datasets[i] = {**datasets[i], **update}
    with pytest.raises(ConfigError, match=match) as err:
        load_task("reasoning_gym:composite", datasets=datasets, size=4, test_size=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"takes levels per task \(datasets\[i\]\.levels\)"):
        load_task("reasoning_gym:composite", datasets=datasets[1:], levels=[0], size=4, test_size=2)


DRAWN: list[list[tuple[str, int]]] = []  # each round's (task, level) per completion, as the reward below sees them


@register("test_reasoning_gym_by_level")
def solved_by_level(prompts, completions, task, level, **_):
    """Level 0 always solved, level 1 half the time (each group alternates): the pass rates of an easy level and of
    a level being learnt."""
    DRAWN.append(list(zip(task, level)))
    return [1.0 if k == 0 else float(i % 2) for i, k in enumerate(level)]


@needs_rg
@pytest.mark.parametrize(
    "dataset,task_kwargs",
    [
        ("reasoning_gym:basic_arithmetic", {"levels": [0, 1]}),
        (
            "reasoning_gym:composite",
            {"datasets": [{"name": n, "weight": 1, "levels": [0, 1]} for n in ("basic_arithmetic", "spell_backward")]},
        ),
    ],
)
def test_the_curriculum_moves_on_to_the_harder_level_once_the_easy_one_is_solved(tmp_path, dataset, task_kwargs):
    """End to end (rows with levels, rollouts, reward, the pass-rate curriculum): the easy level's prompts, always
    solved, drop to other_weight, so the draw moves on to the harder level, of one task or of each in a mixture."""
    from grpo_lightning.cli import GRPOCLI
    from grpo_lightning.rollout.curriculum import PREFERRED, TOO_EASY

    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_epochs": 10, "logger": False, "enable_checkpointing": False},
        "model": {"tiny_model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}},
        "data": {
            "dataset": dataset,
            "task_kwargs": {**task_kwargs, "size": 16, "test_size": 2, "seed": 1},
            "rewards": [{"name": "test_reasoning_gym_by_level"}],
            "sampling": {"group_size": 2, "max_new_tokens": 2},
            "prompts_per_round": 4,
            "val_split": None,
            "curriculum": {"min_pass_rate": 0.1, "max_pass_rate": 0.9, "history": 0.0},
        },
    }
    path = tmp_path / "curriculum.yaml"
    path.write_text(yaml.safe_dump(config))
    DRAWN.clear()
    cli = GRPOCLI(args=["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path)])
    sampler, rows = cli.datamodule.curriculum, cli.datamodule.train_data
    assert len(DRAWN) == 10 and sorted(set(rows["level"])) == [0, 1]
    category = sampler.categories().tolist()
    for k, level in enumerate(rows["level"]):  # every prompt drawn: rated by its level's pass rate
        assert category[k] in ({TOO_EASY} if level == 0 else {PREFERRED}) or sampler.pass_rates[k].isnan()
    weights = sampler.weights()
    hard = sum(w for w, level in zip(weights.tolist(), rows["level"]) if level == 1)
    assert hard / weights.sum().item() > 0.8  # the next draws: mostly the harder level
    late = [drawn for round_drawn in DRAWN[-4:] for drawn in round_drawn[::2]]  # the last rounds' prompts
    assert sum(level for _, level in late) / len(late) >= 0.75  # a uniform draw would give about half
    if dataset.endswith("composite"):  # each task's harder level among them
        assert {name for name, level in late if level == 1} == {"basic_arithmetic", "spell_backward"}


# ------------------------------------------------------------------------------------------------- a short run
@needs_rg
def test_a_run_trains_on_a_reasoning_gym_task_with_its_scorer(tmp_path):
    import reasoning_gym

    from grpo_lightning.cli import GRPOCLI
    from grpo_lightning.integrations.reasoning_gym.rewards import curriculum_context
    from grpo_lightning.integrations.reasoning_gym.tasks import LEVEL_SEED_STRIDE

    config = {
        "trainer": {"accelerator": "cpu", "max_epochs": 2, "logger": False, "enable_checkpointing": False},
        "model": {
            "tiny_model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "objective": {"beta": 0.0},
        },
        "data": {
            "dataset": "reasoning_gym:basic_arithmetic",
            "task_kwargs": {"size": 40, "test_size": 8, "seed": 4, "levels": [0, 1]},
            "rewards": [{"name": "reasoning_gym", "kwargs": {"extract": "last_line"}}],
            "sampling": {"group_size": 4, "max_new_tokens": 6},
            "prompts_per_round": 4,
            "val_split": None,
            "curriculum": {"min_pass_rate": 0.1, "max_pass_rate": 0.9},
        },
    }
    path = tmp_path / "rg.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = GRPOCLI(args=["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path)])
    assert cli.trainer.current_epoch == 2 and cli.datamodule.curriculum.rounds == 2
    rows = cli.datamodule.train_data
    assert set(rows["level"]) == {0, 1}
    rollout = cli.datamodule.last_rollout
    by_prompt = {
        p: (level, decode(m)["source_index"]) for p, level, m in zip(rows["prompt"], rows["level"], rows["metadata"])
    }
    made = {}
    for level in (0, 1):  # reasoning-gym's own datasets at the run's levels, from its own curriculum
        curriculum = reasoning_gym.factory.create_curriculum("basic_arithmetic")
        curriculum.set_global_level(level)
        settings = {"size": 20, "seed": 4 + level * LEVEL_SEED_STRIDE}
        made[level] = reasoning_gym.factory.DATASETS["basic_arithmetic"][0](
            config=curriculum.generate_configuration(settings, curriculum_context())
        )
    expected = []
    for prompt, completion in zip(rollout.prompts, rollout.completions):
        level, index = by_prompt[prompt]
        entry = made[level][index]
        assert entry["question"] == prompt
        answer = extract_answer(completion, "last_line")
        expected.append(0.0 if answer is None else made[level].score_answer(answer, entry))
    assert rollout.reward_columns["reasoning_gym"] == pytest.approx(expected)
    assert "reward_log/reasoning_gym/basic_arithmetic" in rollout.metrics
