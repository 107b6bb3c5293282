"""The agent gateway at its seams: clients that give up, concurrent calls of one session, malformed requests.

- A client that times out closes its connection and (the ``openai`` client, by default) sends the request again:
  the first request's completion is no longer anyone's, so it is not recorded (no row trains on a call the agent
  never saw); it is counted (``agent/abandoned_calls``).
- ``max_calls`` holds for calls of one session that arrive together (one batch of the main thread).
- A malformed or negative ``Content-Length`` is answered (401 without the token, else 400), never a dead handler.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import threading
import time

import openai
from test_agent_gateway import calc, gateway_server, post, run, serve_while  # noqa: F401 - fixtures by name

from grpo_lightning.integrations.agents.gateway import Gateway


def raw_request(gateway: Gateway, path: str, headers: dict[str, str], body: bytes = b"") -> socket.socket:
    """A POST sent on a plain socket (headers as given, nothing added): the socket, for the answer or to close."""
    host, port = gateway.address
    sock = socket.create_connection((host, port), timeout=10)
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    sock.sendall("\r\n".join(lines).encode() + body)
    return sock


def status_of(sock: socket.socket) -> int:
    """The HTTP status the gateway answered on ``sock`` (fails when it closed the connection without one)."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def wait_queued(gateway: Gateway, count: int) -> None:
    deadline = time.monotonic() + 10
    while gateway.requests.qsize() < count:
        assert time.monotonic() < deadline, f"{gateway.requests.qsize()} of {count} requests queued"
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------- abandoned calls
def completion_request(gateway: Gateway, session) -> socket.socket:
    body = json.dumps({"prompt": "12*34=", "max_tokens": 3}).encode()
    headers = {"Authorization": f"Bearer {gateway.token}", "Content-Type": "application/json"}
    path = f"/s/{session.id}/v1/completions"
    return raw_request(gateway, path, {**headers, "Content-Length": str(len(body))}, body)


def test_a_request_whose_client_left_before_it_is_served_is_counted_not_generated(gateway_server):  # noqa: F811 - the fixture
    gateway, server = gateway_server
    session = gateway.open_session()
    sock = completion_request(gateway, session)
    wait_queued(gateway, 1)
    sock.close()  # the client gave up while the request waited in the queue
    time.sleep(0.05)
    server.serve(gateway.next_requests(1.0))
    assert session.calls == [] and server.abandoned == 1 and server.generate_calls == 0


def test_a_completion_whose_client_left_while_it_generated_is_not_recorded(gateway_server):  # noqa: F811 - the fixture
    gateway, server = gateway_server
    session = gateway.open_session()
    sock = completion_request(gateway, session)
    generate = server.engine.generate

    def leaving_generate(*args, **kwargs):  # the client times out while the engine draws the completion
        sock.close()
        time.sleep(0.05)
        return generate(*args, **kwargs)

    server.engine = type("Leaving", (), {"generate": staticmethod(leaving_generate)})()
    wait_queued(gateway, 1)
    server.serve(gateway.next_requests(1.0))
    assert session.calls == [] and server.abandoned == 1 and server.served == 0


class SlowFirstBatch:
    """An engine whose first ``generate`` takes ``delay`` seconds (a cold start), then as fast as the engine."""

    def __init__(self, engine, delay):
        self.engine, self.delay, self.calls = engine, delay, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.delay)
        return self.engine.generate(*args, **kwargs)


def test_a_client_that_times_out_and_retries_makes_one_call_and_one_row(calc):  # noqa: F811 - the fixture
    _, tokenizer, engine = calc
    seen = []

    def impatient_agent(base_url, api_key, row):  # the openai client's own retries, on a short timeout
        model = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=1.0, max_retries=3)
        seen.append(model.completions.create(model="p", prompt=row["prompt"], max_tokens=4).choices[0].text)
        return 1.0

    batch = run(SlowFirstBatch(engine, delay=2.5), tokenizer, impatient_agent, group=1)
    assert len(seen) == 2  # each agent got its answer, from a later request
    assert batch.agent_log["calls_per_session"] == 1 and batch.agent_log["rows_per_session"] == 1 and len(batch) == 2
    assert batch.agent_log["abandoned_calls"] >= 2  # the first batch: both of its clients had left
    assert sorted(batch.completions) == sorted(seen)  # the rows are the answers the agents saw


