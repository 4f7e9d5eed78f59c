"""The scheduler on hand-made step outputs: no model, no threads."""

from __future__ import annotations

from ifb.capabilities import OptionSupport, Support
from ifb.engine import new_request
from ifb.kv import BlockManager
from ifb.params import RequestSpec, SamplingParams
from ifb.runtime import SeqOutput, StepOutput
from ifb.scheduler import Scheduler

from tests.core.fakes import FakeRuntime


def make(runtime, name, num_prompt, max_tokens=8, **params):
    spec = RequestSpec(prompt_token_ids=tuple(range(1, num_prompt + 1)), request_id=name,
                       params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))
    return new_request(runtime, spec)


def scheduler(runtime, seats=3, budget=8, blocks=64, **kw):
    return Scheduler(num_seats=seats, token_budget=budget, blocks=BlockManager(blocks, 4),
                     tokenizer=runtime.tokenizer, max_model_len=runtime.max_model_len, **kw)


def run_step(s, step, token=5):
    """Hand-made output: every sampling sequence gets ``token``."""
    s.update(step, StepOutput(tuple(SeqOutput(q.request_id, token if q.is_sampling else None) for q in step.seqs)))


def shares(step):
    return {q.request_id: len(q.token_ids) for q in step.seqs}


def test_five_rounds_long_short_and_decoding_under_a_token_budget():
    """spec 004: a decoding request, a long prompt and a short prompt under a budget of 8 tokens."""
    rt = FakeRuntime()
    s = scheduler(rt, seats=2, budget=8)
    decoding = make(rt, "decoding", 3, max_tokens=50)
    s.add(decoding)
    run_step(s, s.schedule())  # its prompt is prefilled; from now on it decodes one token a step
    assert decoding.num_computed_tokens == 3 and len(decoding.output_token_ids) == 1
    long, short = make(rt, "long", 20), make(rt, "short", 4)
    s.add(long)
    s.add(short)

    # round 1: decode first (1 token), the long head is seated and takes the other 7 tokens;
    # the short prompt cannot enter: both seats are taken.
    step = s.schedule()
    assert shares(step) == {"decoding": 1, "long": 7}
    assert s.exclusions == {"short": "no free seat"}
    run_step(s, step)

    # round 2: same shape, the long prompt's second chunk (14 of 20 computed after it)
    step = s.schedule()
    assert shares(step) == {"decoding": 1, "long": 7}
    assert s.exclusions == {"short": "no free seat"}
    run_step(s, step)

    # round 3: the long prompt's last 6 tokens fit; it samples its first token
    step = s.schedule()
    assert shares(step) == {"decoding": 1, "long": 6}
    assert [q.is_sampling for q in step.seqs] == [True, True]
    assert s.exclusions == {"short": "no free seat"}
    run_step(s, step)

    # the decoding request finishes (hand-made EOS) in round 4; the short prompt still waits
    step = s.schedule()
    assert shares(step) == {"decoding": 1, "long": 1}
    assert s.exclusions == {"short": "no free seat"}
    run_step_tokens = StepOutput((SeqOutput("decoding", 0), SeqOutput("long", 5)))
    s.update(step, run_step_tokens)
    assert decoding.finish_reason == "stop"

    # round 5: the freed seat goes to the short prompt at the boundary; it joins mid-flight
    step = s.schedule()
    assert shares(step) == {"long": 1, "short": 4}
    assert s.exclusions == {}
    assert s.counters.admitted_mid_flight == 2  # long and short both joined a running batch
    assert step.reset_seats == (short.seat,)


def test_budget_exhaustion_is_the_reason_a_seated_prefill_waits():
    rt = FakeRuntime()
    s = scheduler(rt, seats=3, budget=8)
    a, b = make(rt, "a", 10), make(rt, "b", 5)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert shares(step) == {"a": 8}
    assert s.exclusions == {"b": "token budget spent"}


def test_stall_counters_name_why_the_head_cannot_join():
    rt = FakeRuntime()
    s = scheduler(rt, seats=4, budget=16, batch_wide_sampling=True)
    founder = make(rt, "founder", 4)
    s.add(founder)
    run_step(s, s.schedule())
    different = make(rt, "different", 4, top_k=5)
    later = make(rt, "later", 4)
    s.add(different)
    s.add(later)
    s.schedule()
    # FCFS: the incompatible head blocks the compatible request behind it
    assert s.exclusions == {"different": "stalls_incompatible", "later": "behind the queue head (FCFS)"}
    assert s.counters.stalls["stalls_incompatible"] == 1


