"""The ``vllm_server`` engine's settings and its HTTP client, without vLLM: a stand-in server (the standard
library's) that fails on cue. The engine against real ``vllm serve`` processes: ``test_vllm_server.py``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from vllm_servers import reply

from grpo_lightning.cli import user_error
from grpo_lightning.config import ConfigError
from grpo_lightning.engines import build_engine
from grpo_lightning.engines.http import ServerClient, ServerError
from grpo_lightning.integrations.vllm.server import VLLMServerEngine
from grpo_lightning.integrations.vllm.weight_transfer import clear_prefix_cache, finish_update


class StandIn(BaseHTTPRequestHandler):
    """Answers each request with the next planned (status, body); ``sleep`` delays an answer, ``late`` delays the
    answer it holds, ``drop`` closes the connection without one (a reply lost on the way)."""

    plan: list = []
    seen: list = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        StandIn.seen.append((self.path, None))
        self.answer()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        StandIn.seen.append((self.path, body))
        self.answer()

    def answer(self) -> None:
        status, answer = StandIn.plan.pop(0)
        if status == "drop":
            self.close_connection = True
            return
        if status == "sleep":
            threading.Event().wait(answer)
            status, answer = 200, {}
        if status == "late":  # (seconds, status, body)
            threading.Event().wait(answer[0])
            status, answer = answer[1:]
        reply(self, status, json.dumps(answer).encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stand_in():
    StandIn.plan, StandIn.seen = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def client(url: str, **settings) -> ServerClient:
    return ServerClient(url, **{"timeout_s": 5.0, "retries": 2, "backoff_s": 0.01, **settings})


def test_a_failing_request_is_retried_then_answered(stand_in):
    StandIn.plan = [(503, {"error": "busy"}), (500, {}), (200, {"ok": 1})]
    assert client(stand_in).post("/v1/completions", {"seed": 3}) == {"ok": 1}
    assert [body for _, body in StandIn.seen] == [{"seed": 3}] * 3  # the same request (same seed) each time


def test_bounded_retries_end_in_one_line_naming_the_server(stand_in):
    StandIn.plan = [(503, {"error": "busy"})] * 3
    with pytest.raises(
        ServerError, match=rf"^the vLLM server {stand_in} answered 503 \(busy\) on POST /x after 3 tries$"
    ):
        client(stand_in).post("/x")
    StandIn.plan = [("sleep", 1.0)] * 2
    with pytest.raises(ServerError, match=rf"^the vLLM server {stand_in} gave no answer within 0.2 s .* after 2 tries"):
        client(stand_in, timeout_s=0.2, retries=1).post("/slow")


def test_a_refusal_is_not_retried_and_keeps_the_servers_reason(stand_in):
    StandIn.plan = [(400, {"error": {"message": "Token id 5000 is out of vocabulary"}})]
    with pytest.raises(ServerError, match="refused POST /v1/completions: Token id 5000 is out of vocabulary") as err:
        client(stand_in).post("/v1/completions")
    assert err.value.status == 400 and len(StandIn.seen) == 1
    assert user_error(RuntimeError("wrapped")) is None and user_error(err.value) is err.value  # the CLI's one line


def test_a_server_that_is_down_is_named_after_the_retries_or_the_start_wait():
    from grpo_lightning.integrations.vllm.weight_transfer import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(ServerError, match=rf"^the vLLM server {url} is unreachable .* on GET /health after 3 tries$"):
        client(url).get("/health")
    with pytest.raises(ServerError, match=rf"^data.engine: the vLLM server {url} did not answer .* within 1 s"):
        client(url).wait_until_up(1.0)


def test_the_engine_is_chosen_by_name_and_refuses_bad_settings_in_one_line():
    engine = build_engine("vllm_server")
    assert isinstance(engine, VLLMServerEngine) and engine.remote and not engine.shares_weights
    assert engine.base_urls == ["http://127.0.0.1:8000"]
    for settings, message in [
        ({"base_urls": "localhost:8000"}, r"base_urls: give the servers as http://host:port"),
        ({"base_urls": []}, r"base_urls: give the servers"),
        ({"weight_transport": "tcp"}, r"weight_transport: 'tcp' is none of auto, nccl, gloo"),
        ({"push_timeout_s": 0}, r"push_timeout_s must be > 0"),
        ({"retries": -1}, r"retries must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=rf"^data.engine.init_args.{message}"):
            VLLMServerEngine(**settings)


# ------------------------------------------------------------------------------------------- ending a push
def test_a_lost_reply_to_finishing_a_push_is_not_a_failed_push(stand_in):
    """The first /finish_weight_update went through and its reply was lost: vLLM refuses the retry (no update is
    open any more), but the server reports the pushed version, so the push has finished."""
    server = client(stand_in)
    StandIn.plan = [("drop", None), (200, {"weight_version": "7"})]
    finish_update(server, "7", held_before="6")
    assert [path for path, _ in StandIn.seen] == ["/finish_weight_update", "/weight_info"]  # no second finish
    StandIn.seen = []
    refused = (500, {"error": "finish_weight_update called without a matching start_weight_update."})
    StandIn.plan = [("drop", None), (200, {"weight_version": "6"}), refused, (200, {"weight_version": "6"})]
    with pytest.raises(ServerError, match="answered 500 .*without a matching start_weight_update"):
        finish_update(client(stand_in, retries=1), "7", held_before="6")  # the server still holds 6: not finished
    StandIn.seen = []
    # The server held this version before the push (the same step pushed again): its version proves nothing.
    StandIn.plan = [("drop", None), refused, (200, {"weight_version": "7"})]
    with pytest.raises(ServerError):
        finish_update(client(stand_in, retries=1), "7", held_before="7")


def test_a_push_ends_only_once_the_prefix_cache_is_cleared(stand_in):
    StandIn.plan = [(200, {"success": False}), (200, {"success": True})]
    clear_prefix_cache(client(stand_in))
    assert [path for path, _ in StandIn.seen] == ["/reset_prefix_cache?reset_running_requests=true"] * 2
    StandIn.plan = [(200, {"success": False})] * 2
    with pytest.raises(ServerError, match=rf"^the vLLM server {stand_in} did not clear its prefix cache after 2 tries"):
        clear_prefix_cache(client(stand_in), attempts=2)


def test_a_server_that_fails_on_a_weight_ends_the_push_at_once_not_at_the_time_limit(stand_in, monkeypatch):
    """A server refusing a weight it is sent (vLLM: a name its model has no parameter for) never joins that
    weight's broadcast, which blocks over gloo until the group's time limit: the push must end on the server's own
    error at once, not after ``push_timeout_s`` (600 s by default)."""
    import time

    import torch

    from grpo_lightning.integrations.vllm.weight_transfer import WeightChannel

    blocked = threading.Event()
    channel = WeightChannel([client(stand_in)], transport="gloo", address="127.0.0.1", port=0, timeout_s=60.0)
    channel.group = object()  # formed: the broadcast below stands in for gloo's
    monkeypatch.setattr(channel, "_broadcast", lambda tensor: blocked.wait(60.0))  # the server never joins
    refused = (400, {"error": {"message": "There is no module or parameter named 'vision_tower.embeddings'"}})
    # /update_weights refuses while the first weight is being sent (the check before each weight has passed)
    StandIn.plan = [(200, {"weight_version": "3"}), (200, {}), ("late", (0.5, *refused))]
    weight = torch.zeros(2)
    started = time.monotonic()
    with pytest.raises(ServerError, match="no module or parameter named 'vision_tower.embeddings'"):
        channel.push([("vision_tower.embeddings.w", weight)], [("vision_tower.embeddings.w", weight.dtype, (2,))], 4)
    assert time.monotonic() - started < 10.0 and channel.group is None
    assert [path for path, _ in StandIn.seen] == ["/weight_info", "/start_weight_update", "/update_weights"]
    blocked.set()
