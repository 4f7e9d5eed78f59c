"""Prefix KV reuse: correctness, visibility, accounting and bookkeeping."""

from __future__ import annotations

import random

import pytest

from ifb import LLM, SamplingParams
from ifb.capabilities import DeployConfig
from ifb.counters import SchedulingCounters
from ifb.engine import new_request
from ifb.gate import UnsupportedDeployment
from ifb.kv import BlockManager
from ifb.params import RequestSpec
from ifb.runtime import SeqOutput, StepOutput
from ifb.scheduler import Scheduler
from ifb_plugins.context_cache.cache import PrefixCache
from tests.models.text import save_tiny_checkpoint

from tests.core.fakes import FakeRuntime
from tests.helpers import submit_staggered

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def cached_scheduler(rt, seats=4, budget=64, num_blocks=64, counters=None):
    counters = counters or SchedulingCounters()
    blocks = BlockManager(num_blocks, rt.kv_block_size)
    cache = PrefixCache(blocks, counters)
    s = Scheduler(num_seats=seats, token_budget=budget, blocks=blocks, tokenizer=rt.tokenizer,
                  max_model_len=rt.max_model_len, counters=counters, prefix=cache)
    return s, cache, blocks


def request(rt, name, ids, max_tokens=4):
    return new_request(rt, RequestSpec(prompt_token_ids=tuple(ids), request_id=name,
                                       params=SamplingParams(temperature=0.0, max_tokens=max_tokens)))


def computed_tokens(steps, name):
    return sum(len(q.token_ids) for step in steps for q in step.seqs if q.request_id == name)


def drain(s, rt, steps):
    while s.has_work:
        step = s.schedule()
        if step is None:
            break
        steps.append(step)
        s.update(step, rt.execute(step))


def test_a_joiner_prefills_only_what_it_does_not_share():
    rt = FakeRuntime(kv_block_size=16, num_kv_blocks=256, max_model_len=1024)
    s, cache, blocks = cached_scheduler(rt, budget=128, num_blocks=256)
    shared = [((i * 7) % 25) + 1 for i in range(512)]
    steps = []
    first = request(rt, "first", shared + [3, 4, 5], max_tokens=50)
    s.add(first)
    for _ in range(6):  # prefill the founder (5 steps of 128 tokens), then it decodes
        step = s.schedule()
        steps.append(step)
        s.update(step, rt.execute(step))
    joiner = request(rt, "joiner", shared + [9, 9, 9, 9, 9, 9, 9])
    s.add(joiner)
    drain(s, rt, steps)
    assert computed_tokens(steps, "joiner") == 7 + 4 - 1  # its 7 own prompt tokens, then 3 decodes
    assert s.counters.admitted_mid_flight == 1
    assert s.counters.prefix_cache_hits == 512
    blocks.check_no_leaks()


def test_a_block_computed_in_a_step_is_not_leased_by_a_request_admitted_into_that_step():
    rt = FakeRuntime(kv_block_size=4)
    s, cache, _ = cached_scheduler(rt, budget=64)
    prompt = list(range(1, 13))
    a = request(rt, "a", prompt)
    b = request(rt, "b", prompt)
    s.add(a)
    s.add(b)
    step = s.schedule()  # both admitted at the same boundary: a's blocks are not published yet
    assert {q.request_id: q.start_pos for q in step.seqs} == {"a": 0, "b": 0}
    s.update(step, rt.execute(step))
    c = request(rt, "c", prompt)
    s.add(c)
    step = s.schedule()  # now the step that computed them has finished: c leases 2 blocks (8 tokens)
    assert {q.request_id: q.start_pos for q in step.seqs}["c"] == 8


def test_different_salt_never_shares_a_block():
    rt = FakeRuntime(kv_block_size=4)
    s, cache, _ = cached_scheduler(rt)
    prompt = tuple(range(1, 13))
    a = new_request(rt, RequestSpec(prompt_token_ids=prompt, params=GREEDY))
    a.kv_salt = "image-1"
    s.add(a)
    steps = []
    drain(s, rt, steps)
    b = new_request(rt, RequestSpec(prompt_token_ids=prompt, params=GREEDY))
    b.kv_salt = "image-2"
    s.add(b)
    step = s.schedule()
    assert step.seqs[0].start_pos == 0


def test_blocks_before_the_first_media_item_are_shared_whatever_the_salt():
    rt = FakeRuntime(kv_block_size=4)
    s, cache, _ = cached_scheduler(rt)
    prompt = tuple(range(1, 14))
    a = new_request(rt, RequestSpec(prompt_token_ids=prompt, params=GREEDY))
    a.kv_salt, a.num_unsalted_tokens = "image-1", 9  # its media start at token 9: blocks 0 and 1 lie before
    s.add(a)
    drain(s, rt, [])
    b = new_request(rt, RequestSpec(prompt_token_ids=prompt, params=GREEDY))
    b.kv_salt, b.num_unsalted_tokens = "image-2", 9
    s.add(b)
    step = s.schedule()
    assert step.seqs[0].start_pos == 8  # the two unsalted blocks leased, the salted third recomputed