# --------------------------------------------------------------------------------------------- max_calls
def test_max_calls_holds_for_calls_of_one_session_that_arrive_together(gateway_server):  # noqa: F811 - the fixture
    gateway, server = gateway_server  # max_calls = 2
    session = gateway.open_session()
    url = gateway.base_url(session) + "/completions"
    statuses = []
    threads = [
        threading.Thread(target=lambda: statuses.append(post(url, {"prompt": "1=", "max_tokens": 2}, gateway.token)[0]))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    wait_queued(gateway, 4)  # all four in one batch
    while any(thread.is_alive() for thread in threads):
        server.serve(gateway.next_requests(0.01))
    assert sorted(statuses) == [200, 200, 429, 429] and len(session.calls) == 2 and session.refused == 2


# -------------------------------------------------------------------------------------- malformed requests
def test_a_malformed_content_length_is_answered_and_counted(gateway_server, caplog):  # noqa: F811 - the fixture
    gateway, server = gateway_server
    session = gateway.open_session()
    path = f"/s/{session.id}/v1/completions"
    token = {"Authorization": f"Bearer {gateway.token}"}
    with caplog.at_level(logging.WARNING):
        assert status_of(raw_request(gateway, path, {"Content-Length": "abc"})) == 401  # no token: refused first
        assert gateway.refused == 1
        assert status_of(raw_request(gateway, path, {**token, "Content-Length": "abc"})) == 400
        assert status_of(raw_request(gateway, path, {**token, "Content-Length": "-5"})) == 400  # not read to EOF
        assert status_of(raw_request(gateway, path, {**token, "Transfer-Encoding": "chunked"})) == 411
    assert server.bad_requests == 3 and session.calls == [] and gateway.requests.empty()
    assert not caplog.records  # answered, no traceback


def test_a_fault_inside_the_gateway_is_answered_and_logged_in_one_line(gateway_server, caplog, capsys):  # noqa: F811 - the fixture
    gateway, _ = gateway_server
    session = gateway.open_session()

    def broken_check(path, authorization):
        raise KeyError("something the gateway did not expect")

    gateway.check = broken_check
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.integrations.agents.gateway"):
        status, answer = post(gateway.base_url(session) + "/completions", {"prompt": "1="}, gateway.token)
    assert status == 500 and "KeyError" in answer["error"]["message"]
    assert [r.getMessage().count("\n") for r in caplog.records] == [0] and "Traceback" not in capsys.readouterr().err
    assert gateway.refused == 1


def test_a_malformed_field_is_answered_400_and_the_round_goes_on(gateway_server):  # noqa: F811 - the fixture
    gateway, server = gateway_server
    session = gateway.open_session()
    url = gateway.base_url(session) + "/completions"
    for stop in (5, True, 1.5):  # was a TypeError on the round's thread: the whole run stopped
        status, answer = serve_while(server, lambda s=stop: post(url, {"prompt": "1=", "stop": s}, gateway.token))
        assert status == 400 and "stop must be" in answer["error"]["message"]
    assert serve_while(server, lambda: post(url, {"prompt": "1=", "max_tokens": 2}, gateway.token))[0] == 200


def test_a_connection_reset_mid_request_is_one_quiet_line_not_a_traceback(gateway_server, capsys):  # noqa: F811
    gateway, _ = gateway_server
    host, port = gateway.address
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(b"POST /s/")  # half a request line, then a reset (linger 0): the handler's read fails
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    time.sleep(0.3)
    assert "Traceback" not in capsys.readouterr().err
    session = gateway.open_session()  # the gateway goes on
    assert post(gateway.base_url(session) + "/nothing", {}, gateway.token)[0] == 404
