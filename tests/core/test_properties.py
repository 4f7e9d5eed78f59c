"""Random arrivals, cancellations, faults and finish lengths, under KV pools small enough to preempt:
the bookkeeping always adds up."""

from __future__ import annotations

from hypothesis import event as note_event, given, settings
from hypothesis import strategies as st

from ifb.counters import SchedulingCounters
from ifb.engine import new_request
from ifb.kv import BlockManager, WindowGroup
from ifb.params import RequestSpec, SamplingParams
from ifb.request import Status
from ifb.scheduler import Scheduler

from tests.core.fakes import EOS, FakeRuntime, next_token

arrival = st.tuples(
    st.integers(1, 30),  # prompt length
    st.one_of(st.none(), st.integers(1, 24)),  # max_tokens (None: up to the context, a cap)
    st.one_of(st.none(), st.integers(1, 12)),  # forced finish length (EOS)
    st.booleans(),  # fails in its steps
)
event = st.one_of(
    st.tuples(st.just("arrive"), arrival),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


#: long answers into a tiny pool: residents outgrow it and are preempted
long_arrival = st.tuples(
    st.integers(1, 10),
    st.one_of(st.none(), st.integers(8, 40)),
    st.one_of(st.none(), st.none(), st.integers(4, 30)),
    st.sampled_from([False] * 9 + [True]),
)
crowded = st.one_of(
    st.tuples(st.just("arrive"), long_arrival),
    st.tuples(st.just("arrive"), long_arrival),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 6)),
)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(event, min_size=1, max_size=60), seats=st.integers(1, 5),
       budget=st.integers(4, 24), num_blocks=st.integers(8, 40), watermark=st.integers(0, 2))
def test_counters_blocks_and_fcfs_hold_at_every_boundary(events, seats, budget, num_blocks, watermark):
    run_events(events, seats, budget, num_blocks, watermark)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(crowded, min_size=4, max_size=40), seats=st.integers(2, 5),
       budget=st.integers(4, 24), num_blocks=st.integers(4, 12), watermark=st.integers(0, 1))
def test_preemption_under_a_tiny_pool_keeps_fcfs_blocks_counters_and_outputs(events, seats, budget, num_blocks,
                                                                            watermark):
    run_events(events, seats, budget, num_blocks, watermark)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(crowded, min_size=4, max_size=40), seats=st.integers(1, 5),
       budget=st.integers(4, 24), num_blocks=st.integers(4, 16), watermark=st.integers(0, 1),
       window=st.integers(1, 9), num_window_blocks=st.integers(4, 16))
def test_a_sliding_window_group_stays_bounded_and_frees_everything(events, seats, budget, num_blocks, watermark,
                                                                  window, num_window_blocks):
    """With a window group beside the pool (either may be the one that runs short): every request's window
    table has as many entries as its full one, holds at most ``max_blocks_per_seq`` of the step's share, and
    every block of both pools comes back."""
    run_events(events, seats, budget, num_blocks, watermark, WindowGroup(window, BlockManager(num_window_blocks, 4)))


def run_events(events, seats, budget, num_blocks, watermark, window: WindowGroup | None = None):
    """Play ``events`` against a scheduler, checking the invariants at every boundary and at the end."""
    budget = max(budget, seats)
    rt = FakeRuntime(num_kv_blocks=num_blocks, kv_block_size=4)
    counters = SchedulingCounters()
    blocks = BlockManager(num_blocks, 4, window_groups=(window,) if window else ())
    s = Scheduler(num_seats=seats, token_budget=budget, blocks=blocks, tokenizer=rt.tokenizer,
                  max_model_len=rt.max_model_len, counters=counters, watermark=watermark)
    submitted, admitted_order = [], []
    arrival_index: dict[str, int] = {}
    streamed: dict[str, list[int]] = {}

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
        for r in submitted:
            streamed.setdefault(r.request_id, []).extend(t for out in r.handle.ready() for t in out.token_ids)
        check()

    def check():
        assert counters.is_consistent()
        snap = counters.snapshot()
        assert snap["submitted"] == len(submitted)
        assert snap["queued"] == len(s.waiting) and snap["resident"] == len(s.running) <= seats
        held = sum(len(r.block_ids) for r in s.running)
        assert sum(blocks.ref_counts) == held
        assert blocks.num_free == num_blocks - held
        if window is not None:
            tables = [r.window_tables[0] for r in s.running]
            assert all(t.num_entries == len(r.block_ids) for t, r in zip(tables, s.running))
            assert all(len(t.block_ids) <= window.max_blocks_per_seq(budget) for t in tables)
            assert sum(window.blocks.ref_counts) == sum(len(t.block_ids) for t in tables)
        seats_used = [r.seat for r in s.running]
        assert len(set(seats_used)) == len(seats_used)
        assert all(not r.block_ids and r.seat is None for r in s.waiting)
        # FCFS, preemption included: residents in admission order, all of them ahead of the queue,
        # and the queue (preempted requests at its head) in arrival order
        order = [arrival_index[r.request_id] for r in (*s.running, *s.waiting)]
        assert order == sorted(order)
        assert snap["preempted"] == sum(r.num_preemptions for r in submitted)

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
            arrival_index[name] = len(submitted)
            submitted.append(request)
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
    note_event("preempted" if counters.preempted else "not preempted")
    blocks.check_no_leaks()
    assert all(r.status is Status.FINISHED and r.handle.done.is_set() for r in submitted)
    # FCFS: requests were first seated in arrival order (cancelled-while-queued ones never were)
    assert admitted_order == sorted(admitted_order, key=arrival_index.get)
    for r in submitted:
        # each token streamed once, and preempted or not, the output is the uninterrupted one
        assert streamed.get(r.request_id, []) == r.output_token_ids
        history = list(r.prompt_token_ids)
        for token in r.output_token_ids:
            expected = next_token(tuple(history))
            assert token == expected or (token == EOS and r.request_id in rt.lengths)
            history.append(token)