def test_after_a_thousand_random_requests_every_block_is_free_again():
    rng = random.Random(0)
    rt = FakeRuntime(kv_block_size=4, num_kv_blocks=48)
    s, cache, blocks = cached_scheduler(rt, seats=4, budget=16, num_blocks=48)
    prefixes = [[rng.randrange(1, 27) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    submitted = []
    for i in range(1000):
        ids = rng.choice(prefixes) + [rng.randrange(1, 27) for _ in range(rng.randrange(1, 8))]
        name = f"q{i}" + ("x" if rng.random() < 0.03 else "")
        if name.endswith("x"):
            rt.fail_ids.add(name)
        r = request(rt, name, ids, max_tokens=rng.randrange(1, 10))
        submitted.append(r)
        s.add(r)
        if rng.random() < 0.05:
            rng.choice(submitted).handle.cancel()
        for _ in range(rng.randrange(0, 3)):
            step = s.schedule()
            if step is not None:
                try:
                    s.update(step, rt.execute(step))
                except RuntimeError as exc:
                    s.fail_step(step, exc)
            assert s.counters.is_consistent()
    while s.has_work:
        step = s.schedule()
        try:
            s.update(step, rt.execute(step))
        except RuntimeError as exc:
            s.fail_step(step, exc)
    snap = s.counters.snapshot()
    assert snap["completed"] + snap["cancelled"] + snap["failed"] == 1000
    assert snap["cancelled"] > 0 and snap["failed"] > 0 and s.counters.prefix_cache_hits > 0
    assert s.counters.prefix_cache_evictions > 0  # 48 blocks cannot keep every prefix
    blocks.check_no_leaks()
    assert all(c == 0 for c in blocks.ref_counts)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def test_greedy_outputs_are_identical_with_and_without_reuse(checkpoint):
    system = [7 + (i % 50) for i in range(70)]
    prompts = [tuple(system + [100 + i, 101, 102 + i]) for i in range(6)]
    plain = LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=3, max_num_batched_tokens=32)
    try:
        alone = [plain.engine.submit(RequestSpec(prompt_token_ids=p, params=GREEDY)).result().token_ids for p in prompts]
    finally:
        plain.close()
    reuse = LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=3, max_num_batched_tokens=32,
                enable_context_reuse=True)
    try:
        one_by_one = [reuse.engine.submit(RequestSpec(prompt_token_ids=p, params=GREEDY)).result().token_ids
                      for p in prompts]
        batched = submit_staggered(reuse.engine, [RequestSpec(prompt_token_ids=p, params=GREEDY) for p in prompts], 1)
        assert one_by_one == alone
        assert [r.token_ids for r in batched] == alone
        health = reuse.health()
        assert health["prefix_cache"]["hits"] >= 64 * 10
        assert health["scheduling"]["admitted_mid_flight"] > 0
    finally:
        reuse.close()


def test_warmup_publishes_a_system_prompt_before_serving(checkpoint):
    system = "You answer in one word. " * 6
    llm = LLM(str(checkpoint), enable_in_flight_batching=True, enable_context_reuse=True, warmup_prompt=system)
    try:
        assert llm.health()["prefix_cache"]["hits"] == 0
        llm.chat([{"role": "system", "content": system}, {"role": "user", "content": "hi"}], GREEDY)
        assert llm.health()["prefix_cache"]["hits"] >= 16
    finally:
        llm.close()


def test_context_reuse_is_refused_without_in_flight_batching(checkpoint):
    with pytest.raises(UnsupportedDeployment, match="--enable-in-flight-batching"):
        LLM(str(checkpoint), enable_context_reuse=True)


def test_batch_wide_generation_length_makes_a_joiner_wait():
    from tests.core.fakes import text_caps
    rt = FakeRuntime(caps=text_caps(batch_wide_generation_length=True))
    counters = SchedulingCounters()
    s = Scheduler(num_seats=4, token_budget=32, blocks=BlockManager(64, 4), tokenizer=rt.tokenizer,
                  max_model_len=512, counters=counters, batch_wide_length=True)
    s.add(request(rt, "a", [1, 2, 3], max_tokens=8))
    s.update(step := s.schedule(), rt.execute(step))
    s.add(request(rt, "b", [1, 2], max_tokens=4))
    s.schedule()
    assert s.exclusions == {"b": "stalls_incompatible"}
    s.add(request(rt, "c", [1, 2], max_tokens=8))
    assert counters.stalls["stalls_incompatible"] == 1
    assert DeployConfig().enable_context_reuse is False
