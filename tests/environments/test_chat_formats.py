"""Tool calls in the chat template's own format, with the real Qwen2.5 and Llama-3.1 templates
(``tests/data/chat_templates``) on character tokenizers that have those families' special tokens (nothing is
downloaded): the family is detected by what the template writes, a call is parsed and answered, the observation is
token for token the template's rendering, a cut observation keeps its frame, and other families are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_multiturn import ScriptedEngine

from grpo_lightning.config import ConfigError
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.integrations.environments import ToolEnvironment
from grpo_lightning.integrations.environments.multiturn import generate_trajectories
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rollout.prompts import PromptEncoder

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}
MISTRAL_LIKE = (  # Mistral's way: [TOOL_CALLS] [{...}] and [TOOL_RESULTS]
    "{%- for m in messages %}{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    '{%- elif m.tool_calls %}[TOOL_CALLS] [{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{%- endfor %}]</s>'
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}"
)
NO_TOOLS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def qwen_tokenizer():
    """Qwen2.5-Instruct's special tokens, and ``<tool_call>`` tags as added, not special, tokens (as Qwen2.5 has
    them: kept in the decoded text the environment parses)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (TEMPLATES / "qwen2.5-instruct.jinja").read_text()
    return tokenizer


def llama_tokenizer():
    """Llama-3.1-Instruct's special tokens; EOS ``<|eot_id|>``."""
    tokenizer = build_char_tokenizer()
    names = ["<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
    names.append("<|python_tag|>")
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens": names})
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = (TEMPLATES / "llama-3.1-instruct.jinja").read_text()
    return tokenizer


def set_up(tokenizer, format: str = "auto", **kwargs) -> ToolEnvironment:
    kwargs.setdefault("max_observation_tokens", 128)  # a character per token: Qwen's frame alone is 54 tokens
    env = ToolEnvironment(tools=["calculator", f"{__name__}:long_lookup"], format=format, **kwargs)
    env.setup(tokenizer)
    return env


def long_lookup(argument: str) -> str:
    return "0123456789" * 30


def qwen_policy(context: str) -> str:
    if context.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"):
        return context.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0][:3] + "<|im_end|>"
    tool, argument = ("long_lookup", "q") if "long" in context else ("calculator", "12*34")
    name = "query" if tool == "long_lookup" else "expression"
    return f'<tool_call>\n{{"name": "{tool}", "arguments": {{"{name}": "{argument}"}}}}\n</tool_call>and babble'


def llama_policy(end: str):
    def policy(context: str) -> str:
        if "ipython<|end_header_id|>" in context:  # the result is there: answer with it
            return context.rsplit('ipython<|end_header_id|>\n\n"', 1)[1][:3] + "<|eot_id|>"
        tool = "long_lookup" if "long" in context else "calculator"
        return f'{{"name": "{tool}", "parameters": {{"expression": "12*34"}}}}{end}'

    return policy


def rollout(tokenizer, policy, env, ends: tuple[str, ...], honour_stops=False, prompt="12*34="):
    engine = ScriptedEngine(tokenizer, policy, honour_stops=honour_stops)
    engine.eos_token_ids = tuple(tokenizer.convert_tokens_to_ids(end) for end in ends)
    encoder = PromptEncoder(tokenizer, use_chat_template=True)
    params = SamplingParams(group_size=2, max_new_tokens=300)
    out = generate_trajectories({"prompt": [prompt]}, engine=engine, encoder=encoder, environment=env, params=params)
    c = out.completions
    n = int(c.completion_mask[0].sum())
    prompt_ids = c.prompt_ids[0][c.prompt_mask[0].bool()].tolist()
    ids, action = c.completion_ids[0, :n].tolist(), out.action_mask[0, :n].tolist()
    return out, prompt_ids + ids, tokenizer.decode([i for i, a in zip(ids, action) if a == 0])


