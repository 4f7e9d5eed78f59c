"""Drive an OpenAI-compatible server with a workload over streaming HTTP and time every request."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import attrs
import httpx

from ifb.bench.workloads import PlannedRequest, Workload

Endpoint = Literal["completions", "chat"]

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(RuntimeError):
    """The benchmark cannot run against this target (unreachable, no model...)."""


@attrs.frozen
class Target:
    """Where and how requests are sent."""

    base_url: str
    endpoint: Endpoint = "completions"
    model: str | None = None
    api_key: str | None = None
    #: seconds a single request may take before it counts as an error
    request_timeout: float = 600.0

    @property
    def url(self) -> str:
        return _api_root(self.base_url) + PATHS[self.endpoint]


@attrs.define
class RequestResult:
    """What one request measured; times are seconds since the start of the run."""

    index: int
    max_tokens: int | None
    send_time: float
    end_time: float = 0.0
    #: when each chunk that carried text arrived
    chunk_times: list[float] = attrs.field(factory=list)
    #: from the server's usage report, when it sent one
    usage_tokens: int | None = None
    #: HTTP status (200 when the stream opened), or None when no response came
    status: int | None = None
    #: None on success, else a short reason ("http 429", "ReadTimeout", "stream error: ...")
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def inter_token_latencies(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]


def _api_root(base_url: str) -> str:
    # Accept both http://host:port and http://host:port/v1, as OpenAI clients do.
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _headers(target: Target) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def build_payload(planned: PlannedRequest, target: Target, model: str, ignore_eos: bool) -> dict:
    """The JSON body of one streaming request (greedy, usage reported at the end)."""
    body: dict = {"model": model, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if planned.max_tokens is not None:
        body["max_tokens"] = planned.max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        messages = [{"role": "user", "content": planned.prompt}]
        if planned.system is not None:
            messages.insert(0, {"role": "system", "content": planned.system})
        body["messages"] = messages
    else:
        body["prompt"] = planned.prompt if planned.system is None else f"{planned.system}\n\n{planned.prompt}"
    return body


def _chunk_text(chunk: dict, endpoint: Endpoint) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def _send(client: httpx.AsyncClient, target: Target, model: str, planned: PlannedRequest,
                ignore_eos: bool, origin: float) -> RequestResult:
    payload = build_payload(planned, target, model, ignore_eos)
    result = RequestResult(index=planned.index, max_tokens=planned.max_tokens,
                           send_time=time.perf_counter() - origin)
    try:
        async with client.stream("POST", target.url, json=payload, headers=_headers(target)) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                result.error = f"http {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - origin
                try:
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        error = chunk["error"]
                        result.error = f"stream error: {error.get('message') if isinstance(error, dict) else error}"
                        break
                    if _chunk_text(chunk, target.endpoint):
                        result.chunk_times.append(now)
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        result.usage_tokens = int(usage["completion_tokens"])
                except (ValueError, TypeError, AttributeError):  # not JSON, or not shaped like a chunk
                    result.error = "stream error: malformed chunk"
                    break
            else:
                if result.error is None:
                    result.error = "stream ended without [DONE]"
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    finally:
        result.end_time = time.perf_counter() - origin
    return result


async def resolve_model(target: Target) -> str:
    """``target.model``, or the first model the server lists at ``/v1/models``."""
    if target.model:
        return target.model
    url = _api_root(target.base_url) + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(url, headers=_headers(target))
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {url}: {type(exc).__name__} {exc}".strip()) from None
    if response.status_code != 200:
        raise BenchError(f"GET {url} answered {response.status_code}; pass --model (and --api-key if needed)")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {url} listed no model; pass --model") from None


@attrs.frozen
class RunRecord:
    """A finished run: every request's result and the run's wall clock."""

    target: Target
    model: str
    workload: Workload
    results: tuple[RequestResult, ...]
    #: seconds from the first send to the last finish
    wall_time: float
    started_at: float  # Unix time


async def run_workload(target: Target, workload: Workload, *, progress: bool = True) -> RunRecord:
    """Send ``workload`` to ``target`` and collect one ``RequestResult`` per planned request."""
    from tqdm import tqdm

    model = await resolve_model(target)
    planned = workload.plan()
    bar = tqdm(total=len(planned), desc=f"{workload.name} -> {target.base_url}", unit="req",
               disable=not progress, dynamic_ncols=True, leave=False)
    num_errors = 0
    # An open loop must never wait on the pool: each arrival gets its own connection.
    limit = None if workload.is_open_loop else workload.concurrency
    timeout = httpx.Timeout(target.request_timeout, connect=30.0)
    results: list[RequestResult] = []

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit,
                                                                      max_keepalive_connections=limit)) as client:
        started_at = time.time()
        origin = time.perf_counter()

        async def one(item: PlannedRequest) -> None:
            nonlocal num_errors
            result = await _send(client, target, model, item, workload.ignore_eos, origin)
            results.append(result)
            num_errors += not result.is_ok
            bar.update(1)
            if num_errors:
                bar.set_postfix(errors=num_errors)

        try:
            if workload.is_open_loop:
                tasks = []
                for item in planned:
                    delay = item.send_at - (time.perf_counter() - origin)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(item)))
                await asyncio.gather(*tasks)
            else:
                queue = iter(planned)

                async def client_loop() -> None:
                    for item in queue:  # clients share one iterator: each takes the next request
                        await one(item)

                await asyncio.gather(*(client_loop() for _ in range(workload.concurrency)))
        finally:
            bar.close()

    results.sort(key=lambda r: r.index)
    first_send = min(r.send_time for r in results)
    last_end = max(r.end_time for r in results)
    return RunRecord(target=target, model=model, workload=workload, results=tuple(results),
                     wall_time=last_end - first_send, started_at=started_at)


def run(target: Target, workload: Workload, *, progress: bool = True) -> RunRecord:
    """Synchronous ``run_workload``."""
    return asyncio.run(run_workload(target, workload, progress=progress))