def test_guided_head_waits_then_runs_alone():
    rt = FakeRuntime()
    s = scheduler(rt, seats=4, budget=16)
    a = make(rt, "a", 4, max_tokens=3)
    s.add(a)
    run_step(s, s.schedule())
    guided = make(rt, "guided", 4)
    guided.founder_only, guided.runs_alone = OptionSupport(Support.RUNS_ALONE, stall_counter="stalls_guided"), True
    plain = make(rt, "plain", 4)
    s.add(guided)
    s.add(plain)
    boundaries = 0
    while "a" in s.requests:
        step = s.schedule()
        boundaries += 1
        assert "guided" not in shares(step)
        run_step(s, step)
    assert s.counters.stalls["stalls_guided"] == boundaries
    step = s.schedule()  # the batch drained: the guided request founds, nobody joins it
    assert set(shares(step)) == {"guided"}
    assert s.exclusions == {"plain": "stalls_guided"}


def test_blocks_are_allocated_as_the_sequence_grows():
    rt = FakeRuntime()
    s = scheduler(rt, seats=2, budget=32, blocks=64)
    a = make(rt, "a", 5, max_tokens=None)  # a cap of the whole context, nothing reserved for it
    s.add(a)
    step = s.schedule()
    sent = list(step.seqs[0].new_block_ids)  # the runtime hears of each block once, as it is added
    assert len(sent) == 2 == len(a.block_ids)  # 5 prompt tokens in blocks of 4
    run_step(s, step)
    held = []
    for _ in range(8):
        step = s.schedule()
        sent += step.seqs[0].new_block_ids
        assert sent == a.block_ids
        held.append(len(sent))
        run_step(s, step)
    # token 6 is computed in the first decode; each further block starts at 9, 13
    assert held == [2, 2, 2, 3, 3, 3, 3, 4]
    assert s.blocks.num_free == 64 - 4


def test_no_kv_room_for_the_prefill_and_watermark_is_a_capacity_stall():
    rt = FakeRuntime()
    s = scheduler(rt, seats=4, budget=32, blocks=6, watermark=1)  # 24 tokens of KV
    a = make(rt, "a", 12)
    s.add(a)
    run_step(s, s.schedule())  # 3 blocks held
    b = make(rt, "b", 5)  # 2 blocks + watermark 1 + one per resident 1 = 4 > 3 free
    s.add(b)
    s.schedule()
    assert s.exclusions == {"b": "stalls_no_capacity"}
    assert s.counters.stalls["stalls_no_capacity"] == 1
    c = make(rt, "c", 4)
    s2 = scheduler(rt, seats=4, budget=32, blocks=6, watermark=1)
    s2.add(a2 := make(rt, "a2", 12))
    run_step(s2, s2.schedule())
    s2.add(c)  # 1 + 1 + 1 = 3 fits the 3 free blocks
    assert set(shares(s2.schedule())) == {"a2", "c"}


def test_the_youngest_resident_is_preempted_recomputed_and_never_streams_twice():
    rt = FakeRuntime()
    s = scheduler(rt, seats=2, budget=16, blocks=6, watermark=0)  # 24 tokens of KV
    old, young = make(rt, "old", 6, max_tokens=14), make(rt, "young", 6, max_tokens=14)
    s.add(old)
    s.add(young)
    streamed = {"old": [], "young": []}
    sent, reasons = [], set()
    while s.has_work:
        step = s.schedule()
        if step is None:
            break
        sent.append(step)
        s.update(step, rt.execute(step))
        for r in (old, young):
            for out in r.handle.ready():
                streamed[r.request_id].extend(out.token_ids)
        if young.num_preemptions == 1 and young.status.value == "waiting":
            assert list(s.waiting) == [young] and young.block_ids == [] and young.seat is None
            reasons.add(s.exclusions["young"])
            assert s.counters.snapshot()["preempted"] == 1 and s.counters.is_consistent()
    assert old.num_preemptions == 0 and young.num_preemptions == 1
    assert "preempted: the KV pool ran out" in reasons  # then it waits as any head does
    # the first step after its return recomputes the prompt and what it had generated, then samples
    back_step = next(st for st in sent if st is not sent[0] and any(
        q.request_id == "young" and q.start_pos == 0 for q in st.seqs))
    back = next(q for q in back_step.seqs if q.request_id == "young")
    seated = [n for st in sent if st is not sent[0] for n in st.new_seqs if n.request_id == "young"]
    assert seated and back.token_ids == seated[-1].token_ids and back.is_sampling and len(back.token_ids) > 6
    for r in (old, young):
        alone = FakeRuntime()
        t = scheduler(alone, seats=1, budget=16, blocks=64)
        twin = make(alone, r.request_id, 6, max_tokens=14)
        t.add(twin)
        while t.has_work:
            run_step_real(t, alone)
        assert r.output_token_ids == twin.output_token_ids
        assert streamed[r.request_id] == r.output_token_ids  # every token streamed exactly once
    s.blocks.check_no_leaks()
    assert s.counters.is_consistent()


