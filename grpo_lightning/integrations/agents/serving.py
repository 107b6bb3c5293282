"""The gateway's requests, served on the round's main thread: to token ids, through the engine, back as OpenAI JSON.

The engine, the tokenizer and torch's grad mode belong to the thread that runs the round, so the HTTP handlers only
queue requests; ``CallServer.serve`` takes every queued request at once and generates them together (one
``engine.generate`` per set of requests with the same token limit and stop texts), so concurrent agents share a
batch.

What a request becomes:

- ``/chat/completions``: ``messages`` (and ``tools``) rendered by the tokenizer's chat template with the generation
  prompt (``data.chat_template_kwargs`` applied; a conversation ending with an assistant message is continued), then
  tokenized: the agent's text is **re-tokenized** here, every call. ``integrations/agents/calls.py``'s extension check
  then decides whether the call continues a training row.
- ``/completions``: ``prompt`` as text (tokenized, special tokens added unless ``add_special_tokens: false``) or as
  token ids (used as they are: token-exact).

Fixed by the run, whatever the request says: the temperature, top-p and top-k (``data.sampling``: the loss models
that distribution) and greedy decoding in evaluation; one completion (``n`` must be 1), no streaming. Honoured:
``max_tokens`` / ``max_completion_tokens`` (capped by the environment's ``max_call_tokens``, else
``data.sampling.max_new_tokens``, and by the context), ``stop`` (the completion is cut after the token that
completes a stop text, ``integrations/environments/stops.py``; the text returned ends before it, as OpenAI's does,
unless ``include_stop_str_in_output: true``), ``logprobs`` (the drawn tokens' log-probs, no alternatives),
``return_token_ids`` (vLLM's: ``prompt_token_ids`` and ``choices[0].token_ids``). Tool calls are not parsed: the
model's text is the message's ``content``.

A session's ``max_calls`` counts the calls recorded and those admitted to generation in the same batch, so calls
of one session that arrive together cannot pass it. A request whose client has gone (it timed out) is neither
generated nor recorded, checked before generating and again before recording, and counted (``abandoned``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from grpo_lightning.engines.base import RolloutEngine, SamplingParams
from grpo_lightning.integrations.agents.calls import Call
from grpo_lightning.integrations.agents.gateway import Gateway, PendingRequest, error
from grpo_lightning.integrations.environments import stops


class BadRequest(ValueError):
    """A request the gateway cannot serve (answered 400 with this message)."""


@dataclass
class Prepared:
    """A request as token ids and limits, ready to generate."""

    request: PendingRequest
    prompt_ids: list[int]
    limit: int
    stop_texts: tuple[str, ...]
    include_stop: bool


class CallServer:
    """Serves the gateway's queued requests with the round's engine and sampling settings (see the module)."""

    def __init__(
        self,
        gateway: Gateway,
        *,
        engine: RolloutEngine,
        tokenizer: Any,
        params: SamplingParams,
        generator: torch.Generator | None,
        max_call_tokens: int,
        max_calls: int,
        context_limit: int | None,
        template_kwargs: dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.gateway, self.engine, self.tokenizer, self.params = gateway, engine, tokenizer, params
        self.generator, self.max_call_tokens, self.max_calls = generator, max_call_tokens, max_calls
        self.context_limit, self.template_kwargs = context_limit, dict(template_kwargs or {})
        self.device = device
        config = engine.policy_config
        self.vocab_size = getattr(config, "vocab_size", None) or len(tokenizer)
        self.ends = tuple(engine.eos_token_ids or ()) or (tokenizer.eos_token_id,)
        self.engine_s, self.generate_calls, self.served, self.abandoned = 0.0, 0, 0, 0

    @property
    def bad_requests(self) -> int:
        """Requests answered 400: unreadable ones (the gateway's) and those that cannot be served (``prepare``)."""
        return self.gateway.bad_requests

    def serve(self, requests: list[PendingRequest]) -> None:
        """Answer ``requests``: generate those that pass their checks together, record each call in its session."""
        groups: dict[tuple[int, tuple[str, ...]], list[Prepared]] = {}
        taken: dict[str, int] = {}  # per session: calls recorded + calls of this batch admitted so far
        for request in requests:
            session = request.session
            if request.client_gone():
                self.abandon(request)
                continue
            if not session.open:
                self.gateway.refuse()
                request.answer(403, error("this session has ended", code="session_ended"))
                continue
            calls = taken.get(session.id, len(session.calls))
            if calls >= self.max_calls:
                session.refused += 1
                request.answer(429, error(f"this session made its max_calls = {self.max_calls} calls"))
                continue
            try:
                prepared = self.prepare(request)
            except BadRequest as err:
                self.gateway.bad_request()
                request.answer(400, error(str(err)))
                continue
            taken[session.id] = calls + 1
            groups.setdefault((prepared.limit, prepared.stop_texts), []).append(prepared)
        for (limit, stop_texts), group in groups.items():
            self.generate(group, limit, stop_texts)

    # -------------------------------------------------------------------------------------------- prompt
    def prepare(self, request: PendingRequest) -> Prepared:
        """The request's prompt ids, token limit and stop texts; ``BadRequest`` for what cannot be served."""
        body = request.body
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1: the gateway samples one completion per request")
        if body.get("stream"):
            raise BadRequest("stream is not supported by the agent gateway")
        ids = self.chat_ids(body) if request.endpoint == "chat" else self.completion_prompt_ids(body)
        if not ids:
            raise BadRequest("the prompt is empty")
        if any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise BadRequest(f"the prompt holds a token id outside the vocabulary of {self.vocab_size}")
        requested = body.get("max_completion_tokens", body.get("max_tokens"))
        if requested is not None and (not isinstance(requested, int) or requested < 1):
            raise BadRequest(f"max_tokens must be a positive integer (got {requested!r})")
        limit = min(requested or self.max_call_tokens, self.max_call_tokens)
        if self.context_limit is not None:
            room = self.context_limit - len(ids)
            if room < 1:
                raise BadRequest(f"the prompt's {len(ids)} tokens fill the context of {self.context_limit} tokens")
            limit = min(limit, room)
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):  # a number: not a crash
            raise BadRequest("stop must be a string or a list of strings")
        return Prepared(request, ids, limit, tuple(s for s in stop if s), bool(body.get("include_stop_str_in_output")))

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """The chat template's rendering of ``messages`` (and ``tools``), tokenized."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("the policy's tokenizer has no chat template: use /v1/completions")
        messages = [plain_text_message(m) for m in messages]
        prefilled = messages[-1].get("role") == "assistant"  # continue the assistant's message
        tools = body.get("tools")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not prefilled,
                continue_final_message=prefilled,
                **self.template_kwargs,
                **({"tools": tools} if tools else {}),  # `if tools`: Llama's template writes its tool preamble for []
            )
        except Exception as err:  # the template's own complaint (a role it refuses, a missing field)
            raise BadRequest(f"the chat template cannot render these messages: {err}") from err
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def completion_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """``prompt`` as text (tokenized) or as token ids (as they are); one prompt per request."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return list(prompt)
        raise BadRequest("prompt must be one text or one list of token ids")

    # ---------------------------------------------------------------------------------------- generation
    def generate(self, group: list[Prepared], limit: int, stop_texts: tuple[str, ...]) -> None:
        """One engine call for ``group``; each completion cut at its stop text, recorded, answered."""
        pad = self.tokenizer.pad_token_id
        width = max(len(p.prompt_ids) for p in group)
        ids = torch.tensor([[pad] * (width - len(p.prompt_ids)) + p.prompt_ids for p in group])
        mask = torch.tensor([[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids) for p in group])
        params = self.params.with_(
            group_size=1,
            max_new_tokens=limit,
            min_new_tokens=0,
            stop_sequences=stops.stop_sequences(stop_texts, self.tokenizer),
        )
        start = time.perf_counter()
        out = self.engine.generate(
            ids.to(self.device), mask.to(self.device), params, generator=self.generator, return_logprobs=True
        )
        self.engine_s += time.perf_counter() - start
        self.generate_calls += 1
        lengths = out.completion_mask.sum(-1).tolist()
        tokens = out.completion_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        policy = out.policy_logprobs.tolist() if out.policy_logprobs is not None else None
        for i, prepared in enumerate(group):
            drawn = tokens[i][: min(lengths[i], limit)]
            drawn = drawn[: next((k + 1 for k, t in enumerate(drawn) if t in self.ends), len(drawn))]
            cut, found = stops.find_stop(drawn, stop_texts, self.tokenizer)
            drawn = drawn[:cut]
            ended = bool(drawn) and drawn[-1] in self.ends
            text = self.tokenizer.decode(drawn, skip_special_tokens=True)
            if found and not prepared.include_stop:  # OpenAI's: the text ends before the stop text
                text = text[: min((k for k in (text.find(s) for s in stop_texts) if k >= 0), default=len(text))]
            call = Call(
                prompt_ids=prepared.prompt_ids,
                completion_ids=drawn,
                logprobs=logprobs[i][: len(drawn)] if logprobs is not None else [0.0] * len(drawn),
                policy_logprobs=policy[i][: len(drawn)] if policy is not None else None,
                text=text,
                finish_reason="stop" if ended or found else "length",
                request=prepared.request.body,
            )
            self.answer(prepared, call)

    def abandon(self, request: PendingRequest) -> None:
        """``request``'s client has gone: no row, no answer, counted."""
        self.abandoned += 1
        request.abandon()

    def answer(self, prepared: Prepared, call: Call) -> None:
        request = prepared.request
        if request.client_gone():  # it timed out while its completion was drawn: the agent never sees it
            self.abandon(request)
            return
        if not self.gateway.record(request.session, call):  # ended while generating: no row, refused
            self.gateway.refuse()
            request.answer(403, error("this session has ended", code="session_ended"))
            return
        self.served += 1
        request.answer(200, response(request, call, self.tokenizer))


