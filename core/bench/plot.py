"""A PNG of a run: latency CDFs (TTFT, end-to-end) and generated tokens/s over time.

matplotlib is optional (the ``bench`` extra); callers check ``has_matplotlib``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ifb.bench.driver import RunRecord
from ifb.bench.stats import cdf_points, throughput_timeline


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_run(record: RunRecord, path: str | Path) -> Path:
    """Write the plot of ``record`` to ``path`` (PNG)."""
    # Figure + the Agg canvas directly: no GUI backend and no global pyplot state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in record.results if r.is_ok]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    cdf_ax, rate_ax = fig.subplots(1, 2)

    lowest, highest = float("inf"), 0.0
    for label, values in (("TTFT", [r.ttft for r in ok if r.ttft is not None]), ("E2E", [r.e2e for r in ok])):
        if values:
            xs, ys = cdf_points(v * 1000 for v in values)
            cdf_ax.step([xs[0], *xs], [0.0, *ys], where="post", label=label)
            lowest, highest = min(lowest, xs[0]), max(highest, xs[-1])
    if 0 < lowest and highest > 20 * lowest:
        cdf_ax.set_xscale("log")  # TTFT and E2E are often orders of magnitude apart
    cdf_ax.set(title="Latency CDF", xlabel="latency (ms)", ylabel="fraction of requests", ylim=(0, 1.02))
    cdf_ax.grid(alpha=0.3)
    if ok:
        cdf_ax.legend(loc="lower right")

    timeline = throughput_timeline(record)
    bin_s = timeline["bin_s"]
    rates = timeline["tokens_per_s"]
    rate_ax.plot([(i + 0.5) * bin_s for i in range(len(rates))], rates, marker=".", linewidth=1.2)
    if record.wall_time > 0:
        mean = sum(r.output_tokens for r in ok) / record.wall_time
        rate_ax.axhline(mean, linestyle="--", color="gray", label=f"mean {mean:.1f} tok/s")
        rate_ax.legend(loc="lower right")
    rate_ax.set(title="Generated tokens/s", xlabel="time since first request (s)", ylabel="tokens/s")
    rate_ax.set_ylim(bottom=0)
    rate_ax.grid(alpha=0.3)

    fig.suptitle(f"{record.workload.name} → {record.target.base_url} ({record.model})", fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
