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


def test_no_kv_room_is_a_capacity_stall_and_a_lone_founder_is_clamped():
    rt = FakeRuntime()
    s = scheduler(rt, seats=4, budget=32, blocks=6)  # 24 tokens of KV
    a = make(rt, "a", 4, max_tokens=12)  # needs 16 tokens = 4 blocks
    s.add(a)
    run_step(s, s.schedule())
    b = make(rt, "b", 4, max_tokens=12)
    s.add(b)
    s.schedule()
    assert s.exclusions == {"b": "stalls_no_capacity"}
    assert s.counters.stalls["stalls_no_capacity"] == 1

    big = make(rt, "big", 8, max_tokens=100)  # cannot fit even alone: founds with a clamped length
    s2 = scheduler(rt, seats=2, budget=32, blocks=6)
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