def plain_text_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with a list of text parts (``[{type: text, text}]``) joined into one string; other parts refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise BadRequest("only text message parts are supported")
    return {**message, "content": "".join(str(p.get("text", "")) for p in content)}


def response(request: PendingRequest, call: Call, tokenizer: Any) -> dict[str, Any]:
    """The OpenAI-shaped answer to ``request`` (chat or text completion)."""
    body, chat = request.body, request.endpoint == "chat"
    choice: dict[str, Any] = {"index": 0, "finish_reason": call.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": call.text}
    else:
        choice["text"] = call.text
    # chat: ``logprobs: true``; completions: ``logprobs: <int>`` (0 = the drawn tokens' only)
    wants = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None and body["logprobs"] is not False
    tokens = [tokenizer.decode([t]) for t in call.completion_ids] if wants else []
    if wants and chat:
        entries = zip(tokens, call.logprobs)
        choice["logprobs"] = {
            "content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in entries]
        }
    elif wants:
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": call.logprobs, "top_logprobs": None}
    payload: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": str(body.get("model") or "policy"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(call.prompt_ids),
            "completion_tokens": len(call.completion_ids),
            "total_tokens": len(call.prompt_ids) + len(call.completion_ids),
        },
    }
    if body.get("return_token_ids"):  # vLLM's extension: the ids themselves, for token-exact agents
        payload["prompt_token_ids"] = call.prompt_ids
        choice["token_ids"] = call.completion_ids
    return payload
