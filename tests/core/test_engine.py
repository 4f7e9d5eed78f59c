"""The RequestEngine's actor, submission rules and blocking path, on the fake runtime."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ifb.capabilities import DeployConfig, OptionSupport, Support
from ifb.engine import EngineFull, RequestEngine, RequestRejected
from ifb.gate import UnsupportedDeployment
from ifb.options import BUILTIN_OPTIONS
from ifb.plugins import default_host
from ifb.outputs import RequestFailed
from ifb.params import InvalidRequest, RequestSpec, SamplingParams, Trajectory

from tests.core.fakes import FakeRuntime, next_token, text_caps

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def engine(runtime=None, options=BUILTIN_OPTIONS, **config):
    runtime = runtime or FakeRuntime()
    cfg = DeployConfig(enable_in_flight_batching=True, **{"max_batch_size": 4, "max_queued_requests": 4, **config})
    return RequestEngine(runtime, cfg, list(options))


def expected(prompt_ids, n):
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(next_token(tuple(ids)))
    return ids[len(prompt_ids):]


def spec(ids, **params):
    return RequestSpec(prompt_token_ids=tuple(ids), params=SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **params}))


def test_outputs_stream_and_match_single_runs():
    eng = engine()
    try:
        handles = [eng.submit(spec(range(1, 3 + i))) for i in range(6)]
        for i, h in enumerate(handles):
            out = h.result()
            assert list(out.token_ids) == expected(range(1, 3 + i), 6)
            assert out.finish_reason == "length"
        assert eng.counters.is_consistent()
        assert eng.counters.snapshot()["completed"] == 6
        eng.blocks.check_no_leaks()
    finally:
        eng.shutdown()


def test_requests_without_max_tokens_share_a_small_pool_through_preemption():
    # 64 tokens of KV; four answers of 20 tokens (then EOS) without max_tokens: they cannot all stay
    rt = FakeRuntime(num_kv_blocks=16, kv_block_size=4)
    rt.lengths.update({f"q{i}": 20 for i in range(4)})
    eng = engine(rt)
    try:
        prompts = [list(range(1, 6 + i)) for i in range(4)]
        handles = [eng.submit(RequestSpec(prompt_token_ids=tuple(p), request_id=f"q{i}",
                                          params=SamplingParams(temperature=0.0)))
                   for i, p in enumerate(prompts)]
        for p, h in zip(prompts, handles):
            outs = list(h)
            streamed = [t for o in outs for t in o.token_ids]
            assert streamed == expected(p, 19) + [0]  # each token once, as if never interrupted
            assert "".join(o.text for o in outs) == rt.tokenizer.decode(streamed)
            assert outs[-1].finish_reason == "stop"
        health = eng.health()["scheduling"]
        assert health["preempted"] > 0 and health["completed"] == 4
        assert eng.counters.is_consistent()
        eng.blocks.check_no_leaks()
    finally:
        eng.shutdown()


def test_async_iteration():
    eng = engine()

    async def consume():
        return [o async for o in eng.submit(spec([1, 2, 3]))]

    try:
        outs = asyncio.run(consume())
        assert outs[-1].finished and sum(len(o.token_ids) for o in outs) == 6
    finally:
        eng.shutdown()


def test_async_consumers_get_each_step_in_one_loop_wake_up():
    """Concurrent async streams arrive whole and in order, each step's outputs handed to the loop
    together (one call_soon_threadsafe per step, not one per token)."""
    gate = threading.Event()  # no step runs before the consumers listen
    eng = engine(FakeRuntime(gate=gate))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    wake_ups = []

    async def consume():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(callback, *args):
            wake_ups.append(len(args[0]) if args and isinstance(args[0], list) else 1)
            return real(callback, *args)

        loop.call_soon_threadsafe = counted
        handles = [eng.submit(spec(p)) for p in prompts]

        async def one(h):
            return [o async for o in h]

        tasks = [asyncio.ensure_future(one(h)) for h in handles]
        await asyncio.sleep(0.05)  # each task attaches to its handle at its first await
        gate.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    try:
        streams = asyncio.run(consume())
    finally:
        eng.shutdown()
    for p, outs in zip(prompts, streams):
        assert [t for o in outs for t in o.token_ids] == expected(p, 6)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    # 18 outputs and 3 ends, in at most 7 steps (the last two prompts may join at the second)
    assert sum(wake_ups) == 21 and len(wake_ups) <= 7


@pytest.mark.parametrize("extras,params,word", [
    ({"lora": "my-adapter"}, {}, "Per-request LoRA"),
    ({}, {"n": 2}, "More than one sequence"),
    ({"save_system_prompt_kv_cache": True}, {}, "--enable-context-reuse"),
    ({"generate_audio": True}, {}, "blocking path"),
])
def test_rejected_options_raise_at_submit_naming_the_alternative(extras, params, word):
    # the installed plugins' options too (the capture and speech output are the built-in plugins')
    eng = engine(options=default_host().request_options())
    try:
        with pytest.raises(RequestRejected, match=word):
            eng.submit(RequestSpec(prompt="hi", params=SamplingParams(**params), extras=extras))
        assert eng.counters.snapshot()["submitted"] == 0
    finally:
        eng.shutdown()


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_trajectory_to_a_model_that_plans_none_is_refused_on_either_path(in_flight):
    options = default_host().request_options()
    eng = engine(options=options) if in_flight else RequestEngine(FakeRuntime(), DeployConfig(), options, in_flight=False)
    try:
        trajectory = Trajectory.of([[0.5, 1.0]], field="messages[0].content[1].trajectory")
        with pytest.raises(RequestRejected, match="no trajectory planner") as refused:
            eng.submit(RequestSpec(prompt="hi", past_trajectory=trajectory))
        assert refused.value.param == "messages[0].content[1].trajectory"
        assert eng.counters.snapshot()["submitted"] == 0
    finally:
        eng.shutdown()


def test_invalid_requests_are_refused_with_a_reason():
    eng = engine()
    try:
        with pytest.raises(InvalidRequest, match="temperature"):
            eng.submit(spec([1], temperature=5.0))
        with pytest.raises(InvalidRequest, match="context"):
            eng.submit(spec(range(1, 600)))
        with pytest.raises(InvalidRequest, match="exactly one"):
            eng.submit(RequestSpec())
    finally:
        eng.shutdown()


def test_back_pressure_past_batch_plus_queue():
    gate = threading.Event()
    eng = engine(FakeRuntime(gate=gate), max_batch_size=2, max_queued_requests=1)
    try:
        handles = [eng.submit(spec([1, 2])) for _ in range(3)]
        with pytest.raises(EngineFull):
            eng.submit(spec([1, 2]))
        snap = eng.counters.snapshot()
        assert snap["refused"] == 1 and snap["submitted"] == 4
        gate.set()
        for h in handles:
            h.result()
        assert eng.counters.is_consistent()
    finally:
        gate.set()
        eng.shutdown()


def test_waiting_callers_block_instead_of_being_refused():
    eng = engine(FakeRuntime(step_delay=0.002), max_batch_size=1, max_queued_requests=0)
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(eng.submit(spec([1]), wait=True).result()))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 4 and eng.counters.snapshot()["refused"] == 0
    finally:
        eng.shutdown()


def test_cancel_frees_seat_and_blocks():
    gate = threading.Event()
    rt = FakeRuntime(gate=gate)
    eng = engine(rt, max_batch_size=1)
    try:
        running = eng.submit(spec([1, 2], max_tokens=100))
        queued = eng.submit(spec([3]))
        running.cancel()
        queued.cancel()
        gate.set()
        outs = list(running)
        assert outs[-1].finish_reason == "cancelled"
        assert list(queued)[-1].finish_reason == "cancelled"
        snap = eng.counters.snapshot()
        assert snap["cancelled"] == 2 and snap["resident"] == 0 and snap["queued"] == 0
        eng.blocks.check_no_leaks()
    finally:
        gate.set()
        eng.shutdown()


def test_a_fault_fails_that_step_and_the_engine_goes_on():
    rt = FakeRuntime(fail_ids={"bad"})
    eng = engine(rt)
    try:
        bad = eng.submit(RequestSpec(prompt_token_ids=(1, 2), request_id="bad", params=GREEDY))
        with pytest.raises(RequestFailed, match="injected fault"):
            bad.result()
        good = eng.submit(spec([1, 2]))
        assert list(good.result().token_ids) == expected([1, 2], 6)
        snap = eng.counters.snapshot()
        assert snap["failed"] == 1 and snap["completed"] == 1
        eng.blocks.check_no_leaks()
    finally:
        eng.shutdown()


def test_stop_strings_and_eos():
    rt = FakeRuntime(lengths={"eos": 3})
    eng = engine(rt)
    try:
        out = eng.submit(RequestSpec(prompt_token_ids=(1, 2), request_id="eos", params=GREEDY)).result()
        assert out.finish_reason == "stop" and out.num_output_tokens == 3 and len(out.text) == 2
        full = eng.submit(spec([1, 2], max_tokens=6)).result().text
        stop = full[3:5]
        out = eng.submit(spec([1, 2], max_tokens=6, stop=(stop,))).result()
        assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    finally:
        eng.shutdown()


def test_gate_refuses_unstepped_runtime_at_construction():
    rt = FakeRuntime(caps=text_caps(stepped_execution=False, notes="drain-time only"))
    with pytest.raises(UnsupportedDeployment, match="stepped execution.*drain-time only"):
        engine(rt)


def test_founder_only_option_declared_by_the_deployment():
    rt = FakeRuntime(caps=text_caps(options={
        "differing_sampling": OptionSupport(Support.SERVED),
        "lora": OptionSupport(Support.FOUNDER_ONLY, reason="adapters swap at batch start")}))
    gate = threading.Event()
    rt.gate = gate
    eng = engine(rt)
    try:
        first = eng.submit(spec([1, 2], max_tokens=3))
        lora = eng.submit(RequestSpec(prompt_token_ids=(1,), params=GREEDY, extras={"lora": "x"}))
        gate.set()
        first.result()
        lora.result()
        assert eng.counters.snapshot()["stalls_incompatible"] >= 1
    finally:
        gate.set()
        eng.shutdown()


def test_blocking_path_serves_n_and_times_out_in_queue():
    gate = threading.Event()
    rt = FakeRuntime(gate=gate)
    cfg = DeployConfig(max_queued_requests=1, queue_timeout=0.05)
    eng = RequestEngine(rt, cfg, list(BUILTIN_OPTIONS), in_flight=False)
    try:
        first = eng.submit(spec([1, 2], n=2, temperature=0.7, seed=3))
        while eng.counters.snapshot()["resident"] == 0:  # the worker took it; the queue is empty
            threading.Event().wait(0.001)
        waiting = eng.submit(spec([1]))
        with pytest.raises(EngineFull):
            eng.submit(spec([1]))
        import time
        time.sleep(0.1)
        gate.set()
        outs = list(first)
        assert {o.index for o in outs} == {0, 1} and outs[-1].finished
        timed_out = list(waiting)[-1]
        assert timed_out.finish_reason == "error" and "timed out" in timed_out.error
        snap = eng.counters.snapshot()
        assert snap["completed"] == 1 and snap["failed"] == 1 and snap["refused"] == 1
        assert eng.health() == {"in_flight_batching": False, "max_num_seqs": 1}
    finally:
        gate.set()
        eng.shutdown()


def test_blocking_path_serves_the_runtimes_finish_output_and_whole_requests():
    """One seat: ``finish_output`` replaces a finishing request's last output (lazily, at its end); a
    request prepared ``is_served_whole`` is served by ``handle_request`` and runs no step; every block
    of the engine's pool comes back."""
    import attrs

    from ifb.outputs import RequestOutput
    from ifb.runtime import Prepared

    @attrs.define
    class FinishingRuntime(FakeRuntime):
        finished: list = attrs.field(factory=list)

        def prepare(self, spec):
            prepared = super().prepare(spec)
            return attrs.evolve(prepared, state=spec.extras.get("tag"), is_served_whole=bool(spec.extras.get("whole")))

        def finish_output(self, request, output):
            self.finished.append((request.state, len(self.steps)))
            return [RequestOutput(request_id=output.request_id, text="", token_ids=(), audio_chunk=b"x"),
                    attrs.evolve(output, num_output_tokens=99)]

        def handle_request(self, spec, request):
            yield RequestOutput(request_id=request.request_id, text="whole", token_ids=(), finished=True,
                                finish_reason="stop")

    rt = FinishingRuntime()
    eng = RequestEngine(rt, DeployConfig(), list(BUILTIN_OPTIONS), in_flight=False)
    try:
        handle = eng.submit(RequestSpec(prompt_token_ids=(1, 2, 3), params=SamplingParams(max_tokens=4, temperature=0),
                                        extras={"tag": "a"}))
        outs = list(handle)
        assert [o.audio_chunk for o in outs[-2:]] == [b"x", b""] and outs[-1].num_output_tokens == 99
        assert tuple(t for o in outs for t in o.token_ids) == tuple(expected([1, 2, 3], 4))
        assert rt.finished == [("a", len(rt.steps))]  # called once, after the request's last step
        num_steps = len(rt.steps)
        whole = eng.submit(RequestSpec(prompt_token_ids=(1, 2), params=GREEDY, extras={"whole": True})).result()
        assert whole.text == "whole" and len(rt.steps) == num_steps and len(rt.finished) == 1
        assert eng.blocks.num_free == rt.num_kv_blocks
        assert eng.counters.snapshot()["completed"] == 2
    finally:
        eng.shutdown()
