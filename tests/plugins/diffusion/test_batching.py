"""Denoising steps of several requests in one forward: answers under in-flight batching equal alone."""

from __future__ import annotations

import pytest

from ifb import LLM
from ifb.params import RequestSpec, SamplingParams

from tests.helpers import submit_staggered

from . import reference

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. A paged KV", "What is the capital",
           "Numbers: 0 1 2 3", "In-flight batching lets a request join"]


@pytest.fixture(scope="module")
def batched(diffusion_reference):
    llm = LLM(str(diffusion_reference[0]), plugin="diffusion", enable_in_flight_batching=True, max_batch_size=4)
    yield llm
    llm.deployment.shutdown()


def _expected(diffusion_reference, i: int, params: SamplingParams) -> list[int]:
    # the reference alone: temperature 0 is the near-zero schedule's answer, 1 the checkpoint schedule's
    settings = reference.NEAR_ZERO if params.temperature == 0 else {}
    return reference.generate(diffusion_reference[1], reference.tokenizer().encode(PROMPTS[i]), seed=params.seed,
                              max_new_tokens=params.max_tokens, **settings)


def test_staggered_joins_answer_as_alone(diffusion_reference, batched):
    # different seeds, temperatures and lengths: each request has its own sampler
    params = [SamplingParams(max_tokens=8 * (1 + i % 3) + i, seed=20 + i, temperature=float(i % 2), ignore_eos=True)
              for i in range(len(PROMPTS))]
    specs = [RequestSpec(prompt=p, params=q) for p, q in zip(PROMPTS, params)]
    results = submit_staggered(batched.engine, specs, gap_steps=3)
    for i, (result, p) in enumerate(zip(results, params)):
        assert list(result.token_ids) == _expected(diffusion_reference, i, p), i
    counters = batched.engine.counters
    assert counters.admitted_mid_flight >= 3 and counters.completed >= len(PROMPTS)


def test_a_stop_token_ends_one_resident_only(diffusion_reference, batched):
    ids = reference.tokenizer().encode(PROMPTS[0])
    free = reference.generate(diffusion_reference[1], ids, seed=3, max_new_tokens=24)
    end = free[10]
    expected = reference.generate(diffusion_reference[1], ids, seed=3, max_new_tokens=24, eos_token_id=end)
    specs = [RequestSpec(prompt=PROMPTS[0], params=SamplingParams(max_tokens=24, seed=3, ignore_eos=True,
                                                                  stop_token_ids=(end,))),
             RequestSpec(prompt=PROMPTS[2], params=SamplingParams(max_tokens=24, seed=4, ignore_eos=True))]
    stopped, other = submit_staggered(batched.engine, specs, gap_steps=1)
    assert list(stopped.token_ids) == expected and stopped.finish_reason == "stop"
    assert list(other.token_ids) == reference.generate(diffusion_reference[1], reference.tokenizer().encode(
        PROMPTS[2]), seed=4, max_new_tokens=24)


def test_streams_one_output_per_finished_block(batched):
    handle = batched.engine.submit(RequestSpec(prompt=PROMPTS[1], stream=True, params=SamplingParams(
        max_tokens=20, seed=2, ignore_eos=True)), wait=True)
    assert [len(o.token_ids) for o in handle] == [8, 8, 4]


def test_a_canvas_logits_bits_do_not_depend_on_who_shares_the_forward(batched):
    import torch

    from ifb_plugins.diffusion.model import SegmentInput

    model = batched.deployment.runtime.model
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, reference.VOCAB, (n,), generator=gen) for n in (9, 14, 3)]
    canvases = [torch.randint(0, reference.VOCAB, (reference.CANVAS,), generator=gen) for _ in prompts]
    alone = model([SegmentInput(prompts[0], (kv := model.new_cache()), False), SegmentInput(canvases[0], kv, True)])
    caches = [model.new_cache() for _ in prompts]
    together = model([s for p, c, kv in zip(prompts, canvases, caches)
                      for s in (SegmentInput(p, kv, False), SegmentInput(c, kv, True))])
    assert torch.equal(alone[0], together[0])
