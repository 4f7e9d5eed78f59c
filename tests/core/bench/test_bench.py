"""The bench driver against a fake OpenAI SSE server; the stats and workloads on known inputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import attrs
import numpy as np
import pytest
import uvicorn
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ifb.bench.cli import bench
from ifb.bench.driver import RequestResult, RunRecord, Target, build_payload, run
from ifb.bench.plot import has_matplotlib
from ifb.bench.stats import latency_summary, percentile, report, summarize, throughput_timeline
from ifb.bench.workloads import (BUILTIN, LengthBand, Workload, WorkloadError, load_workload,
                                 workload_from_dict, workload_to_dict)

REPO = Path(__file__).resolve().parents[3]


@attrs.define
class FakeOpenAI:
    """Streams ``max_tokens`` one-word chunks with a small sleep; the first ``num_rejects`` requests get 429."""

    num_rejects: int = 0
    chunk_sleep: float = 0.002
    api_key: str | None = None
    #: after this many chunks, send an error event instead of the rest
    fail_after: int | None = None
    bodies: list[dict] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
        ])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: Request):
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        with self.lock:
            self.bodies.append(body)
            rejected = len(self.bodies) <= self.num_rejects
        if rejected:
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429)
        is_chat = request.url.path.endswith("/chat/completions")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            if is_chat:  # the role-only delta carries no token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.chunk_sleep)
                if i == self.fail_after:
                    yield _sse({"error": {"message": "boom", "type": "server_error"}})
                    return
                piece = {"delta": {"content": f" w{i}"}} if is_chat else {"text": f" w{i}"}
                yield _sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
            if include_usage:
                yield _sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": body["max_tokens"],
                                                     "total_tokens": 5 + body["max_tokens"]}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


@contextlib.contextmanager
def serving(fake: FakeOpenAI) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    server = FakeOpenAI()
    with serving(server) as url:
        yield server, url


def small(**changes) -> Workload:
    base = Workload(name="small", kind="fixed", num_requests=6, concurrency=3,
                    output_lengths=(LengthBand(1.0, 5, 5),), prompt_words=(4, 4))
    return attrs.evolve(base, **changes)


# ---- stats ----

def test_percentile_interpolates_between_ranks():
    values = list(range(1, 101))
    random.Random(3).shuffle(values)
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    data = [random.Random(5).expovariate(2.0) for _ in range(37)]
    for q in (50, 90, 99):
        assert percentile(data, q) == pytest.approx(np.percentile(data, q))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_summary_scales_to_ms_and_handles_no_values():
    summary = latency_summary([0.1, 0.2, 0.3, 0.4])
    assert summary["p50"] == pytest.approx(250.0)
    assert summary["mean"] == pytest.approx(250.0)
    assert summary["p99"] == pytest.approx(397.0)
    assert latency_summary([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_summarize_known_timings():
    ok_a = RequestResult(index=0, max_tokens=3, send_time=0.0, end_time=1.0, chunk_times=[0.2, 0.5, 0.9],
                         usage_tokens=3, status=200)
    ok_b = RequestResult(index=1, max_tokens=4, send_time=1.0, end_time=2.0, chunk_times=[1.4, 1.6],
                         usage_tokens=None, status=200)  # no usage: counted from chunks (2, short of 4)
    failed = RequestResult(index=2, max_tokens=3, send_time=0.5, end_time=0.6, status=429, error="http 429")
    record = RunRecord(target=Target("http://x"), model="m", workload=small(), results=(ok_a, ok_b, failed),
                       wall_time=2.0, started_at=0.0)
    summary = summarize(record)
    assert summary["num_ok"] == 2 and summary["num_errors"] == 1
    assert summary["errors"] == {"http 429": 1}
    assert summary["output_tokens"] == 5
    assert summary["output_tokens_per_s"] == pytest.approx(2.5)
    assert summary["requests_per_s"] == pytest.approx(1.0)
    assert summary["num_length_mismatch"] == 1
    assert summary["ttft_ms"]["p50"] == pytest.approx(300.0)  # TTFTs 200 and 400 ms
    assert summary["e2e_ms"]["mean"] == pytest.approx(1000.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(300.0)  # ITLs 300, 400, 200 ms
    timeline = throughput_timeline(record, bin_s=1.0)
    assert timeline["tokens_per_s"] == [3.0, 2.0]
    # the last first token is ok_b's at 1.4 s: ok_a's 3 tokens and one of ok_b's 2 chunks came by then
    drain = summary["before_drain"]
    assert drain["window_s"] == pytest.approx(1.4)
    assert drain["output_tokens"] == pytest.approx(4.0)
    assert drain["output_tokens_per_s"] == pytest.approx(4.0 / 1.4)


def test_before_drain_spreads_a_request_s_tokens_over_its_chunks():
    # 6 tokens in 3 chunks (the server merged pairs): 2 chunks by the last first token are 4 tokens
    merged = RequestResult(index=0, max_tokens=6, send_time=0.0, end_time=3.0, chunk_times=[0.5, 1.0, 2.5],
                           usage_tokens=6, status=200)
    late = RequestResult(index=1, max_tokens=2, send_time=0.5, end_time=2.2, chunk_times=[2.0, 2.1],
                         usage_tokens=2, status=200)
    never = RequestResult(index=2, max_tokens=3, send_time=0.2, end_time=9.0, status=200, error="ReadTimeout")
    record = RunRecord(target=Target("http://x"), model="m", workload=small(), results=(merged, late, never),
                       wall_time=9.0, started_at=0.0)
    drain = summarize(record)["before_drain"]
    assert drain["window_s"] == pytest.approx(2.0)  # a failed request's send still counts, its chunks do not
    assert drain["output_tokens"] == pytest.approx(4.0 + 1.0)
    assert drain["output_tokens_per_s"] == pytest.approx(2.5)
    empty = RunRecord(target=Target("http://x"), model="m", workload=small(), results=(never,),
                      wall_time=9.0, started_at=0.0)
    assert summarize(empty)["before_drain"] == {"window_s": None, "output_tokens": None,
                                                "output_tokens_per_s": None}


# ---- workloads ----

def test_skewed_workload_is_deterministic_for_a_seed():
    skewed = attrs.evolve(BUILTIN["skewed"], num_requests=400)
    first, again = skewed.plan(), skewed.plan()
    assert first == again
    assert skewed.with_overrides(seed=1).plan() != first
    lengths = [p.max_tokens for p in first]
    assert all(8 <= n <= 32 or 256 <= n <= 768 for n in lengths)
    assert 0.1 < sum(n >= 256 for n in lengths) / len(lengths) < 0.3
    gaps = np.diff([p.send_at for p in first])
    assert (gaps >= 0).all()
    assert np.mean(gaps) == pytest.approx(1 / skewed.rate, rel=0.2)
    assert len({len(p.prompt.split()) for p in first}) > 20  # varied prompt lengths
    # changing the rate moves arrivals only, not prompts or lengths
    faster = skewed.with_overrides(rate=10.0).plan()
    assert [(p.prompt, p.max_tokens) for p in faster] == [(p.prompt, p.max_tokens) for p in first]


def test_shared_prefix_and_overrides():
    planned = BUILTIN["shared_prefix"].plan()
    assert len({p.system for p in planned}) == 1 and len(planned[0].system.split()) > 400
    assert len({p.prompt for p in planned}) == len(planned)
    fixed = BUILTIN["skewed"].with_overrides(concurrency=2, max_tokens=7)
    assert not fixed.is_open_loop and {p.max_tokens for p in fixed.plan()} == {7}
    assert all(p.send_at is None for p in fixed.plan())


def test_workload_json_round_trip_and_errors(tmp_path):
    for workload in BUILTIN.values():
        assert workload_from_dict(json.loads(json.dumps(workload_to_dict(workload)))) == workload
    path = tmp_path / "w.json"
    path.write_text(json.dumps({**workload_to_dict(BUILTIN["fixed"]), "num_requests": 0}))
    with pytest.raises(WorkloadError, match="num_requests must be at least 1"):
        load_workload(str(path))
    path.write_text(json.dumps({**workload_to_dict(BUILTIN["fixed"]), "typo": 1}))
    with pytest.raises(WorkloadError, match="typo"):
        load_workload(str(path))
    with pytest.raises(WorkloadError, match="neither a built-in"):
        load_workload(str(tmp_path / "missing.json"))


def test_benchmark_workload_files_load():
    files = sorted((REPO / "benchmarks" / "workloads").glob("*.json"))
    assert files, "benchmarks/workloads holds no workload"
    for path in files:
        assert load_workload(str(path)).name == path.stem


def test_payload_fields():
    planned = BUILTIN["shared_prefix"].plan()[0]
    chat = build_payload(planned, Target("http://x", endpoint="chat"), "m", ignore_eos=False)
    assert chat["messages"][0] == {"role": "system", "content": planned.system}
    assert "ignore_eos" not in chat and chat["stream"] is True and chat["temperature"] == 0
    text = build_payload(planned, Target("http://x"), "m", ignore_eos=True)
    assert text["prompt"].startswith(planned.system) and text["ignore_eos"] is True
    assert text["stream_options"] == {"include_usage": True}


# ---- the driver against the fake server ----

def test_closed_loop_counts_and_errors(fake):
    server, url = fake
    server.num_rejects = 2
    record = run(Target(url), small(), progress=False)
    summary = summarize(record)
    assert summary["num_requests"] == 6 and summary["num_ok"] == 4
    assert summary["errors"] == {"http 429": 2}
    assert summary["output_tokens"] == 4 * 5
    assert all(len(r.chunk_times) == 5 for r in record.results if r.is_ok)
    assert all(r.ttft > 0 and r.e2e >= r.ttft for r in record.results if r.is_ok)
    assert summary["itl_ms"]["p50"] > 0 and summary["num_length_mismatch"] == 0
    assert record.model == "fake-model"
    assert all(b["model"] == "fake-model" and b["ignore_eos"] and b["stream"] for b in server.bodies)


def test_open_loop_chat_with_api_key(fake):
    server, url = fake
    server.api_key = "sekrit"
    workload = small(rate=200.0, num_requests=5, ignore_eos=False)
    record = run(Target(url + "/v1", endpoint="chat", model="chosen", api_key="sekrit"), workload,
                 progress=False)
    assert [r.error for r in record.results] == [None] * 5
    assert [r.output_tokens for r in record.results] == [5] * 5
    assert all(len(r.chunk_times) == 5 for r in record.results)  # the role-only delta is not a token
    assert all(b["model"] == "chosen" and "ignore_eos" not in b and "messages" in b for b in server.bodies)
    sends = [r.send_time for r in record.results]
    assert sends == sorted(sends)


def test_error_event_in_stream_counts_as_error(fake):
    server, url = fake
    server.fail_after = 2
    record = run(Target(url), small(num_requests=3), progress=False)
    assert [r.error for r in record.results] == ["stream error: boom"] * 3
    assert all(r.status == 200 and len(r.chunk_times) == 2 for r in record.results)
    assert summarize(record)["errors"] == {"stream error: boom": 3}


def test_unreachable_server_is_reported_per_request():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    record = run(Target(f"http://127.0.0.1:{port}", model="m"), small(num_requests=2), progress=False)
    assert all(r.error == "ConnectError" and r.status is None for r in record.results)
    assert summarize(record)["output_tokens_per_s"] == 0


def test_cli_writes_json_and_plot(fake, tmp_path):
    _, url = fake
    out, plot = tmp_path / "r" / "results.json", tmp_path / "plot.png"
    args = ["--base-url", url, "--workload", "fixed", "--num-requests", "4", "--concurrency", "2",
            "--max-tokens", "6", "--out", str(out), "--no-progress"]
    if has_matplotlib():
        args += ["--plot", str(plot)]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "tok/s" in result.output
    data = json.loads(out.read_text())
    assert data["target"]["base_url"] == url and data["target"]["model"] == "fake-model"
    assert data["workload"]["name"] == "fixed" and data["workload"]["num_requests"] == 4
    assert data["summary"]["output_tokens"] == 24 and data["summary"]["num_errors"] == 0
    assert len(data["requests"]) == 4 and data["timeline"]["tokens_per_s"]
    if has_matplotlib():
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_bad_input(tmp_path):
    result = CliRunner().invoke(bench, ["--workload", str(tmp_path / "nope.json")])
    assert result.exit_code == 2 and "neither a built-in" in result.output
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    result = CliRunner().invoke(bench, ["--base-url", f"http://127.0.0.1:{port}", "--no-progress"])
    assert result.exit_code == 1 and "cannot reach" in result.output and "Traceback" not in result.output


def test_report_is_json_serialisable(fake):
    _, url = fake
    record = run(Target(url), small(num_requests=2), progress=False)
    data = report(record)
    assert workload_from_dict(json.loads(json.dumps(data))["workload"]) == small(num_requests=2)
