"""Aggregate a run's request results: throughput, latency percentiles, errors, a timeline."""

from __future__ import annotations

import collections
import math
from typing import Iterable, Sequence

import attrs

from ifb.bench.driver import RunRecord
from ifb.bench.workloads import workload_to_dict

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be between 0 and 100")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99 and mean of ``values`` (seconds), scaled (default: to milliseconds)."""
    keys = [f"p{q}" for q in QUANTILES] + ["mean"]
    if not values:
        return dict.fromkeys(keys)
    summary = {f"p{q}": percentile(values, q) * scale for q in QUANTILES}
    summary["mean"] = sum(values) / len(values) * scale
    return summary


def throughput_timeline(record: RunRecord, bin_s: float | None = None) -> dict:
    """Generated tokens per second over the run, in equal time bins (from streamed chunks)."""
    times = [t for r in record.results if r.is_ok for t in r.chunk_times]
    start = min((r.send_time for r in record.results), default=0.0)
    span = max(record.wall_time, 1e-9)
    bin_s = bin_s or _nice_bin(span)
    num_bins = max(1, math.ceil(span / bin_s))
    counts = [0] * num_bins
    for t in times:
        counts[min(num_bins - 1, int((t - start) / bin_s))] += 1
    return {"bin_s": bin_s, "tokens_per_s": [c / bin_s for c in counts]}


def before_drain(record: RunRecord) -> dict[str, float | None]:
    """Output tokens/s from the first send until the last request's first token.

    Under an open-loop workload whose arrivals outpace the server, requests wait for a seat
    all through this window: it is the run at saturation, without the drain at its end, where
    the last answers finish with fewer and fewer batch mates. The window starts at the first
    send, so it includes the ramp-up before a queue forms; on a closed loop it only cuts the
    run short. A request's tokens are spread over its chunks, so a chunk that carried several
    tokens counts for all of them.
    """
    ok = [r for r in record.results if r.is_ok and r.chunk_times]
    if not ok:
        return {"window_s": None, "output_tokens": None, "output_tokens_per_s": None}
    start = min(r.send_time for r in record.results)
    end = max(r.chunk_times[0] for r in ok)
    tokens = 0.0
    for r in ok:
        num_in = sum(1 for t in r.chunk_times if t <= end)
        tokens += r.output_tokens * num_in / len(r.chunk_times)
    window = end - start
    return {"window_s": window, "output_tokens": tokens,
            "output_tokens_per_s": tokens / window if window > 0 else None}


def _nice_bin(span: float) -> float:
    # About 40 bins, rounded to 1/2/5 x 10^k seconds so the axis reads well.
    raw = span / 40
    magnitude = 10 ** math.floor(math.log10(raw))
    for step in (1, 2, 5, 10):
        if raw <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def summarize(record: RunRecord) -> dict:
    """The headline numbers of a run (latencies in ms, rates per second)."""
    ok = [r for r in record.results if r.is_ok]
    errors = collections.Counter(r.error for r in record.results if not r.is_ok)
    wall = record.wall_time
    num_tokens = sum(r.output_tokens for r in ok)
    itls = [gap for r in ok for gap in r.inter_token_latencies]
    short = sum(1 for r in ok if r.max_tokens is not None and r.output_tokens != r.max_tokens)
    return {
        "num_requests": len(record.results),
        "num_ok": len(ok),
        "num_errors": len(record.results) - len(ok),
        "errors": dict(sorted(errors.items())),
        #: successful answers whose length differs from max_tokens (EOS honoured, or tokens merged)
        "num_length_mismatch": short,
        "wall_time_s": wall,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "ttft_ms": latency_summary([r.ttft for r in ok if r.ttft is not None]),
        "e2e_ms": latency_summary([r.e2e for r in ok]),
        "itl_ms": latency_summary(itls),
        "before_drain": before_drain(record),
    }


def report(record: RunRecord) -> dict:
    """Everything ``--out`` writes: target, workload, summary, timeline and per-request rows."""
    return {
        "target": {"base_url": record.target.base_url, "endpoint": record.target.endpoint,
                   "model": record.model},
        "workload": workload_to_dict(record.workload),
        "started_at": record.started_at,
        "summary": summarize(record),
        "timeline": throughput_timeline(record),
        "requests": [_row(r) for r in record.results],
    }


def _row(result) -> dict:
    row = attrs.asdict(result, filter=lambda a, _: a.name != "chunk_times")
    row.update(output_tokens=result.output_tokens, ttft_s=result.ttft, e2e_s=result.e2e)
    return row


def format_summary(summary: dict, title: str = "") -> str:
    """A one-screen table of ``summarize``'s numbers."""
    lines = [title] if title else []

    def num(value, fmt: str = "{:.1f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines.append(f"requests      {summary['num_ok']}/{summary['num_requests']} ok"
                 f"   errors {summary['num_errors']}"
                 + ("".join(f"  [{k}: {v}]" for k, v in summary["errors"].items())))
    lines.append(f"wall time     {num(summary['wall_time_s'], '{:.2f}')} s"
                 f"   output tokens {summary['output_tokens']}")
    lines.append(f"throughput    {num(summary['output_tokens_per_s'])} tok/s"
                 f"   {num(summary['requests_per_s'], '{:.2f}')} req/s")
    drain = summary["before_drain"]
    if drain["output_tokens_per_s"] is not None:
        lines.append(f"before drain  {num(drain['output_tokens_per_s'])} tok/s"
                     f"   until the last first token, {num(drain['window_s'], '{:.2f}')} s")
    lines.append(f"{'latency (ms)':<14}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}")
    for label, key in (("TTFT", "ttft_ms"), ("E2E", "e2e_ms"), ("ITL", "itl_ms")):
        row = summary[key]
        lines.append(f"{label:<14}" + "".join(f"{num(row[k]):>10}" for k in ("p50", "p90", "p99", "mean")))
    if summary["num_length_mismatch"]:
        lines.append(f"note: {summary['num_length_mismatch']} answers differ from their max_tokens")
    return "\n".join(lines)


def cdf_points(values: Iterable[float]) -> tuple[list[float], list[float]]:
    """Sorted values and their cumulative fractions, for a CDF plot."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]