def run_step_real(s, rt):
    step = s.schedule()
    if step is not None:
        s.update(step, rt.execute(step))


def test_a_lone_resident_that_outgrows_the_pool_ends_with_length():
    rt = FakeRuntime()
    s = scheduler(rt, seats=2, budget=32, blocks=6)
    big = make(rt, "big", 8, max_tokens=None)
    s.add(big)
    while s.has_work:
        run_step_real(s, rt)
    # 24 tokens fill the cache; the one sampled from them is the last
    assert big.finish_reason == "length" and big.num_tokens == 25
    assert s.counters.snapshot()["preempted"] == 0
    s.blocks.check_no_leaks()


def test_a_batch_wide_length_reserves_prompt_plus_max_tokens_and_clamps_a_lone_founder():
    rt = FakeRuntime()
    s = scheduler(rt, seats=4, budget=32, blocks=6, batch_wide_length=True)  # 24 tokens of KV
    a = make(rt, "a", 4, max_tokens=12)  # reserves 16 tokens = 4 blocks
    s.add(a)
    run_step(s, s.schedule())
    assert len(a.block_ids) == 4
    b = make(rt, "b", 4, max_tokens=12)
    s.add(b)
    s.schedule()
    assert s.exclusions == {"b": "stalls_no_capacity"}
    assert s.counters.stalls["stalls_no_capacity"] == 1

    big = make(rt, "big", 8, max_tokens=100)  # cannot fit even alone: founds with a clamped length
    s2 = scheduler(rt, seats=2, budget=32, blocks=6, batch_wide_length=True)
    s2.add(big)
    s2.schedule()
    assert big.max_tokens == 24 - 8


def test_static_batching_drains_before_admitting():
    rt = FakeRuntime()
    s = scheduler(rt, seats=4, budget=32, static_batching=True)
    a = make(rt, "a", 4, max_tokens=4)
    s.add(a)
    run_step(s, s.schedule())
    s.add(make(rt, "b", 4))
    step = s.schedule()
    assert set(shares(step)) == {"a"}
    assert s.exclusions["b"].startswith("static batching")


def test_a_sampling_step_may_finish_no_token_or_a_whole_block():
    """A block-diffusion runtime: steps that finish nothing reschedule the last token; a block arrives whole."""
    rt = FakeRuntime()
    s = scheduler(rt, seats=1, budget=8)
    r = make(rt, "block", 3, max_tokens=6)
    s.add(r)
    step = s.schedule()
    assert shares(step) == {"block": 3}
    s.update(step, StepOutput((SeqOutput("block", None),)))  # still denoising
    step = s.schedule()
    assert [(q.token_ids, q.start_pos, q.is_sampling) for q in step.seqs] == [((3,), 2, True)]
    assert r.output_token_ids == [] and r.handle.ready() == []
    s.update(step, StepOutput((SeqOutput("block", 7, more_token_ids=(8, 9, 10)),)))
    (out,) = r.handle.ready()  # the block is streamed as one output
    assert out.token_ids == (7, 8, 9, 10) and not out.finished
    step = s.schedule()  # the block comes back as tokens to encode, with the next sampling
    assert [(q.token_ids, q.start_pos, q.is_sampling) for q in step.seqs] == [((7, 8, 9, 10), 3, True)]
    s.update(step, StepOutput((SeqOutput("block", 11, more_token_ids=(12, 13, 14)),)))
    (out,) = r.handle.ready()  # max_tokens cuts the block
    assert out.token_ids == (11, 12) and out.finished and out.finish_reason == "length"
    assert r.output_token_ids == [7, 8, 9, 10, 11, 12] and not s.running
