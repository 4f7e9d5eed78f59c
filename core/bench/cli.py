"""``ifb bench``: drive any OpenAI-compatible server with a workload and report the numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ifb.bench.workloads import BUILTIN, WorkloadError, load_workload


@click.command()
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True,
              help="The server to measure (with or without a trailing /v1).")
@click.option("--workload", "workload_name", default="fixed", show_default=True,
              metavar="|".join(BUILTIN) + "|FILE.json", help="A built-in workload or a JSON definition.")
@click.option("--num-requests", type=click.IntRange(min=1), default=None, help="Requests in total.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Closed loop with this many clients (each sends its next request when one ends).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Open loop: Poisson arrivals at this many requests per second.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Make every answer this many tokens (replaces the workload's length mix).")
@click.option("--seed", type=int, default=None, help="Seed of prompts, lengths and arrivals.")
@click.option("--model", default=None, help="Model name to send (default: the first one /v1/models lists).")
@click.option("--endpoint", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--ignore-eos/--no-ignore-eos", default=None,
              help="Send ignore_eos so answers have exactly their planned length (default: as the workload says; "
                   "turn off for servers that reject the field).")
@click.option("--api-key", envvar="IFB_API_KEY", default=None, help="Sent as 'Authorization: Bearer KEY'.")
@click.option("--timeout", "request_timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Seconds one request may take before it counts as an error.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write results as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write latency CDFs and throughput over time as a PNG (needs matplotlib).")
@click.option("--no-progress", is_flag=True, help="Do not show the progress bar.")
def bench(base_url: str, workload_name: str, num_requests: int | None, concurrency: int | None,
          rate: float | None, max_tokens: int | None, seed: int | None, model: str | None, endpoint: str,
          ignore_eos: bool | None, api_key: str | None, request_timeout: float, out: Path | None,
          plot: Path | None, no_progress: bool) -> None:
    """Measure a server (ours or any OpenAI-compatible one) under a workload: throughput,
    TTFT / end-to-end / inter-token latency percentiles and errors."""
    from ifb.bench.driver import BenchError, Target, run
    from ifb.bench.plot import has_matplotlib, plot_run
    from ifb.bench.stats import format_summary, report

    if plot is not None and not has_matplotlib():
        raise click.UsageError("--plot needs matplotlib: pip install 'ifb[bench]' (or matplotlib)")
    try:
        workload = load_workload(workload_name).with_overrides(
            num_requests=num_requests, concurrency=concurrency, rate=rate, max_tokens=max_tokens, seed=seed,
            ignore_eos=ignore_eos)
    except (WorkloadError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--workload") from None
    target = Target(base_url=base_url, endpoint=endpoint, model=model, api_key=api_key,
                    request_timeout=request_timeout)
    loop = f"rate {workload.rate}/s (open loop)" if workload.is_open_loop else f"{workload.concurrency} clients"
    click.echo(f"ifb bench: {workload.name}, {workload.num_requests} requests, {loop} -> {target.url}", err=True)
    try:
        record = run(target, workload, progress=not no_progress)
    except BenchError as exc:
        click.echo(f"ifb bench: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("ifb bench: interrupted", err=True)
        sys.exit(130)
    data = report(record)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")
    if plot is not None:
        plot_run(record, plot)
    click.echo(format_summary(data["summary"], title=f"{workload.name} @ {target.base_url} ({record.model})"))
    if out is not None:
        click.echo(f"results: {out}")
    if plot is not None:
        click.echo(f"plot: {plot}")
