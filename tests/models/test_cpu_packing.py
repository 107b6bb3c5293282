"""Where the CPU products multiply by packed weights (``models/cpu_packing_rule.py``), and that they stay correct.

Nothing here times anything: the suite keeps packing off (``tests/conftest.py``), and these tests turn it on with
timings injected in place of ``measure`` (the ``calibration`` fixture: ``packing_timings.injected``). They check
the decision (a group whose packing does not pay is not packed; passes and decoding steps as their reorder pays or
not), the cache (reused by a second process, measured again when corrupt, unreadable, for another CPU; decided
without it where the folder is unwritable; the first of two racing processes wins), the safe default off the
measured instruction sets, every precision (autocast and bfloat16 weights never pack: issue 50 item 9), and packed
products against ``F.linear`` at the shapes each path takes.
"""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import F32
from packing_timings import LOSES, MARGINAL, PAYS, injected, needs_onednn
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lightning.models import cpu_packing_rule as rule
from grpo_lightning.models import lean as lean_forward
from grpo_lightning.models.cpu_packing import GROUPS, cpu_weight_packer, packed_linear
from grpo_lightning.models.cpu_packing_rule import Timing, decode_plan, pass_plan
from grpo_lightning.models.lean_decoder import LeanDecoder
from grpo_lightning.models.lean_forward import shared_prompt_hidden


@pytest.fixture
def calibration(monkeypatch, tmp_path):
    """CPU packing on with injected timings (``packing_timings.injected``)."""
    yield from injected(monkeypatch, tmp_path)


