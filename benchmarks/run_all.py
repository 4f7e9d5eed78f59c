"""Run every benchmark on this machine and record the results.

Starts each server configuration in turn (never two at once) on a free
loopback port, waits for ``/health``, drives it with every workload in
``benchmarks/workloads/`` through ``ifb.bench``, stops it, then measures the
transformers ``generate`` baseline in-process. Writes the raw run to
``benchmarks/runs/<date>/`` (git-ignored: every JSON, a PNG plot per server
and workload when matplotlib is there, the server logs). With ``--publish`` the
run replaces the one in ``benchmarks/results/`` (its JSON summaries, logs and
one plot per workload) and the results table in ``benchmarks/README.md``.

    python benchmarks/run_all.py            # the full suite, kept in benchmarks/runs/
    python benchmarks/run_all.py --publish  # the full suite, published in results/ and the README
    python benchmarks/run_all.py --quick    # a few short requests per run: checks that everything works
    python benchmarks/run_all.py --table-only benchmarks/results/<date>   # rebuild the README table
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx

from ifb.bench.driver import Target, run
from ifb.bench.plot import has_matplotlib, plot_run
from ifb.bench.stats import format_summary, report
from ifb.bench.workloads import LengthBand, Workload, load_workload

HERE = Path(__file__).resolve().parent
WORKLOADS_DIR = HERE / "workloads"
#: the published run, the one the README cites (one directory; older ones live in git history)
RESULTS_DIR = HERE / "results"
#: raw runs, git-ignored
RUNS_DIR = HERE / "runs"
#: the server whose plot stands for its workload in a published run
PLOTTED_MODE = "ifb-inflight"
README = HERE / "README.md"
TABLE_BEGIN = "<!-- results:begin (written by run_all.py) -->"
TABLE_END = "<!-- results:end -->"

#: every server gets room to queue the whole workload, so slow modes show latency, not 429s
COMMON_ARGS = ("--queue-timeout", "900", "--max-queued-requests", "256", "--log-level", "warning")


@attrs.frozen
class ServerMode:
    name: str
    title: str
    args: tuple[str, ...]
    #: workloads this mode runs (None: all)
    only: tuple[str, ...] | None = None


#: seats of the batched modes (``--max-batch-size``): with the integer-activation kernels a decode
#: row costs about the same from 8 rows up, so 16 seats admit twice the requests at a time
BATCH = 16


def server_modes(batch: int = BATCH) -> tuple[ServerMode, ...]:
    seats = str(batch)
    return (
        ServerMode("ifb-inflight", f"ifb, in-flight batching (batch {seats})",
                   ("--enable-in-flight-batching", "--max-batch-size", seats)),
        ServerMode("ifb-static", f"ifb, static batches (batch {seats})",
                   ("--enable-in-flight-batching", "--static-batching", "--max-batch-size", seats)),
        ServerMode("ifb-blocking", "ifb, blocking path (one at a time)", ()),
        ServerMode("ifb-inflight-reuse", f"ifb, in-flight batching + context reuse (batch {seats})",
                   ("--enable-in-flight-batching", "--enable-context-reuse", "--max-batch-size", seats),
                   only=("shared_prefix",)),
    )


MODES = server_modes()
HF_MODE = "hf-transformers"


def quick_variant(workload: Workload) -> Workload:
    """A few short requests: enough to exercise every path, not to measure."""
    bands = tuple(LengthBand(b.weight, min(b.min_tokens, 8), min(b.max_tokens, 12)) for b in workload.output_lengths)
    return attrs.evolve(workload, num_requests=min(workload.num_requests, 6),
                        concurrency=min(workload.concurrency, 3), output_lengths=bands,
                        rate=None if workload.rate is None else max(workload.rate, 2.0),
                        shared_prefix_words=min(workload.shared_prefix_words, 120))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            response = httpx.get(url + "/health", timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"no healthy /health within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def supports_static_flag() -> bool:
    from ifb.server.cli import serve

    return any(param.name == "static_batching" for param in serve.params)


def run_mode(mode: ServerMode, workloads: list[Workload], out_dir: Path, *, startup_timeout: float) -> None:
    """Start one server configuration, run the workloads against it, stop it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ifb", "serve", "--port", str(port), *mode.args, *COMMON_ARGS]
    print(f"\n== {mode.title}: {' '.join(command[1:])}", flush=True)
    log_path = out_dir / f"{mode.name}.server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
        try:
            try:
                wait_healthy(base_url, proc, startup_timeout)
            except RuntimeError as exc:
                print(f"   {mode.name} did not start: {exc} (see {log_path.name})", flush=True)
                for workload in workloads:
                    _write(out_dir / f"{mode.name}__{workload.name}.json",
                           {"mode": mode.name, "mode_title": mode.title, "error": str(exc)})
                return
            # one short request first: the first forward passes pay for allocation and warm-up
            httpx.post(base_url + "/v1/completions", timeout=600,
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
            for workload in workloads:
                record = run(Target(base_url), workload)
                data = report(record)
                data.update(mode=mode.name, mode_title=mode.title, server_args=list(mode.args),
                            health_after=httpx.get(base_url + "/health", timeout=30).json())
                stem = f"{mode.name}__{workload.name}"
                _write(out_dir / f"{stem}.json", data)
                if has_matplotlib():
                    plot_run(record, out_dir / f"{stem}.png")
                print(format_summary(data["summary"], title=f"-- {mode.name} / {workload.name}"), flush=True)
        finally:
            stop(proc)


def run_hf(out_dir: Path, *, num_tokens: int, repeats: int) -> None:
    print("\n== transformers generate baseline (in-process)", flush=True)
    import hf_baseline

    try:
        data = hf_baseline.measure(num_tokens=num_tokens, repeats=repeats)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, the rest of the suite stands
        print(f"   the baseline failed: {type(exc).__name__}: {exc}", flush=True)
        data = {"error": f"{type(exc).__name__}: {exc}"}
    _write(out_dir / f"{HF_MODE}.json", {"mode": HF_MODE, **data})


def machine_info(*, quick: bool) -> dict:
    import torch

    model_name, cores = platform.processor() or "unknown CPU", os.cpu_count()
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        model_name = fields.get("Model name", model_name).strip()
        cores = int(fields.get("CPU(s)", cores))
    except (OSError, subprocess.CalledProcessError, ValueError):
        pass
    return {"cpu": model_name, "cores": cores, "date": dt.date.today().isoformat(),
            "torch": torch.__version__, "python": platform.python_version(), "quick": quick}


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _ms(stats: dict, key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{value:,.0f}"


def _shown(path: Path) -> str:
    # relative to benchmarks/ when it is inside, so the README never names a machine path
    try:
        return path.relative_to(HERE).as_posix()
    except ValueError:
        return path.name


def render_table(results_dir: Path) -> str:
    """The markdown results section for one results directory."""
    machine = json.loads((results_dir / "machine.json").read_text())
    lines = [
        f"Measured {machine['date']} on {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}"
        + (" — **quick run, not representative**" if machine.get("quick") else "")
        + f". Raw results and plots: `{_shown(results_dir)}/`.",
        "",
        "| workload | server | output tok/s | before drain | req/s | TTFT p50 / p99 (ms) "
        "| E2E p50 / p99 (ms) | ITL p50 / p99 (ms) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {mode.name: i for i, mode in enumerate(MODES)}
    rows = []
    for path in sorted(results_dir.glob("*__*.json")):
        data = json.loads(path.read_text())
        mode, workload = path.stem.split("__", 1)
        rows.append((workload, order.get(mode, len(order)), mode, data))
    for workload, _, mode, data in sorted(rows, key=lambda row: row[:2]):
        if "error" in data:
            lines.append(f"| {workload} | {mode} | failed: {data['error']} | | | | | | |")
            continue
        s = data["summary"]
        drain = (s.get("before_drain") or {}).get("output_tokens_per_s")
        lines.append(
            f"| {workload} | {mode} | {s['output_tokens_per_s']:.1f} | {'-' if drain is None else f'{drain:.1f}'} "
            f"| {s['requests_per_s']:.2f} "
            f"| {_ms(s['ttft_ms'], 'p50')} / {_ms(s['ttft_ms'], 'p99')} "
            f"| {_ms(s['e2e_ms'], 'p50')} / {_ms(s['e2e_ms'], 'p99')} "
            f"| {_ms(s['itl_ms'], 'p50')} / {_ms(s['itl_ms'], 'p99')} | {s['num_errors']} |")
    hf_path = results_dir / f"{HF_MODE}.json"
    if hf_path.exists():
        hf = json.loads(hf_path.read_text())
        lines += ["", "| transformers `generate` (same weights, float32, in-process, greedy) | tokens/s |",
                  "|---|---:|"]
        if "error" in hf:
            lines.append(f"| failed: {hf['error']} | |")
        else:
            n, b = hf["num_tokens"], hf["batch_size"]
            decode = hf["batch1_decode_tokens_per_s"]
            lines += [f"| batch 1, decode only ({n} tokens) | {'-' if decode is None else f'{decode:.1f}'} |",
                      f"| batch 1, prefill + decode ({n} tokens) | {hf['batch1_generate_tokens_per_s']:.1f} |",
                      f"| static batch {b} ({b} x {n} tokens) | {hf['static_batch_generate_tokens_per_s']:.1f} |"]
    return "\n".join(lines)


def publish(run_dir: Path, results_dir: Path = RESULTS_DIR) -> Path:
    """Replace the published run in ``results_dir`` with ``run_dir``: its JSONs and logs, and one plot
    per workload (``PLOTTED_MODE``'s, else the first there is); returns the published directory."""
    if results_dir.resolve() in run_dir.resolve().parents:
        raise ValueError(f"{run_dir} is inside {results_dir}, which publishing replaces")
    target = results_dir / run_dir.name
    for old in results_dir.iterdir() if results_dir.exists() else ():
        if old.is_dir():
            shutil.rmtree(old)
    target.mkdir(parents=True)
    for path in sorted(run_dir.iterdir()):
        if path.suffix in (".json", ".log"):
            shutil.copy2(path, target / path.name)
    plots: dict[str, Path] = {}
    for path in sorted(run_dir.glob("*__*.png")):
        mode, workload = path.stem.split("__", 1)
        if workload not in plots or mode == PLOTTED_MODE:
            plots[workload] = path
    for path in plots.values():
        shutil.copy2(path, target / path.name)
    return target


def update_readme(readme: Path, section: str) -> None:
    """Put ``section`` between the results markers of ``readme`` (appending them if missing)."""
    text = readme.read_text() if readme.exists() else "# Benchmarks\n"
    block = f"{TABLE_BEGIN}\n{section}\n{TABLE_END}"
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        tail = rest.split(TABLE_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + f"\n\n## Results\n\n{block}\n"
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="A few short requests per run (a smoke test).")
    parser.add_argument("--modes", default=",".join([m.name for m in MODES] + [HF_MODE]),
                        help="Comma-separated subset of: %(default)s")
    parser.add_argument("--workloads", default=None,
                        help="Comma-separated workload names from benchmarks/workloads (default: all).")
    parser.add_argument("--out-dir", type=Path, default=None, help="Default: benchmarks/runs/<date>[-quick].")
    parser.add_argument("--publish", action="store_true",
                        help="Replace the published run in benchmarks/results/ with this one and write its "
                             "table into benchmarks/README.md (a full run only).")
    parser.add_argument("--max-batch-size", type=int, default=BATCH, help="Seats of the batched modes.")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--table-only", type=Path, default=None, metavar="RESULTS_DIR",
                        help="Only rebuild the README table from an existing results directory.")
    args = parser.parse_args(argv)
    if args.publish and args.quick:
        parser.error("a quick run is not representative: --publish takes a full run")

    if args.table_only is not None:
        update_readme(README, render_table(args.table_only.resolve()))
        print(f"updated {README}")
        return 0
    known = {m.name: m for m in server_modes(args.max_batch_size)}
    modes = [name.strip() for name in args.modes.split(",") if name.strip()]
    unknown = [name for name in modes if name not in known and name != HF_MODE]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join([*known, HF_MODE])}")
    if "ifb-static" in modes and not supports_static_flag():
        print("ifb serve has no --static-batching here: skipping ifb-static", flush=True)
        modes.remove("ifb-static")
    paths = sorted(WORKLOADS_DIR.glob("*.json"))
    if args.workloads:
        wanted = {name.strip() for name in args.workloads.split(",")}
        paths = [p for p in paths if p.stem in wanted]
        missing = wanted - {p.stem for p in paths}
        if missing:
            parser.error(f"no workload file for {', '.join(sorted(missing))} in {WORKLOADS_DIR}")
    workloads = [load_workload(str(p)) for p in paths]
    if args.quick:
        workloads = [quick_variant(w) for w in workloads]

    date = dt.date.today().isoformat()
    out_dir = (args.out_dir or RUNS_DIR / (f"{date}-quick" if args.quick else date)).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    _write(out_dir / "machine.json", machine_info(quick=args.quick))
    started = time.monotonic()
    for name in modes:
        if name == HF_MODE:
            continue
        mode = known[name]
        chosen = [w for w in workloads if mode.only is None or w.name in mode.only]
        if chosen:
            run_mode(mode, chosen, out_dir, startup_timeout=args.startup_timeout)
    if HF_MODE in modes:  # last, so that it never shares the CPU with a server
        run_hf(out_dir, num_tokens=8 if args.quick else 64, repeats=1 if args.quick else 2)
    print(f"\n{render_table(out_dir)}\n\nresults in {out_dir} ({time.monotonic() - started:.0f} s)")
    if args.publish:
        published = publish(out_dir)
        update_readme(README, render_table(published))
        print(f"published in {published}; updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
