"""Mixtures of experts against llama.cpp's server, side by side in one run, on the same GGUF files.

``vs_llama_cpp.py``'s comparison (the same workloads, seats, KV room, A-B-B-A order, fresh prompts
for each pair of runs, the warm-up burst) on random-weight GGUFs of OLMoE-1B-7B, Qwen1.5-MoE-A2.7B
and Qwen3-30B-A3B shapes in llama.cpp's ``Q4_K_M`` mix (``gguf_shapes.MOE_SHAPES``). Beside the
table:

- batch-1 decode as a fraction of the read bandwidth for the bytes a token streams: every tensor but
  the looked-up embedding, and of each stacked expert tensor only the experts a token picks
  (``gguf_shapes.active_tensor_bytes``);
- each server's load: seconds from its start to its first answer, and its peak resident memory by
  then (``VmHWM``), against the file's size.

Read bandwidth is measured before and after each model (the machine is shared); its fraction is of
the better of the two.

A model whose file both servers cannot hold at once (``--one-at-a-time``, or when twice the file
does not fit in the memory available) runs with one server up at a time, still A-B-B-A: ifb runs
every workload once, is stopped, llama.cpp runs each twice, then ifb is started again for its
second run; the table says which rows ran so.

    python benchmarks/vs_llama_cpp_moe.py                 # every MoE shape (hours on 2 cores)
    python benchmarks/vs_llama_cpp_moe.py --models olmoe-1b-7b:Q4_K_M --quick
    python benchmarks/vs_llama_cpp_moe.py --append --models qwen3-30b-a3b:Q4_K_M --one-at-a-time
    python benchmarks/vs_llama_cpp_moe.py --table-only benchmarks/vs_llama_cpp_moe.json --publish

Raw results go to ``benchmarks/runs/<date>-llama-cpp-moe/``; ``--publish`` writes the summary
``vs_llama_cpp_moe.json`` and the MoE table in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gguf_shapes  # noqa: E402
import llama_cpp_build  # noqa: E402
import vs_llama_cpp as base  # noqa: E402
from run_all import RUNS_DIR, machine_info, stop  # noqa: E402

from ifb.bench.driver import Target, run  # noqa: E402
from ifb.bench.stats import report  # noqa: E402
from ifb.bench.workloads import Workload  # noqa: E402

SUMMARY = HERE / "vs_llama_cpp_moe.json"
BEGIN, END = "<!-- llama-cpp-moe:begin (written by vs_llama_cpp_moe.py) -->", "<!-- llama-cpp-moe:end -->"
MODELS = tuple(f"{name}:Q4_K_M" for name in gguf_shapes.MOE_SHAPES)
#: requests per workload against vs_llama_cpp's 0.5B shape, by the bytes a token streams
SCALES = {"olmoe-1b-7b": 0.5, "qwen1.5-moe-a2.7b": 0.25, "qwen3-30b-a3b": 0.25}
#: beyond twice the file, what two servers up at once need (KV caches, runtimes, the run's own)
TOGETHER_MARGIN_BYTES = 3 << 30


def phases(together: bool) -> list[tuple[tuple[str, int], ...]]:
    """The A-B-B-A order as spans of servers up at once: one span with both, or one per server."""
    if together:
        return [base.ORDER]
    spans: list[list[tuple[str, int]]] = []
    for step in base.ORDER:
        if spans and spans[-1][-1][0] == step[0]:
            spans[-1].append(step)
        else:
            spans.append([step])
    return [tuple(span) for span in spans]


def moe_model(key: str, models_dir: Path, vocab_dir: Path, context: int, num_layers: int | None) -> base.Model:
    """The random-weight file of ``SHAPE:MIX`` (written when missing), ``num_layers`` of its layers
    when given (a model cut short in layers, for a machine that cannot hold the whole file)."""
    name, _, mix = key.partition(":")
    if name not in gguf_shapes.MOE_SHAPES or mix not in gguf_shapes.MIXES:
        raise SystemExit(f"unknown model {key!r}: give SHAPE:MIX with SHAPE in {', '.join(gguf_shapes.MOE_SHAPES)} "
                         f"and MIX in {', '.join(gguf_shapes.MIXES)}")
    shape = gguf_shapes.MOE_SHAPES[name]
    cut = num_layers is not None and num_layers < shape.num_layers
    if cut:
        shape = attrs.evolve(shape, num_layers=num_layers)
    stem = f"{name}{f'-{num_layers}l' if cut else ''}"
    path = models_dir / f"{stem}-random-{mix}-ctx{context}.gguf"
    if not path.exists():
        print(f"writing {path.name} ...", flush=True)
        partial = path.with_suffix(".partial")
        counts = gguf_shapes.write_moe_gguf(partial, shape, mix, context_length=context,
                                            vocab=vocab_dir / f"ggml-vocab-{shape.vocab_file}.gguf")
        partial.rename(path)
        print(f"   {path.stat().st_size / 2**30:.2f} GiB, matrices by type {counts}", flush=True)
    title = f"{name} shape{f', its first {num_layers} of {gguf_shapes.MOE_SHAPES[name].num_layers} layers' if cut else ''}"
    return base.Model(key if not cut else f"{stem}:{mix}", path, gguf_shapes.active_tensor_bytes(path),
                      f"{title}, {mix} (random weights)")


def available_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return int(fields["MemAvailable"].split()[0]) * 1024


def measure_model(model: base.Model, binary: Path, chosen: list[Workload], out_dir: Path,
                  args: argparse.Namespace, together: bool, save: Callable[[dict], None]) -> dict:
    """Both servers on ``model``, A-B-B-A; ``save`` gets the result so far after every run (a long
    run stopped early keeps what it measured)."""
    result: dict = {"model": model.key, "title": model.title, "quantization": "auto",
                    "bytes_per_token": model.num_bytes, "file_bytes": model.path.stat().st_size,
                    "servers_together": together, "requests": {w.name: w.num_requests for w in chosen},
                    "workloads": {w.name: {name: [] for name in base.SERVERS} for w in chosen},
                    "load": {name: [] for name in base.SERVERS}, "memory_mib_loaded": {}, "warmup": args.warmup,
                    "memory_mib_after": {}, "available_bytes_at_start": available_bytes()}
    # no workloads: each server loads once, alone (the load table's numbers only)
    spans = phases(together) if chosen else [(("ifb", 0),), (("llama.cpp", 0),)]
    for index, phase in enumerate(spans):
        names = list(dict.fromkeys(name for name, _ in phase))
        procs = {}
        try:
            for name in names:  # one at a time, so the load-time peaks are each server's own
                log = out_dir / f"{model.key}.{name}.{index}.log".replace(":", "-")
                started = time.perf_counter()
                procs[name] = base.start_server(name, model, binary, args.context, log, True, args.threads)
                base.wait_ready(procs[name][1], procs[name][0], args.startup_timeout)
                memory = base.rss_mib(procs[name][0].pid)
                result["load"][name].append({"seconds": time.perf_counter() - started, **memory})
                result["memory_mib_loaded"].setdefault(name, memory)
            for _, url in procs.values() if args.warmup else ():
                run(Target(url), base.quick(base.WARMUP) if args.quick else base.WARMUP, progress=False)
            for workload in chosen:
                for name, pair in phase:
                    sent = attrs.evolve(workload, seed=workload.seed + 1000 * pair)
                    target = Target(procs[name][1], endpoint="completions" if workload.send_max_tokens else "chat")
                    summary = report(run(target, sent, progress=False))["summary"]
                    summary["load_average_1m"] = os.getloadavg()[0]  # the machine is shared: said beside each run
                    result["workloads"][workload.name][name].append(summary)
                    save(result)
                    print(f"   {model.key} {workload.name:14} {name:9} {summary['output_tokens_per_s']:8.1f} "
                          f"tok/s  errors {summary['num_errors']}  load {summary['load_average_1m']:.1f}", flush=True)
            for name, (proc, _) in procs.items():
                after = base.rss_mib(proc.pid)
                earlier = result["memory_mib_after"].get(name)
                result["memory_mib_after"][name] = after if earlier is None or after["peak"] > earlier["peak"] \
                    else earlier
            save(result)
        finally:
            for proc, _ in procs.values():
                stop(proc)
    return result


def kv_bytes(model: dict, context: int) -> int:
    """The KV room both servers hold for ``model`` (a summary entry): every seat's context, keys and
    values in float16 (llama.cpp's default, and ifb's with integer activations)."""
    stem = model["model"].partition(":")[0]
    name, _, cut = stem.rpartition("-") if stem not in gguf_shapes.MOE_SHAPES else (stem, "", "")
    shape = gguf_shapes.MOE_SHAPES[name]
    num_layers = int(cut[:-1]) if cut else shape.num_layers
    return base.SEATS * context * num_layers * 2 * shape.num_kv_heads * shape.head_dim * 2


def render(summary: dict) -> str:
    """``vs_llama_cpp``'s table, the rows run one server at a time marked, and the load table."""
    unknown = {"rss": float("nan"), "peak": float("nan")}  # a server a stopped run never reached
    marked = {**summary, "models": [
        {**m, "title": m["title"] + ("" if m.get("servers_together", True) else "; servers one at a time")
         + ("" if m.get("warmup", True) else ", no warm-up burst"),
         **{key: {n: m[key].get(n, unknown) for n in base.SERVERS} for key in ("memory_mib_loaded", "memory_mib_after")}}
        for m in completed(summary)["models"] if m["workloads"]]}
    table = base.render(marked).replace(", measured at the start of each run that added models",
                                        "; each model's fraction is of the better of its two")
    lines = [table, "", "Loading (each server's start to its first answer; peak resident memory "
             "by then, `VmHWM`, against the file; both hold the KV room by then):", "",
             "| model | file (GiB) | KV room (GiB) | ifb: load s, peak RSS (GiB) | llama.cpp: load s, peak RSS (GiB) |",
             "|---|---:|---:|---:|---:|"]
    for m in summary["models"]:
        cells = []
        for name in base.SERVERS:
            loads = m["load"][name]
            if not loads:  # a run stopped before this server started
                cells.append("-")
                continue
            seconds = " / ".join(f"{x['seconds']:.0f}" for x in loads)
            peak = max(x["peak"] for x in loads) / 1024
            cells.append(f"{seconds} s, {peak:.2f} ({100 * peak * 2**30 / m['file_bytes']:.0f} % of the file)")
        lines.append(f"| {m['title']} | {m['file_bytes'] / 2**30:.2f} | {kv_bytes(m, summary['context']) / 2**30:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def completed(summary: dict) -> dict:
    """``summary`` with only the workloads both servers ran twice (a run stopped early keeps the rest)."""
    return {**summary, "models": [{**m, "workloads": {w: runs for w, runs in m["workloads"].items()
                                                       if all(len(runs[n]) == 2 for n in base.SERVERS)}}
                                  for m in summary["models"]]}


def render_prose(summary: dict) -> str:
    """Every measured cell counted as a win, a tie (``TIE_RULE``) or a loss, and the batch-1
    bandwidth fractions of the bytes a token streams."""
    done = completed(summary)
    wins, ties, losses, failed = [], [], [], []
    for m in done["models"]:
        for w, runs in m["workloads"].items():
            if any(r["num_errors"] for rs in runs.values() for r in rs):  # not a speed: said apart
                failed.append(f"{m['model'].partition(':')[0]} {w}")
                continue
            ratio = base._mean(runs["ifb"], "output_tokens_per_s") / base._mean(runs["llama.cpp"], "output_tokens_per_s")
            label = f"{m['model'].partition(':')[0]} {w} {ratio:.2f}x"
            (ties if base.is_tie(runs) else wins if ratio > 1 else losses).append((ratio, label))
    machine = done["machine"]
    text = (f"Mixtures of experts against llama.cpp's server ({machine['cpu']}, {machine['cores']} cores, "
            f"{machine['date']}): of {len(wins) + len(ties) + len(losses)} cells ifb's output tokens/s is ahead in "
            f"{len(wins)}" + (f" ({base._span([r for r, _ in wins])})" if wins else "")
            + f", a tie in {len(ties)}" + (f" ({', '.join(label for _, label in ties)})" if ties else "")
            + f", behind in {len(losses)}" + (f" ({', '.join(label for _, label in losses)})" if losses else "")
            + (f"; with errors, not counted: {', '.join(failed)}" if failed else "") + ".")
    fractions = {name: [100 * base.bandwidth_fraction(done, m, name) for m in done["models"]
                        if "batch1" in m["workloads"]] for name in base.SERVERS}
    if fractions["ifb"]:
        text += (f" At batch 1 ifb reads {base._span(fractions['ifb'], ' %', 0)} of the measured read bandwidth's "
                 f"worth of the bytes a token streams (active experts only) a second, llama.cpp "
                 f"{base._span(fractions['llama.cpp'], ' %', 0)}.")
    return text + " " + base.TIE_RULE


def published_text(summary: dict) -> str:
    """``benchmarks/README.md`` with the MoE block as ``summary`` writes it."""
    return base.replace_block(base.README.read_text(), BEGIN, END, render(summary) + "\n\n" + render_prose(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="Comma-separated subset of: %(default)s")
    parser.add_argument("--workloads", default=None, help="Comma-separated subset of the workloads (default: all).")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens a seat, in both servers.")
    parser.add_argument("--rate", type=float, default=4.0, help="Arrivals per second of the poisson workload.")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads.")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="One server up at a time for every model (else only where two do not fit).")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="Only this many of each model's layers (a file cut short where memory is short).")
    parser.add_argument("--load-only", action="store_true",
                        help="Only load each server once, alone: the load table's row, no workloads.")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="No warm-up burst (for batch1 alone: the first answer already warmed batch 1).")
    parser.add_argument("--quick", action="store_true", help="A few short requests: checks the setup.")
    parser.add_argument("--publish", action="store_true", help="Write vs_llama_cpp_moe.json and the README table.")
    parser.add_argument("--table-only", type=Path, metavar="SUMMARY", help="Only render (and --publish) a summary.")
    parser.add_argument("--append", action="store_true", help="Add to (or replace models in) this date's summary.")
    parser.add_argument("--models-dir", type=Path, default=llama_cpp_build.cache_dir("models"))
    parser.add_argument("--llama-cpp-version", default=llama_cpp_build.DEFAULT_VERSION)
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if args.publish and args.quick:
        parser.error("a quick run is not representative: --publish takes a full run")
    if args.table_only is not None:
        summary = json.loads(args.table_only.read_text())
        print(render(summary))
        if args.publish:
            _publish(summary)
        return 0
    names = [w.name for w in base.workloads(args.rate)]
    wanted = [w.strip() for w in args.workloads.split(",")] if args.workloads else names
    if set(wanted) - set(names):
        parser.error(f"unknown workload(s) {', '.join(sorted(set(wanted) - set(names)))}")
    binary = llama_cpp_build.build(args.llama_cpp_version)
    vocab_dir = llama_cpp_build.cache_dir(args.llama_cpp_version) / "src" / "models"
    args.models_dir.mkdir(parents=True, exist_ok=True)
    out_dir = RUNS_DIR / f"{dt.date.today().isoformat()}-llama-cpp-moe{'-quick' if args.quick else ''}"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"machine": machine_info(quick=args.quick), "bandwidth_gb_s": base.read_bandwidth(),
               "llama_cpp_version": args.llama_cpp_version, "threads": args.threads, "repack": True,
               "context": args.context, "quick": args.quick, "workloads": wanted, "models": []}
    print(f"read bandwidth {summary['bandwidth_gb_s']:.1f} GB/s", flush=True)
    previous = out_dir / "summary.json"
    if args.append and previous.exists():  # earlier models stay, each with the bandwidth of its own run
        earlier = json.loads(previous.read_text())
        summary["models"] = earlier["models"]
        summary["workloads"] = list(dict.fromkeys(earlier["workloads"] + wanted))
    for key in [k.strip() for k in args.models.split(",") if k.strip()]:
        model = moe_model(key, args.models_dir, vocab_dir, args.context, args.num_layers)
        scale = SCALES.get(key.partition(":")[0], 0.25)
        chosen = [w for w in base.workloads(args.rate, scale, real_weights=False) if w.name in wanted]
        chosen = [] if args.load_only else [base.quick(w) for w in chosen] if args.quick else chosen
        together = not args.one_at_a_time and not args.load_only and \
            2 * model.path.stat().st_size + TOGETHER_MARGIN_BYTES <= available_bytes()
        print(f"== {model.title} ({'both servers up' if together else 'one server at a time'})", flush=True)
        # the machine is shared and its load drifts: each model's fraction is of the better of the
        # bandwidths measured just before and just after it
        before = base.read_bandwidth() if summary["models"] else summary["bandwidth_gb_s"]

        def save(measured: dict, after: float | None = None) -> None:
            measured["bandwidth_before_gb_s"], measured["bandwidth_after_gb_s"] = before, after
            measured["bandwidth_gb_s"] = max(before, after or 0.0)
            summary["models"] = [m for m in summary["models"] if m["model"] != measured["model"]] + [measured]
            previous.write_text(json.dumps(summary, indent=1) + "\n")

        measured = measure_model(model, binary, chosen, out_dir, args, together, save)
        save(measured, base.read_bandwidth())
    print("\n" + render(summary))
    if args.publish:
        _publish(summary)
    return 0


def _publish(summary: dict) -> None:
    SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")
    base.README.write_text(published_text(summary))


if __name__ == "__main__":
    sys.exit(main())
