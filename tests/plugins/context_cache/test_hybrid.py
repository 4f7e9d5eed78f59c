"""Prefix reuse for hybrid models: KV blocks and recurrent-state checkpoints reused together.

The bookkeeping runs on a model-free runtime whose "state" is the exact token
prefix a seat has consumed and whose "KV" is the tokens written to each
block, so every step checks that a restored seat and its leased blocks hold
precisely the prompt's prefix. The numbers run on a tiny Nemotron-H built by
transformers: greedy output with reuse equals output without it.
"""

from __future__ import annotations

import random
import threading

import attrs
import pytest

from ifb import LLM
from ifb.counters import SchedulingCounters
from ifb.engine import new_request
from ifb.kv import BlockManager
from ifb.params import RequestSpec, SamplingParams
from ifb.scheduler import Scheduler
from ifb_plugins.context_cache.hybrid import HybridPrefixCache
from tests.models.hybrid import SAVERS, save_tiny_nemotron_h

from tests.core.fakes import FakeRuntime
from tests.helpers import submit_staggered


@attrs.define
class FakeStore:
    """Checkpoints every ``interval`` tokens and at each prompt's last block boundary, like the mamba runtime."""

    num_slots: int
    block_size: int
    interval: int
    slots: dict = attrs.field(factory=dict)
    captured: dict = attrs.field(factory=dict)
    pending_restores: dict = attrs.field(factory=dict)

    def positions(self, seq, seat) -> list[int]:
        bs, end = self.block_size, seq.start_pos + len(seq.token_ids)
        ends = range(seq.start_pos // bs * bs + bs, end + 1, bs)
        return [p for p in ends if p % self.interval == 0 or p == seat.num_prompt_tokens // bs * bs]

    def has_capture(self, request_id, position):
        return (request_id, position) in self.captured

    def save(self, request_id, position, slot):
        self.slots[slot] = self.captured[(request_id, position)]
        return True

    def stage_restore(self, request_id, position, slot):
        self.pending_restores[request_id] = (position, slot)

    def cancel_restore(self, request_id):
        self.pending_restores.pop(request_id, None)


@attrs.define
class FakeHybridRuntime(FakeRuntime):
    state_checkpoints: FakeStore | None = None
    seat_state: dict = attrs.field(factory=dict)
    kv: dict = attrs.field(factory=dict)  # block id -> {offset: token}
    restored: int = 0

    def execute(self, step):
        store = self.state_checkpoints
        store.captured = {}
        seats = self.seats.apply(step)
        for seat in step.reset_seats:
            self.seat_state[seat] = ()
        for seq, seat in zip(step.seqs, seats):
            staged = store.pending_restores.pop(seq.request_id, None)
            if staged is not None and seq.start_pos:
                assert staged[0] == seq.start_pos
                self.seat_state[seq.seat] = store.slots[staged[1]]
                self.restored += 1
            prefix = tuple(seat.all_token_ids)[:seq.start_pos]
            assert self.seat_state[seq.seat] == prefix, "the seat's state is not its prompt's prefix"
            bs = self.kv_block_size
            assert tuple(self.kv[seat.block_ids[p // bs]][p % bs] for p in range(seq.start_pos)) == prefix
            self.seat_state[seq.seat] = prefix + seq.token_ids
            for offset, token in enumerate(seq.token_ids):
                p = seq.start_pos + offset
                self.kv.setdefault(seat.block_ids[p // bs], {})[p % bs] = token
            for p in store.positions(seq, seat):
                store.captured[(seq.request_id, p)] = tuple(seat.all_token_ids)[:p]
        self.steps.append(step)
        return self.outputs_for(step, seats)


def hybrid_scheduler(num_blocks=48, num_slots=6, seats=4, budget=16, block_size=4, interval=8):
    rt = FakeHybridRuntime(kv_block_size=block_size, num_kv_blocks=num_blocks,
                           state_checkpoints=FakeStore(num_slots, block_size, interval))
    counters = SchedulingCounters()
    blocks = BlockManager(num_blocks, block_size)
    cache = HybridPrefixCache(blocks, rt.state_checkpoints, counters)
    s = Scheduler(num_seats=seats, token_budget=budget, blocks=blocks, tokenizer=rt.tokenizer,
                  max_model_len=rt.max_model_len, counters=counters, prefix=cache)
    return rt, s, cache, blocks


def run(s, rt, steps=None):
    step = s.schedule()
    if step is None:
        return
    if steps is not None:
        steps.append(step)
    try:
        s.update(step, rt.execute(step))
    except RuntimeError as exc:
        s.fail_step(step, exc)


def request(rt, name, ids, max_tokens=4):
    return new_request(rt, RequestSpec(prompt_token_ids=tuple(ids), request_id=name,
                                       params=SamplingParams(temperature=0.0, max_tokens=max_tokens)))


def test_a_joiner_resumes_from_the_deepest_checkpoint_and_computes_the_rest():
    rt, s, cache, blocks = hybrid_scheduler(block_size=4, interval=8)
    shared = list(range(1, 20))  # 19 tokens: checkpoints at 8 and 16 (both interval and prompt end)
    s.add(request(rt, "first", shared + [3], max_tokens=2))
    while s.has_work:
        run(s, rt)
    steps = []
    s.add(request(rt, "joiner", shared[:14] + [9, 9]))  # matches 3 blocks (12 tokens); deepest checkpoint: 8
    while s.has_work:
        run(s, rt, steps)
    joined = [q for step in steps for q in step.seqs if q.request_id == "joiner"]
    assert joined[0].start_pos == 8 and rt.restored == 1
    assert s.counters.prefix_cache_hits == 8  # both KV and state reused: 8 tokens, not the 12 of matching KV
    blocks.check_no_leaks()
    cache.check_no_leaks()


def test_without_a_checkpoint_matching_kv_is_not_reused():
    rt, s, cache, _ = hybrid_scheduler(block_size=4, interval=64)
    s.add(request(rt, "first", list(range(1, 30)), max_tokens=1))  # a checkpoint only at 28, its prompt end
    while s.has_work:
        run(s, rt)
    steps = []
    s.add(request(rt, "joiner", list(range(1, 20))))  # 4 full blocks match, no checkpoint within them
    while s.has_work:
        run(s, rt, steps)
    assert steps[0].seqs[0].start_pos == 0 and s.counters.prefix_cache_hits == 0


def test_after_a_thousand_random_requests_every_refcount_and_state_slot_is_free():
    rng = random.Random(0)
    rt, s, cache, blocks = hybrid_scheduler(num_blocks=48, num_slots=5)
    prefixes = [[rng.randrange(1, 27) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    submitted = []
    for i in range(1000):
        ids = rng.choice(prefixes) + [rng.randrange(1, 27) for _ in range(rng.randrange(1, 8))]
        name = f"q{i}" + ("x" if rng.random() < 0.03 else "")
        if name.endswith("x"):
            rt.fail_ids.add(name)
        r = request(rt, name, ids, max_tokens=rng.randrange(1, 10))
        submitted.append(r)
        s.add(r)
        if rng.random() < 0.08:
            rng.choice(submitted[-12:]).handle.cancel()  # queued, just admitted (restore pending) or running
        for _ in range(rng.randrange(0, 3)):
            run(s, rt)
    while s.has_work:
        run(s, rt)
    snap = s.counters.snapshot()
    assert snap["completed"] + snap["cancelled"] + snap["failed"] == 1000
    assert snap["cancelled"] > 0 and snap["failed"] > 0
    assert rt.restored > 100 and s.counters.prefix_cache_hits > 0
    assert s.counters.prefix_cache_evictions > 0 and cache.state_evictions > 0  # both pools were too small
    blocks.check_no_leaks()
    cache.check_no_leaks()
    assert not rt.state_checkpoints.pending_restores


# ---- the real model ----

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=1)


def _bits(result):
    return result.token_ids, tuple(lp.logprob for lp in result.logprobs)


@pytest.fixture(scope="module", params=list(SAVERS))
def model_dir(request, tmp_path_factory):
    """Every family the hybrid deployment names (Nemotron-H, Bamba, Granite 4.0 hybrid)."""
    return SAVERS[request.param](tmp_path_factory.mktemp(request.param), seed=2)


def _specs(seed: int, n: int = 6):
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(70)]
    return [RequestSpec(prompt_token_ids=tuple(system[:rng.choice((40, 70))] +
                                               [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))]),
                        params=SamplingParams(max_tokens=rng.randrange(2, 8), **GREEDY)) for _ in range(n)]


def _llm(path, reuse: bool, **kw):
    kw = {"max_batch_size": 3, "max_num_batched_tokens": 24, **kw}
    return LLM(model=str(path), plugin="mamba", enable_in_flight_batching=True, enable_context_reuse=reuse, **kw)


def test_greedy_output_is_identical_with_and_without_reuse_alone_and_batched(model_dir):
    specs = _specs(1)
    with _llm(model_dir, False) as llm:
        plain = [_bits(llm.engine.submit(spec).result()) for spec in specs]
    with _llm(model_dir, True, hybrid_checkpoint_interval=32) as llm:
        alone = [_bits(llm.engine.submit(spec).result()) for spec in specs]
        batched = [_bits(r) for r in submit_staggered(llm.engine, specs, gap_steps=1)]
        health = llm.health()
        stats = llm.engine.prefix.stats()
    assert alone == plain
    assert batched == plain
    assert health["prefix_cache"]["hits"] >= 32 * 10 and health["scheduling"]["admitted_mid_flight"] > 0
    assert stats["state_checkpoints"] >= 2  # at 32 (the interval) and at the prompts' ends (32, 64)


def test_a_joiner_sharing_a_published_512_token_prefix_computes_only_its_own_tokens(tmp_path):
    path = save_tiny_nemotron_h(tmp_path, seed=4)
    rng = random.Random(5)
    shared = [rng.randrange(3, 300) for _ in range(512)]
    own = [rng.randrange(3, 300) for _ in range(7)]
    first = RequestSpec(prompt_token_ids=tuple(shared + [3, 4, 5]), params=SamplingParams(max_tokens=60, **GREEDY))
    joiner = RequestSpec(prompt_token_ids=tuple(shared + own), params=SamplingParams(max_tokens=4, **GREEDY))
    with _llm(path, False) as llm:
        expected = _bits(llm.engine.submit(joiner).result())
    with _llm(path, True, max_num_batched_tokens=128) as llm:
        runtime, steps = llm.deployment.runtime, []
        execute, lock = runtime.execute, threading.Lock()

        def recording(step):
            with lock:
                steps.append(step)
            return execute(step)

        runtime.execute = recording
        handle = llm.engine.submit(first)
        outputs = iter(handle)
        next(outputs)  # its first token: the prompt's blocks and its state checkpoint are published
        result = llm.engine.submit(joiner).result()
        assert not handle.done.is_set()  # the joiner ran beside the still-decoding first request
        handle.result()
        health = llm.health()
    computed = sum(len(q.token_ids) for step in steps for q in step.seqs if q.request_id == result.request_id)
    assert computed == len(own) + 4 - 1  # its own prompt tokens, then three decodes
    assert health["prefix_cache"]["hits"] == 512
    assert health["scheduling"]["admitted_mid_flight"] == 1
    assert _bits(result) == expected


def test_a_warmup_prompt_publishes_its_state_for_the_chats_that_start_with_it(tmp_path):
    path = save_tiny_nemotron_h(tmp_path, seed=3)
    system = "You answer in one word. " * 6
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with _llm(path, False) as llm:
        expected = llm.chat(chat, params).token_ids
    with _llm(path, True, warmup_prompt=system) as llm:
        assert llm.health()["prefix_cache"]["hits"] == 0
        assert llm.chat(chat, params).token_ids == expected
        assert llm.health()["prefix_cache"]["hits"] >= 16


def test_random_requests_with_cancellations_on_a_small_cache_leave_nothing_held(tmp_path):
    model_dir = save_tiny_nemotron_h(tmp_path, seed=6)
    specs = _specs(7, n=32)
    with _llm(model_dir, False, max_batch_size=4) as llm:
        expected = [_bits(r) for r in submit_staggered(llm.engine, specs, gap_steps=1)]
    rng = random.Random(3)
    with _llm(model_dir, True, max_batch_size=4, max_kv_cache_capacity=640, hybrid_checkpoint_interval=16) as llm:
        handles = [llm.engine.submit(spec, wait=True) for spec in specs]
        doomed = set(rng.sample(range(len(specs)), 8))
        for i in doomed:
            handles[i].cancel()
        results = [h.result() for h in handles]
        engine, runtime = llm.engine, llm.deployment.runtime
        stats, health = engine.prefix.stats(), llm.health()
        engine.blocks.check_no_leaks()
        engine.prefix.check_no_leaks()
        assert not runtime.state_checkpoints.pending_restores
        conv, ssm = zip(*(runtime.seat_state(seat) for seat in range(runtime.num_seats)))
        assert not any(t.any() for per_seat in conv + ssm for t in per_seat)
    kept = [i for i, r in enumerate(results) if r.finish_reason != "cancelled"]
    assert len(kept) >= len(specs) - len(doomed)
    assert [_bits(results[i]) for i in kept] == [expected[i] for i in kept]
    assert stats["evictable_blocks"] == stats["cached_blocks"] and stats["state_checkpoints"] > 0
    # The small cache evicted both blocks (with their checkpoints) and checkpoints alone, and still hit.
    assert health["prefix_cache"]["evictions"] > 0 and stats["state_evictions"] > 0
    assert health["prefix_cache"]["hits"] > 0
