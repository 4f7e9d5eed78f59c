"""Comparing ifb with transformers on the same checkpoint: prompts, encoder features, logits, greedy tokens."""

from __future__ import annotations

import io

import torch
from PIL import Image

from ifb import SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.decoder import allocate_kv_cache
from tests.models.media import audio_part, image_part
from tests.helpers import one_seat_step
from tests.media_family import alone, trace

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def chat(content, params=GREEDY) -> RequestSpec:
    return RequestSpec(messages=({"role": "user", "content": content},), params=params)


def openai_content(parts: list[tuple[str, object]]) -> list[dict]:
    """``[("text", str) | ("image", png bytes) | ("audio", wav bytes)]`` as an OpenAI client sends it."""
    make = {"text": lambda t: {"type": "text", "text": t}, "image": image_part, "audio": audio_part}
    return [make[kind](value) for kind, value in parts]


def hf_content(parts: list[tuple[str, object]]) -> list[dict]:
    """The same parts as transformers' chat templates take them (the media go to the processor)."""
    return [{"type": "text", "text": v} if kind == "text" else {"type": kind} for kind, v in parts]


def first_logits(runtime, prepared) -> torch.Tensor:
    """Float32 logits ``[V]`` after the whole prompt, in one prefill over a fresh cache."""
    ids = prepared.prompt_token_ids
    num_blocks = -(-len(ids) // runtime.kv_block_size) + 1
    step, seats = one_seat_step(prepared, tuple(range(num_blocks)), GREEDY)
    model = runtime.model
    caches = allocate_kv_cache(model.config, num_blocks, runtime.kv_block_size)
    attn = build_attn_metadata([(0, len(ids), seats[0].block_ids)], runtime.kv_block_size, torch.device("cpu"))
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        hidden = model(input_ids, torch.arange(len(ids)), attn, caches, runtime.step_embeddings(step, seats, input_ids))
        return model.compute_logits(hidden[-1:])[0]


def reference_inputs(processor, messages: list[dict], images=None, audio=None, **kwargs):
    """The processor's prompt and tensors for HF-style messages."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    extra = {}
    if images:
        extra["images"] = images
    if audio:
        extra["audio"] = audio
    return processor(text=text, return_tensors="pt", **extra, **kwargs)


def reference_greedy(model, inputs, num_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # as ignore_eos
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def assert_close(ours: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    assert ours.shape == expected.shape
    diff = (ours.float() - expected.float()).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3g} > {atol}"




__all__ = ["GREEDY", "alone", "assert_batched_equals_alone", "assert_close", "chat", "first_logits", "pil", "reference_greedy",
           "reference_inputs", "openai_content", "hf_content", "trace"]


def assert_batched_equals_alone(llm, specs) -> None:
    """Each request's output in a staggered batch equals its output alone; ``specs[0]`` founds the batch and
    runs long enough for the media requests after it to join mid-flight (at least one must, however slowly
    the machine prepares them)."""
    from tests.helpers import submit_staggered

    solo = [trace(alone(llm, s)) for s in specs]
    before = llm.health()["scheduling"]["admitted_mid_flight"]
    batched = submit_staggered(llm.engine, specs, gap_steps=2)
    assert [trace(r) for r in batched] == solo
    assert llm.health()["scheduling"]["admitted_mid_flight"] - before >= 1
