"""The checks every media family's test makes against its reference, written once.

A family's test module supplies its prompts (``name -> parts``: text as ``str``, media as the family's own
objects), ``request(parts, params=GREEDY)`` building ifb's request and ``inputs(parts)`` building the
reference processor's tensors; these helpers run the comparisons the same way for every family.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from ifb import SamplingParams
from tests.helpers import one_seat_step, submit_staggered

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)


def picture(seed: int, height: int, width: int) -> Image.Image:
    """A random RGB image: random pixels make every image's features differ."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class trace:
    """Tokens and their log-probabilities; equal when the tokens are and the log-probabilities agree to 1e-4."""

    def __init__(self, result):
        self.token_ids = tuple(result.token_ids)
        self.logprobs = tuple(lp.logprob for lp in result.logprobs)

    def __eq__(self, other) -> bool:
        return self.token_ids == other.token_ids and self.logprobs == pytest.approx(other.logprobs, abs=1e-4)

    def __repr__(self) -> str:
        return f"trace({self.token_ids})"


def alone(llm, spec):
    return llm.engine.submit(spec, wait=True).result()


def attn_for(runtime, seq, seat):
    """The paged attention metadata of one sequence in a one-seat step."""
    from ifb_plugins.common.layers.attention import build_attn_metadata

    return build_attn_metadata([(seq.start_pos, len(seq.token_ids), seat.block_ids)], runtime.kv_block_size)


def paged_first_step_logits(runtime, prepared) -> torch.Tensor:
    """Float32 logits ``[V]`` after the whole prompt, in one prefill through the runtime's own paged cache."""
    ids = list(prepared.prompt_token_ids)
    step, seats = one_seat_step(prepared, tuple(range(-(-len(ids) // runtime.kv_block_size))), GREEDY)
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        hidden = runtime.model(tokens, runtime.step_positions(step, seats), attn_for(runtime, step.seqs[0], seats[0]),
                               runtime.kv_caches, runtime.step_embeddings(step, seats, tokens))
        return runtime.model.compute_logits(hidden[-1:])[0]


def assert_greedy_equals_generate(llm, reference, prompts: dict, request, inputs, num_tokens: int = NUM_TOKENS) -> None:
    """Each prompt's greedy tokens, served alone, equal the reference's ``generate`` on the same inputs."""
    for name, parts in prompts.items():
        reference_inputs = inputs(parts)
        with torch.no_grad():
            out = reference.generate(**reference_inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None)
        expected = out[0, reference_inputs["input_ids"].shape[1]:].tolist()
        assert len(expected) == num_tokens
        assert list(alone(llm, request(parts)).token_ids) == expected, name


def assert_media_joins_equal_alone(llm, prompts: dict, request, founder_tokens: int, min_joins: int = 3) -> None:
    """A long text request founds the batch; every prompt then joins it staggered, and each output (tokens and
    log-probabilities) equals that request's output alone. ``founder_tokens`` keeps the batch running while
    each later request's media are encoded, so at least ``min_joins`` join mid-flight (asserted)."""
    founder = request(["Tell me a long story about in-flight batching."],
                      SamplingParams(temperature=0.0, max_tokens=founder_tokens, ignore_eos=True, logprobs=1))
    specs = [founder] + [request(parts) for parts in prompts.values()]
    solo = [trace(alone(llm, s)) for s in specs]
    before = llm.health()["scheduling"]["admitted_mid_flight"]
    batched = submit_staggered(llm.engine, specs, gap_steps=2)
    assert [trace(r) for r in batched] == solo
    assert llm.health()["scheduling"]["admitted_mid_flight"] - before >= min_joins


def image_request(parts, params: SamplingParams = GREEDY):
    """One user message of text and images (``str`` / ``PIL.Image`` parts) as an OpenAI client sends it."""
    from ifb.params import RequestSpec

    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    return RequestSpec(messages=({"role": "user", "content": content},), params=params)


def image_inputs(processor, parts):
    """The same message through the reference processor's chat template and image processing."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    images = [p for p in parts if not isinstance(p, str)]
    return processor(text=[text], images=images or None, return_tensors="pt")