def conversation(result: str, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": "12*34="},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]


# -------------------------------------------------------------------------------------------------- detection
def test_each_family_is_detected_by_what_its_template_writes():
    qwen, llama = set_up(qwen_tokenizer()), set_up(llama_tokenizer())
    assert qwen.stop_texts == ("</tool_call>",)
    assert llama.stop_texts == ("<|eot_id|>", "<|eom_id|>")  # a Llama turn is the JSON call, ended by either
    assert set_up(llama_tokenizer(), format="chat_template").stop_texts == ("<|eot_id|>", "<|eom_id|>")
    call = '{"name": "calculator", "parameters": {"expression": "12*34"}}'
    for turn in (call, "<|python_tag|>" + call, f"  {call}\n"):
        assert llama.step(turn).observation.startswith('<|start_header_id|>ipython<|end_header_id|>\n\n"408"')
    assert llama.step("The answer is 408.").done  # prose: the final answer
    assert "error: a call is" in llama.step('{"name": "calculator", "parameters": ').observation


def test_a_template_without_tools_means_tags_for_auto_and_is_refused_for_chat_template():
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = NO_TOOLS + "{# tool_calls are not rendered #}"  # mentions tool_calls, writes none
    assert set_up(tokenizer).stop_texts == ("</tool>",)
    with pytest.raises(ConfigError, match="format: the tokenizer's chat template does not write tool calls"):
        set_up(tokenizer, format="chat_template")


def test_a_mistral_like_template_is_refused_in_one_line():
    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = MISTRAL_LIKE
    for format in ("auto", "chat_template"):
        with pytest.raises(ConfigError) as refused:
            set_up(tokenizer, format=format)
        message = str(refused.value)
        assert "Mistral-style [TOOL_CALLS]" in message and "use format: tag, or a Hermes/Qwen" in message
        assert "\n" not in message and message.startswith("data.environment.init_args.format")


# ----------------------------------------------------------------------------------------------- rollouts
@pytest.mark.parametrize("honour_stops", [False, True])
def test_a_qwen_trajectory_is_the_templates_conversation_token_for_token(honour_stops):
    tokenizer = qwen_tokenizer()
    env = set_up(tokenizer)
    out, ids, observed = rollout(tokenizer, qwen_policy, env, ("<|im_end|>", "<|endoftext|>"), honour_stops)
    # The prompt, the call (cut at </tool_call>), the observation and the answer: exactly what the template writes
    # for that conversation, ending at the policy's <|im_end|>.
    expected = tokenizer.apply_chat_template(conversation("408", "408"), tokenize=False).removesuffix("\n")
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert observed == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.final_texts == ["408"] * 2 and out.stats["tool_calls"] == [1.0] * 2
    assert not out.completions.truncated.any()


@pytest.mark.parametrize("end", ["<|eot_id|>", "<|eom_id|>"])
def test_a_llama_trajectory_is_the_templates_conversation_token_for_token(end):
    tokenizer = llama_tokenizer()
    env = set_up(tokenizer)
    ends = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")  # Llama-3.1-Instruct's generation_config EOS ids
    out, ids, observed = rollout(tokenizer, llama_policy(end), env, ends)
    # The template writes the result JSON-encoded ("408"); the call's end token is the one the policy drew.
    expected = tokenizer.apply_chat_template(conversation("408", "408"), tokenize=False)
    expected = expected.replace('"12*34"}}<|eot_id|>', '"12*34"}}' + end)
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert observed == '<|start_header_id|>ipython<|end_header_id|>\n\n"408"<|eot_id|>' + header
    assert out.final_texts == ["408"] * 2 and out.stats["tool_calls"] == [1.0] * 2
    assert not out.completions.truncated.any()


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_a_cut_observation_keeps_the_templates_frame_and_says_so(family):
    qwen = family == "qwen"
    tokenizer, policy = (qwen_tokenizer(), qwen_policy) if qwen else (llama_tokenizer(), llama_policy("<|eot_id|>"))
    env = set_up(tokenizer, max_observation_tokens=150, max_result_chars=1000)
    ends = ("<|im_end|>",) if qwen else ("<|eot_id|>", "<|eom_id|>")
    out, _, observed = rollout(tokenizer, policy, env, ends, prompt="long=")
    frame = env.format.result("@@").split("@@")  # what the template writes before and after a result
    assert observed.startswith(frame[0] + "0123") and observed.endswith(frame[1])
    assert "... [cut: " in observed and len(tokenizer(observed, add_special_tokens=False)["input_ids"]) <= 150
    assert out.stats["turns"] == [2.0] * 2 and not out.completions.truncated.any()
