"""A gpt-oss GGUF with MXFP4 experts through ``ifb serve``, in the harmony format (test_harmony.py's
exchange, driven by the official ``openai`` client).

The tiny gpt-oss with the released chat template is converted by llama.cpp's converter and its
experts rewritten in MXFP4 (``tests.models.gpt_oss.mxfp4_experts``); the directory then takes those
experts' values (transformers' model holding the file's dequantized weights, saved again), its
output head is refitted to answer the two prompts on them, and it is converted and rewritten once
more: the second rewrite is lossless (asserted), so the served file's experts are MXFP4 and its head
answers. The server runs the experts on the native kernels' block matmuls (the default
quantization) and renders the prompts from the template the file carries.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.test_harmony import (ANSWER, ARGUMENTS, ASK, QUESTION, RESULT, THOUGHT_1, THOUGHT_2, WEATHER,
                                    _round_trip, completions)  # noqa: F401 (a fixture)
from tests.e2e.test_server import Server
from tests.models import llama_cpp
from tests.models.gpt_oss import fit_head_to_answer, mxfp4_experts, save_tiny_harmony_gpt_oss

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory, completions):
    from transformers import AutoTokenizer, GptOssForCausalLM

    from ifb_plugins.common.models.gpt_oss_gguf import read_gpt_oss_gguf

    root = tmp_path_factory.mktemp("gpt_oss_harmony_gguf")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        directory = save_tiny_harmony_gpt_oss(root / "hf", seed=3)
        llama_cpp.convert([(directory, root / "first-f32.gguf", "f32")])
        first = mxfp4_experts(root / "first-f32.gguf", root / "first-mxfp4.gguf")
        model = GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.load_state_dict(read_gpt_oss_gguf(first).state, strict=True)
        model.save_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        template_messages = [*QUESTION, {"role": "assistant", "thinking": THOUGHT_1, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
            {"role": "tool", "content": RESULT}]
        prompts = [tokenizer.apply_chat_template(m, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
                   for m in (QUESTION, template_messages)]
        (call_text, _), (final_text, _) = completions
        fit_head_to_answer(directory, list(zip(prompts, (call_text, final_text))))
        llama_cpp.convert([(directory, root / "oss-f32.gguf", "f32")])
        served = mxfp4_experts(root / "oss-f32.gguf", root / "oss-mxfp4.gguf")
        fitted = GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
        for name, tensor in read_gpt_oss_gguf(served).state.items():
            assert torch.equal(tensor, fitted[name]), name  # MXFP4's values written again in MXFP4: lossless
    finally:
        torch.set_num_threads(before)
    started = Server(tmp_path_factory.mktemp("logs") / "harmony_gguf.log", str(served), "--plugin", "text",
                     "--enable-in-flight-batching", "--max-batch-size", "2", "--served-model-name", "oss")
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def test_chat_completions_tool_round_trip_from_the_mxfp4_file(server):
    client = server.client()
    first = client.chat.completions.create(messages=QUESTION, **ASK).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.reasoning_content == THOUGHT_1 and not first.message.content
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    second = client.chat.completions.create(messages=_round_trip(call.id), **ASK).choices[0]
    assert second.finish_reason == "stop"
    assert (second.message.reasoning_content, second.message.content) == (THOUGHT_2, ANSWER)


def test_streamed_from_the_mxfp4_file(server):
    thought, content, calls = "", "", []
    for chunk in server.client().chat.completions.create(messages=QUESTION, stream=True, **ASK):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
    assert thought == THOUGHT_1 and content == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", ARGUMENTS)]
