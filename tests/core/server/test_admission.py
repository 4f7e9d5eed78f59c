"""Admission (429), engine faults (500 / error event) and client disconnects, on the fake runtime."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.core.fakes import FakeRuntime, text_caps
from tests.core.server.conftest import ENDPOINTS, served, settle, wait_for

LONG = {"prompt": "hello", "max_tokens": 200, "temperature": 0}


def runtime(**fields) -> FakeRuntime:
    return FakeRuntime(caps=text_caps(endpoints=dict(ENDPOINTS)), **fields)


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=10)


def in_system(deployment) -> int:
    snap = deployment.engine.counters.snapshot()
    return snap["queued"] + snap["resident"]


def test_full_engine_refuses_at_once_under_the_flag():
    gate = threading.Event()
    with served(runtime=runtime(gate=gate), max_batch_size=2, max_queued_requests=2) as (url, deployment):
        with ThreadPoolExecutor(4) as pool:
            held = [pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                timeout=10) for _ in range(4)]
            wait_for(lambda: in_system(deployment) == 4)
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "engine_full"
            assert "full" in refused.json()["error"]["message"]
            gate.set()
            assert [f.result().status_code for f in held] == [200] * 4
        snap = settle(deployment)
    # the HTTP gate answered 429 before the engine was asked: the engine's refused stays 0 (spec)
    assert snap["refused"] == 0 and snap["submitted"] == 4 and snap["completed"] == 4


def test_default_path_queue_overflow_is_429():
    gate = threading.Event()
    with served(in_flight=False, runtime=runtime(gate=gate), max_queued_requests=2) as (url, deployment):
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                timeout=10)
            wait_for(lambda: deployment.engine.counters.snapshot()["resident"] == 1)
            queued = [pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2},
                                  timeout=10) for _ in range(2)]
            wait_for(lambda: deployment.engine.counters.snapshot()["queued"] == 2)
            overflow = httpx.post(f"{url}/v1/completions", json={"prompt": "c", "max_tokens": 2})
            assert overflow.status_code == 429
            gate.set()
            assert [f.result().status_code for f in (first, *queued)] == [200] * 3
        settle(deployment)


@pytest.mark.parametrize("stream", [False, True])
def test_default_path_queue_timeout_is_429(stream):
    gate = threading.Event()
    with served(in_flight=False, runtime=runtime(gate=gate), queue_timeout=0.1) as (url, deployment):
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                timeout=10)
            wait_for(lambda: deployment.engine.counters.snapshot()["resident"] == 1)
            late = pool.submit(httpx.post, f"{url}/v1/completions",
                               json={"prompt": "b", "max_tokens": 2, "stream": stream}, timeout=10)
            wait_for(lambda: deployment.engine.counters.snapshot()["queued"] == 1)
            threading.Event().wait(0.3)  # longer than the queue timeout
            gate.set()
            assert first.result().status_code == 200
            response = late.result()
        assert response.status_code == 429
        assert "timed out" in response.json()["error"]["message"]
        assert settle(deployment)["failed"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_failed_request_before_any_output_is_500(stream):
    with served(runtime=runtime(fail_ids={"req"})) as (url, deployment):
        response = httpx.post(f"{url}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "x"}], "stream": stream})
        assert response.status_code == 500
        assert "injected fault" in response.json()["error"]["message"]
        assert settle(deployment)["failed"] == 1


class FailsLater(FakeRuntime):
    """Fails a step once a request in it has three output tokens."""

    def execute(self, step):
        out = super().execute(step)
        seats = [self.seats.seats[seq.request_id] for seq in step.seqs]
        if any(len(seat.all_token_ids) - seat.num_prompt_tokens >= 3 for seat in seats):
            raise RuntimeError("late fault")
        return out


def test_failure_mid_stream_sends_an_error_event_then_done():
    flaky = FailsLater(caps=text_caps(endpoints=dict(ENDPOINTS)))
    with served(runtime=flaky) as (url, deployment):
        with httpx.stream("POST", f"{url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x"}], "stream": True,
                                "max_tokens": 20}) as response:
            assert response.status_code == 200
            events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert "late fault" in events[-2] and events[-2].startswith('data: {"error"')
        assert len(events) == 1 + 3 + 2  # role, three tokens, error, [DONE]
        stream = oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                  stream=True, max_tokens=20)
        with pytest.raises(openai.APIError, match="late fault"):
            list(stream)
        assert settle(deployment)["failed"] == 2


@pytest.mark.parametrize("in_flight", [True, False])
def test_disconnect_mid_stream_cancels_and_frees_the_seat(in_flight):
    with served(in_flight=in_flight, runtime=runtime(step_delay=0.01)) as (url, deployment):
        stream = oai(url).completions.create(model="fake", stream=True, **LONG)
        for _, chunk in zip(range(3), stream):
            assert chunk.choices[0].text
        stream.close()
        wait_for(lambda: deployment.engine.counters.snapshot()["cancelled"] == 1)
        snap = settle(deployment)
    assert snap["resident"] == 0 and snap["completed"] == 0


def test_disconnect_while_waiting_for_a_whole_reply_cancels():
    with served(runtime=runtime(step_delay=0.01)) as (url, deployment):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(10, read=0.3))
        wait_for(lambda: deployment.engine.counters.snapshot()["cancelled"] == 1)
        assert settle(deployment)["completed"] == 0


def e2e_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "ifb_e2e_request_latency_seconds")
    return next(s.value for s in family.samples if s.name.endswith("_count"))


def test_disconnect_while_queued_cancels_at_the_next_boundary():
    gate = threading.Event()
    with served(runtime=runtime(gate=gate), max_batch_size=1, max_queued_requests=2) as (url, deployment):
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                timeout=10)
            wait_for(lambda: in_system(deployment) == 1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": 2, "stream": True},
                           timeout=httpx.Timeout(10, read=0.3))
            # the server has seen the client leave once it closed the request's timer
            wait_for(lambda: e2e_count(url) == 1)
            assert in_system(deployment) == 2  # still queued: the engine is held mid-step
            gate.set()
            assert first.result().status_code == 200
        wait_for(lambda: deployment.engine.counters.snapshot()["cancelled"] == 1)
        assert settle(deployment)["completed"] == 1


class SlowPrepare(FakeRuntime):
    """prepare() (tokenization) blocks until released, to show it runs off the event loop."""

    entered = threading.Event()
    proceed = threading.Event()

    def prepare(self, spec):
        self.entered.set()
        assert self.proceed.wait(10)
        return super().prepare(spec)


def test_tokenization_runs_off_the_event_loop():
    slow = SlowPrepare(caps=text_caps(endpoints=dict(ENDPOINTS)))
    with served(runtime=slow) as (url, deployment):
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2},
                                  timeout=10)
            assert slow.entered.wait(5)
            assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
            slow.proceed.set()
            assert pending.result().status_code == 200


def test_a_failed_send_cancels_the_stream():
    """Servers speaking ASGI 2.4 raise OSError on a send to a client that left."""
    import anyio

    from ifb.outputs import RequestHandle
    from ifb.server.openai_routes import EventStream

    handle = RequestHandle("r")
    closed = []

    async def events():
        try:
            while True:
                yield b"data: {}\n\n"
        finally:
            closed.append(True)

    async def receive():
        await anyio.sleep_forever()

    sent = []

    async def send(message):
        if len(sent) == 2:
            raise OSError("connection reset")
        sent.append(message)

    anyio.run(EventStream(events(), handle), {"type": "http"}, receive, send)
    assert handle.cancelled.is_set() and closed == [True]
    assert sent[0]["type"] == "http.response.start"