def llama(hidden: int = 32, intermediate: int = 48, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def cache_files(tmp_path, pattern: str = "*.json"):
    return sorted((tmp_path / "cache" / "grpo_lightning" / "cpu_packing").glob(pattern))


def decode(model, prompt_ids, new_tokens: int):
    """Logits ``[2P, new_tokens, V]`` of a prefill and ``new_tokens - 1`` decoding steps of the tokens
    ``decoded_tokens`` (2 samples a prompt)."""
    decoder = LeanDecoder(model)
    logits = [decoder.prefill(prompt_ids, torch.ones_like(prompt_ids), 2, new_tokens).repeat_interleave(2, 0)]
    tokens = decoded_tokens(prompt_ids.size(0) * 2)
    for _ in range(new_tokens - 1):
        logits.append(decoder.decode(tokens))
    return decoder, torch.stack(logits, 1)


def decoded_tokens(rows: int) -> torch.Tensor:
    return torch.arange(rows) % 7 + 1


@needs_onednn
def test_only_the_groups_whose_packing_pays_are_packed(calibration, monkeypatch):
    """Per product group: q/k/v and gate/up pay (stacked and packed), o loses, down gains less than ``MARGIN``:
    those two multiply by the parameters themselves. The logits stay the model's."""
    calibration.timings = {"qkv": PAYS, "o": LOSES, "gate_up": PAYS, "down": MARGINAL}
    model = llama()
    prompt_ids = torch.randint(1, 40, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        decoder, logits = decode(model, prompt_ids, new_tokens=8)
        plan = decode_plan(model, rows=6, steps=8)
    assert plan.groups == {"qkv", "gate_up"}
    for layer in decoder.layers:
        assert layer.qkv.packed is not None and layer.gate_up.packed is not None
        assert layer.o.packed is None and layer.down.packed is None
        assert layer.o.weight is model.model.layers[layer.layer_idx].self_attn.o_proj.weight  # no copy either
    assert calibration.calls == [8]  # decoding rows rounded up to a power of two, measured once for all steps
    monkeypatch.setenv(rule.SWITCH, "off")
    with torch.no_grad():
        plain_decoder, plain = decode(model, prompt_ids, new_tokens=8)
    assert all(layer.qkv is None and layer.o.packed is None for layer in plain_decoder.layers)
    torch.testing.assert_close(logits, plain, **F32)


@needs_onednn
def test_decoding_packs_only_where_its_steps_pay_for_the_reorder(calibration):
    """The reorder happens once per rollout: with ``PAYS`` packing pays from 2.5 steps on (reorder + 0.5 n ≤ 0.9 n
    plain products' time), so a rollout of 2 steps keeps plain products, one of 8 steps packs."""
    model = llama()
    with torch.no_grad():
        assert decode_plan(model, rows=32, steps=2) is None
        assert decode_plan(model, rows=32, steps=8).groups == set(GROUPS)
        assert decode_plan(model, rows=33, steps=8).groups == set(GROUPS)
    assert calibration.calls == [32, 64]  # one measurement per power-of-two class of rows
    # What a benchmark prints beside its table: packed over plain time, and from how many products packing pays
    assert rule.describe() == [f"decode at {rows} rows, 32 wide: " + ", ".join(
        f"{group} 0.50x (from 2.5 products)" for group in GROUPS) for rows in (32, 64)]  # fmt: skip


@needs_onednn
def test_a_pass_packs_only_where_its_positions_pay_for_the_reorder(calibration):
    """Timed at ``PASS_ROWS`` rows: with ``PAYS`` the reorder pays from 2.5 × ``PASS_ROWS`` positions on (reorder +
    0.5 n ≤ 0.9 n products of ``PASS_ROWS`` rows); below ``PASS_ROWS`` positions nothing is packed, nor measured."""
    model = llama()
    hidden = torch.zeros(1, 32)
    with torch.no_grad():
        assert pass_plan(model, hidden, rule.PASS_ROWS - 1) is None
        assert calibration.calls == []
        assert pass_plan(model, hidden, rule.PASS_ROWS) is None
        assert pass_plan(model, hidden, 2 * rule.PASS_ROWS) is None
        assert pass_plan(model, hidden, 3 * rule.PASS_ROWS).groups == set(GROUPS)
    assert calibration.calls == [rule.PASS_ROWS]


@needs_onednn
@pytest.mark.parametrize("isa", ["AVX512_AMX", "DEFAULT", "SVE256", "ZVECTOR"])
def test_nothing_is_measured_or_packed_off_the_measured_instruction_sets_or_when_off(calibration, monkeypatch, isa):
    model = llama()
    hidden = torch.zeros(1, 32)
    with torch.no_grad():
        assert decode_plan(model, rows=8, steps=64) is not None  # AVX2 (the fixture's)
        rule.forget()
        monkeypatch.setattr(rule, "instruction_set", lambda: isa)
        assert decode_plan(model, rows=8, steps=64) is None
        assert pass_plan(model, hidden, 8 * rule.PASS_ROWS) is None
        monkeypatch.setattr(rule, "instruction_set", lambda: "AVX512")
        monkeypatch.setenv(rule.SWITCH, "off")
        assert decode_plan(model, rows=8, steps=64) is None
        assert pass_plan(model, hidden, 8 * rule.PASS_ROWS) is None
    assert calibration.calls == [8]


@needs_onednn
def test_the_timings_are_cached_and_a_second_process_takes_the_same_path(calibration, monkeypatch, tmp_path):
    """One file per shape class; a new process (``forget``) reads it instead of measuring, so a resumed run or
    another DDP rank decides as the first did; another CPU model (or torch version) is measured again."""
    model = llama()
    calibration.timings = {"qkv": PAYS, "o": LOSES, "gate_up": LOSES, "down": PAYS}
    with torch.no_grad():
        first = decode_plan(model, rows=16, steps=16).groups
        [path] = cache_files(tmp_path)
        rule.forget()
        calibration.timings = LOSES  # a second measurement would now decide otherwise
        assert decode_plan(model, rows=16, steps=16).groups == first == {"qkv", "down"}
        assert len(calibration.calls) == 1
        assert json.loads(path.read_text())["key"]["torch"] == torch.__version__
        monkeypatch.setattr(rule, "cpu_model", lambda: "another CPU")
        assert decode_plan(model, rows=16, steps=16) is None  # measured again: LOSES
    assert len(calibration.calls) == 2 and len(cache_files(tmp_path)) == 2


@needs_onednn
@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "negative", "unreadable"])
def test_a_corrupt_or_unreadable_cache_file_is_measured_again_silently(
    calibration, monkeypatch, tmp_path, damage, caplog
):
    model = llama()
    with torch.no_grad():
        decode_plan(model, rows=4, steps=16)
        [path] = cache_files(tmp_path)
        text = path.read_text()
        content = json.loads(text)
        if damage == "garbage":
            path.write_text("not json")
        elif damage == "truncated":
            path.write_text(text[: len(text) // 2])
        elif damage == "other key":
            content["key"]["threads"] += 1
            path.write_text(json.dumps(content))
        elif damage == "negative":
            content["timings"]["o"][0] = -1.0
            path.write_text(json.dumps(content))
        else:  # chmod does not stop root: reading this file (until it is replaced) fails instead
            real, unreadable = type(path).read_text, path.stat().st_ino

            def read_text(self, *args, **kwargs):
                if self == path and self.stat().st_ino == unreadable:
                    raise PermissionError(13, "Permission denied", str(self))
                return real(self, *args, **kwargs)

            monkeypatch.setattr(type(path), "read_text", read_text)
        rule.forget()
        with caplog.at_level(logging.WARNING):
            assert decode_plan(model, rows=4, steps=16).groups == set(GROUPS)
    assert len(calibration.calls) == 2
    assert json.loads(path.read_text()) == json.loads(text)  # a damaged file is replaced by a whole one
    assert not [record for record in caplog.records if record.name == rule.__name__]  # silently
    assert not cache_files(tmp_path, "*.tmp")


@needs_onednn
def test_an_unwritable_cache_folder_decides_without_caching(calibration, monkeypatch, tmp_path, caplog):
    """Here the cache "folder" is a file, so nothing can be written under it (as root too): the process measures,
    decides, keeps its timings for later rollouts, and says once that they are not cached."""
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-folder"))
    monkeypatch.setattr(rule, "_UNCACHED_WARNED", [])
    model = llama()
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        assert decode_plan(model, rows=4, steps=16).groups == set(GROUPS)
        assert decode_plan(model, rows=4, steps=16).groups == set(GROUPS)
        pass_plan(model, torch.zeros(1, 32), 4 * rule.PASS_ROWS)
    assert len(calibration.calls) == 2  # decode and pass, once each
    assert len([record for record in caplog.records if "cannot cache" in record.getMessage()]) == 1


@needs_onednn
def test_a_measurement_that_does_not_repeat_keeps_products_plain_and_is_remembered(calibration, tmp_path):
    """On a busy machine the readings do not repeat (``measure`` gives None, ``MEASUREMENTS`` times): plain products,
    and cached as such, so that a later process (a resumed run) takes the same path and rounds the same, even where a
    quieter moment would have measured packing to pay."""
    model = llama()
    calibration.timings = None
    with torch.no_grad():
        assert decode_plan(model, rows=4, steps=64) is None
        assert decode_plan(model, rows=4, steps=64) is None
        assert len(calibration.calls) == rule.MEASUREMENTS and len(cache_files(tmp_path)) == 1  # tried, then decided
        rule.forget()  # a new process, on a quiet machine
        calibration.timings = PAYS
        assert decode_plan(model, rows=4, steps=64) is None
    assert len(calibration.calls) == rule.MEASUREMENTS
    lines = rule.describe()
    assert lines and all("not repeatable, plain" in line for line in lines)


@needs_onednn
def test_processes_racing_to_cache_all_take_the_first_ones_timings(calibration, tmp_path):
    """Two processes measure at once (DDP ranks starting together): the first to finish creates the file; the
    second, finding it there, takes its timings rather than its own, so both decide alike."""
    model = llama()
    with torch.no_grad():
        decode_plan(model, rows=4, steps=16)  # PAYS: every group packed
        [path] = cache_files(tmp_path)
        winner = path.read_text()
        path.unlink()
        rule.forget()
        calibration.timings = LOSES  # this process would pack nothing ...
        calibration.during = lambda: path.write_text(winner)  # ... but another one finished first
        assert decode_plan(model, rows=4, steps=16).groups == set(GROUPS)
    assert path.read_text() == winner
    assert cache_files(tmp_path) == [path] and not cache_files(tmp_path, "*.tmp")  # no temporary file left


@needs_onednn
def test_a_process_waits_for_the_one_measuring_and_takes_its_timings(calibration, tmp_path):
    """DDP ranks reach their first rollout together: one measures while holding the cache folder's lock, the
    others wait for it (leaving it the cores) and then read its file instead of measuring."""
    fcntl = pytest.importorskip("fcntl")
    model = llama()
    with torch.no_grad():
        decode_plan(model, rows=4, steps=16)
    [path] = cache_files(tmp_path)
    first = path.read_text()
    path.unlink()
    rule.forget()
    calibration.timings = LOSES
    with open(path.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process is measuring
        plans: list = []

        @torch.no_grad()  # grad mode is per thread
        def rank() -> None:
            plans.append(decode_plan(model, rows=4, steps=16))

        waiting = threading.Thread(target=rank)
        waiting.start()
        waiting.join(timeout=0.3)
        assert waiting.is_alive() and not plans  # waiting for the lock
        path.write_text(first)  # the other process's timings, written before it lets go
    waiting.join(timeout=10)
    assert plans[0].groups == set(GROUPS) and len(calibration.calls) == 1  # read, not measured


@needs_onednn
def test_a_resumed_run_takes_the_first_ones_cached_path_and_equals_the_uninterrupted_run(
    calibration, monkeypatch, tmp_path
):
    """``tests/runs/test_resume.py``'s recipe with its decoding packed (injected timings): 3 rounds, then a
    resumed run of 3 more (each a new process: ``forget``), equal 6 rounds tensor for tensor. The first run
    measured once; the resumed one read its file, though a new measurement would now decide otherwise."""
    from test_resume import assert_same_run, fit

    products = []
    real = lean_forward.packed_linear
    monkeypatch.setattr(lean_forward, "packed_linear", lambda *args: products.append(1) or real(*args))
    uninterrupted, _, recorder = fit(tmp_path / "six", 6)
    assert products  # the decoding steps multiplied by packed weights
    rule.forget()
    _, _, first = fit(tmp_path / "resumed", 3)
    rule.forget()
    calibration.timings = LOSES
    module, _, second = fit(tmp_path / "resumed", 6, ckpt_path="last")
    assert_same_run((uninterrupted, recorder), module, [first, second])
    assert len(calibration.calls) == 1


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_measure_times_every_group_plain_packed_and_reordered_without_touching_the_runs_random_state(monkeypatch, bias):
    """``measure`` with a scripted clock (no timing): it runs each group's products (the parts one by one, the
    stacked packed product, the reorder) in alternated rounds, stops once each minimum has repeated, gives None
    where readings never repeat, and draws its inputs from a generator of its own."""
    model = llama()
    if bias:  # Qwen2-like q, k, v biases; o and the MLP without
        for name in ("q_proj", "k_proj", "v_proj"):
            linear = getattr(model.model.layers[0].self_attn, name)
            linear.bias = torch.nn.Parameter(torch.randn(linear.out_features))
    groups = rule.product_groups(model.model.layers[0])
    readings = iter([])

    def seconds(fn, repeat):
        fn()  # the product runs; its time is the script's
        return next(readings)

    monkeypatch.setattr(rule, "_seconds", seconds)
    state = torch.get_rng_state()
    # 2 warm-up readings per group, then 3 (plain, packed, reorder) a group a round: the same value every time
    readings = iter([1e-3] * (2 * 4 + 3 * 4 * rule.MIN_ROUNDS))
    timings = rule.measure(groups, rows=8)
    assert timings == {name: Timing(1e-3, 1e-3, 1e-3) for name in GROUPS}
    assert next(readings, None) is None  # stopped after MIN_ROUNDS: every minimum repeated
    # Readings that never come within REPEATABLE of each other: MAX_ROUNDS, then nothing decided
    noisy = [1e-3 * 1.5**i for i in range(3 * 4 * rule.MAX_ROUNDS)]
    readings = iter([1e-3] * 8 + noisy)
    assert rule.measure(groups, rows=8) is None
    assert torch.equal(torch.get_rng_state(), state)


@needs_onednn
@pytest.mark.parametrize("precision", ["bf16-autocast", "fp16-autocast", "bf16-weights"])
def test_no_precision_but_float32_packs_and_decoding_gives_the_model_logits(calibration, precision):
    """Issue 50 item 9: under ``bf16-mixed`` on CPU the decoder packed weights of ≥ 2^16 elements and the packed
    float32 product then refused the bfloat16 inputs autocast gave it (``RuntimeError: could not create a
    primitive descriptor``). Under autocast and in bfloat16 nothing packs, whatever the timings say: decoding
    steps give the full forward's logits, and a large pass the plain pass's values bit for bit."""
    model = llama(hidden=256, intermediate=512, layers=1)  # o: 256 × 256 = 2^16 elements
    dtype = torch.float16 if precision == "fp16-autocast" else torch.bfloat16
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    prompt_ids = torch.randint(1, 40, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=precision != "bf16-weights"):
        decoder, logits = decode(model, prompt_ids, new_tokens=4)
        assert all(p.packed is None for layer in decoder.layers for p in (layer.o, layer.down))
        assert all(layer.qkv is None and layer.gate_up is None for layer in decoder.layers)
        ids = torch.cat([prompt_ids.repeat_interleave(2, 0), decoded_tokens(4)[:, None].expand(4, 3)], 1)
        expected = model(input_ids=ids).logits[:, prompt_ids.size(1) - 1 :]
        completions = torch.randint(1, 40, (16, 40), generator=torch.Generator().manual_seed(4))
        prompts = torch.randint(1, 40, (16, 4), generator=torch.Generator().manual_seed(5))
        packed_pass = shared_prompt_hidden(model, prompts, torch.ones_like(prompts), completions)
    assert calibration.calls == []  # nothing even measured
    assert logits.dtype == dtype
    tolerance = 4 * 2**-8 * expected.float().abs().max().item()  # as test_lean's bfloat16 test allows
    torch.testing.assert_close(logits.float(), expected.float(), atol=tolerance, rtol=0)
    rule.forget()
    with pytest.MonkeyPatch.context() as off, torch.no_grad():
        off.setenv(rule.SWITCH, "off")
        with torch.autocast("cpu", dtype=dtype, enabled=precision != "bf16-weights"):
            plain_pass = shared_prompt_hidden(model, prompts, torch.ones_like(prompts), completions)
    assert torch.equal(packed_pass, plain_pass)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 6, 64, 512, 1136])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_f_linear_at_the_shapes_each_path_takes(rows, bias):
    """Decoding steps multiply ``[N, 1, H]`` by stacked q/k/v (and gate/up) weights packed for N rows; a pass
    ``[B, S, H]`` with B × S ≥ ``PASS_ROWS`` by weights packed for B × S rows."""
    generator = torch.Generator().manual_seed(rows)
    for out_features, in_features in [(32 + 2 * 16, 32), (2 * 48, 32), (32, 48)]:
        weight = torch.randn(out_features, in_features, generator=generator) * 0.2
        b = torch.randn(out_features, generator=generator) if bias else None
        shape = (rows, 1, in_features) if rows < rule.PASS_ROWS else (rows // 16, 16, in_features)
        x = torch.randn(shape, generator=generator)
        packed = cpu_weight_packer(rows)(weight)
        assert packed is not None
        torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, weight, b), **F32)
