"""Tool calling through the chat templates these models publish, rendered as the server renders them.

The templates under ``templates/`` are copied unchanged from their published sources:

* ``qwen2.5-instruct.jinja``: the ``chat_template`` of Qwen/Qwen2.5-7B-Instruct's
  ``tokenizer_config.json`` on the Hugging Face Hub (the same template ships with every
  Qwen2.5-Instruct size);
* ``llama3.1-instruct-json.jinja``: vllm-project/vllm, ``examples/tool_chat_template_llama3.1_json.jinja``
  (Meta's Llama 3.1 Instruct template for JSON tool calls, tools in the first user message);
* ``mistral-instruct-v0.3.jinja``: vllm-project/vllm, ``examples/tool_chat_template_mistral_official.jinja``
  (the template of mistralai/Mistral-7B-Instruct-v0.3, ``[AVAILABLE_TOOLS]`` / ``[TOOL_CALLS]``).

Each renders a conversation with tools, an earlier call and its result through
the sandboxed renderer of ``ifb_plugins.common.chat.tokenizer``; the prompt must equal
what transformers renders from the same template, carry the tool definitions,
and the call the template writes into the history (the way the model was
trained to emit it) must parse back with the format detected from the template.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from ifb.server import tools
from ifb.server.tools import HERMES, LLAMA3, MISTRAL, parse
from ifb_plugins.common.chat.prompt import render_chat
from ifb_plugins.common.chat.tokenizer import TextTokenizer

from tests.core.server.test_tools import TIME, WEATHER

TEMPLATES = Path(__file__).parent / "templates"
BOS, EOS = "<s>", "</s>"
CALL_ID = "a1B2c3D4e"  # Mistral's templates take only ids of 9 letters and digits

#: (template file, format, the text between which the history's call is written)
CASES = [
    ("qwen2.5-instruct.jinja", HERMES, ("<|im_start|>assistant", "<|im_end|>")),
    ("llama3.1-instruct-json.jinja", LLAMA3, ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")),
    ("mistral-instruct-v0.3.jinja", MISTRAL, ("[/INST]", EOS)),
]


def tokenizer_for(template: str) -> TextTokenizer:
    vocab = {BOS: 0, EOS: 1, "[UNK]": 2}
    return TextTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), chat_template=template,
                         eos_token_ids=[1], bos_token_id=0)


def history() -> list[dict]:
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": '{"sky": "rain"}'},
    ]


def json_objects(text: str) -> list:
    """Every JSON object that starts somewhere in ``text``."""
    decoder, found = json.JSONDecoder(), []
    for at in (m.start() for m in re.finditer(r"\{", text)):
        try:
            found.append(decoder.raw_decode(text, at)[0])
        except ValueError:
            pass
    return found


def undated(prompt: str) -> str:
    return re.sub(r"Today Date: [^\n]*", "Today Date: -", prompt)  # Llama's date comes from the clock


@pytest.mark.parametrize(("name", "fmt", "around"), CASES)
def test_a_published_template_renders_tools_and_its_calls_parse_back(name, fmt, around):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (TEMPLATES / name).read_text()
    assert tools.call_format(template) == fmt
    plan = tools.plan([WEATHER, TIME], "auto", None, template)
    assert plan is not None and plan.in_template and plan.fmt == fmt
    messages = tools.render_messages(history(), plan)
    prompt = render_chat(tokenizer_for(template), messages, tools=list(plan.tools))

    reference, _ = render_jinja_template([messages], tools=list(plan.tools), chat_template=template,
                                         add_generation_prompt=True, bos_token=BOS, eos_token=EOS)
    assert undated(prompt) == undated(reference[0])
    assert all(tool in json_objects(prompt) for tool in plan.tools)  # each definition, whole
    assert "Weather in a city" in prompt and "rain" in prompt

    # the earlier call, as the template writes it, is what this model emits: it must parse back
    start = prompt.index(around[0], prompt.index("What is the weather in Paris?")) + len(around[0])
    written = prompt[start:prompt.index(around[1], start)]
    content, calls = parse(written, fmt)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_the_model_s_own_call_text_parses_in_the_detected_format():
    """Answers written the way each model family emits calls (its model card's examples)."""
    answers = {
        "qwen2.5-instruct.jinja": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "llama3.1-instruct-json.jinja": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "mistral-instruct-v0.3.jinja": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    }
    for name, answer in answers.items():
        fmt = tools.call_format((TEMPLATES / name).read_text())
        content, calls = parse(answer, fmt)
        assert content is None and calls[-1].name == "get_weather"
        assert json.loads(calls[-1].arguments) == {"city": "Oslo"}
        if fmt == MISTRAL:  # an id this model's template takes back in the next turn
            assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[-1].id)


def test_a_template_s_own_rule_on_history_is_a_clear_request_error():
    from ifb.params import InvalidRequest

    template = (TEMPLATES / "mistral-instruct-v0.3.jinja").read_text()
    plan = tools.plan([WEATHER], "auto", None, template)
    openai_ids = [dict(m, tool_call_id="call_0123456789") if m["role"] == "tool" else m for m in history()]
    openai_ids[2] = dict(openai_ids[2], tool_calls=[dict(openai_ids[2]["tool_calls"][0], id="call_0123456789")])
    with pytest.raises(InvalidRequest, match="Tool call IDs should be alphanumeric strings with length 9"):
        render_chat(tokenizer_for(template), tools.render_messages(openai_ids, plan), tools=list(plan.tools))
