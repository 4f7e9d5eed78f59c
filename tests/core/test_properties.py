"""Random arrivals, cancellations, faults and finish lengths: the bookkeeping always adds up."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ifb.counters import SchedulingCounters
from ifb.engine import new_request
from ifb.kv import BlockManager
from ifb.params import RequestSpec, SamplingParams
from ifb.request import Status
from ifb.scheduler import Scheduler

from tests.core.fakes import FakeRuntime

arrival = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(1, 12)),  # forced finish length (EOS)
    st.booleans(),  # fails in its steps
)
event = st.one_of(
    st.tuples(st.just("arrive"), arrival),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(event, min_size=1, max_size=60), seats=st.integers(1, 4),
       budget=st.integers(4, 24), num_blocks=st.integers(8, 40))
def test_counters_blocks_and_fcfs_hold_at_every_boundary(events, seats, budget, num_blocks):
    budget = max(budget, seats)
    rt = FakeRuntime(num_kv_blocks=num_blocks, kv_block_size=4)
    counters = SchedulingCounters()
    blocks = BlockManager(num_blocks, 4)
    s = Scheduler(num_seats=seats, token_budget=budget, blocks=blocks, tokenizer=rt.tokenizer,
                  max_model_len=rt.max_model_len, counters=counters)
    submitted, admitted_order = [], []

    def boundary():
        step = s.schedule()
        for r in s.running:
            if r.request_id not in admitted_order:
                admitted_order.append(r.request_id)
        check()
        if step is None:
            return
        try:
            s.update(step, rt.execute(step))
        except RuntimeError as exc:
            s.fail_step(step, exc)
        check()

    def check():
        assert counters.is_consistent()
        snap = counters.snapshot()
        assert snap["submitted"] == len(submitted)
        assert snap["queued"] == len(s.waiting) and snap["resident"] == len(s.running) <= seats
        held = sum(len(r.block_ids) for r in s.running)
        assert sum(blocks.ref_counts) == held
        assert blocks.num_free == num_blocks - held
        seats_used = [r.seat for r in s.running]
        assert len(set(seats_used)) == len(seats_used)

    for kind, arg in events:
        if kind == "arrive":
            num_prompt, max_tokens, forced, fails = arg
            name = f"r{len(submitted)}" + ("x" if fails else "")
            if fails:
                rt.fail_ids.add(name)
            if forced is not None:
                rt.lengths[name] = forced
            spec = RequestSpec(prompt_token_ids=tuple(range(1, num_prompt + 1)), request_id=name,
                               params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
            request = new_request(rt, spec)
            submitted.append(request)
            with counters.lock:
                counters.submitted += 1
            s.add(request)
        elif kind == "cancel" and submitted:
            submitted[arg % len(submitted)].handle.cancel()
        elif kind == "step":
            for _ in range(arg):
                boundary()
    for _ in range(2000):
        if not s.has_work:
            break
        boundary()
    assert not s.has_work
    blocks.check_no_leaks()
    assert all(r.status is Status.FINISHED and r.handle.done.is_set() for r in submitted)
    # FCFS: requests were seated in arrival order (cancelled-while-queued ones never were)
    arrival_index = {r.request_id: i for i, r in enumerate(submitted)}
    assert admitted_order == sorted(admitted_order, key=arrival_index.get)
