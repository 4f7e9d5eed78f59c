"""ifb against llama.cpp's server, side by side in one run, on the same GGUF files.

For each model (the default model's own GGUF, then random-weight GGUFs of Qwen2.5-0.5B, -1.5B and
-3B shapes in llama.cpp's ``Q4_K_M`` and ``Q5_K_M`` mixes and in ``Q8_0``, written by ``gguf_shapes``), both
servers are started with the same seats (16) and the same KV room, and each workload runs in
A-B-B-A order (ifb, llama.cpp, llama.cpp, ifb), so a drift in the machine's load hits both alike.
The table gives each server's mean of its two runs and the ratio. Workloads (all greedy, streamed):

- ``batch1``: one request at a time, 64 tokens each;
- ``concurrent8`` / ``concurrent16``: 8 / 16 clients in a closed loop, 64 tokens each;
- ``poisson``: an open loop at ``--rate`` requests/s, answers skewed (80 % 8-32 tokens, 20 % 128-256);
- ``prompt_heavy``: 8 clients, 700-word prompts, 32-token answers;
- ``no_max_tokens``: chat requests without ``max_tokens``. The default model's answers end at EOS
  (8 clients asking for one sentence); random weights rarely say EOS, so there 4 clients send
  600-word prompts and each answer runs to the end of its seat's context (``--context`` tokens):
  the servers' own cap decides the length.

The 1.5B and 3B shapes send half and a quarter of the requests (a closed loop at least one per
client).

Each pair of runs sends its own prompts (drawn from the workload's seed plus 1000 times the pair's
number), the same to both servers: neither replays a prompt it has seen, so llama.cpp's per-slot
prompt cache cannot skip a prefill that ifb computes. Before measuring, each server answers one
warm-up burst (16 requests of 300 words). Also recorded: each server's resident memory after
loading and its peak, and batch-1 decode as a
fraction of this machine's measured read bandwidth for the bytes a token streams (the GGUF's
tensors). llama.cpp is built by ``llama_cpp_build.py`` (cached; about 13 minutes the first time)
and run with ``--no-repack`` (its AMX repacking crashes on some VMs; ``--repack`` allows it).

    python benchmarks/vs_llama_cpp.py                          # every model: long (hours on 2 cores)
    python benchmarks/vs_llama_cpp.py --models default,qwen2.5-0.5b:Q4_K_M
    python benchmarks/vs_llama_cpp.py --quick                  # a few short requests: checks the setup
    python benchmarks/vs_llama_cpp.py --quantization int8 --append   # ifb with 8-bit activations, as
                                                               # llama.cpp's: rows MODEL@int8
    python benchmarks/vs_llama_cpp.py --publish                # also writes the table into README.md

Raw results go to ``benchmarks/runs/<date>-llama-cpp/`` (git-ignored); ``--publish`` writes the
summary ``vs_llama_cpp.json`` and the README's table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gguf_shapes  # noqa: E402
import llama_cpp_build  # noqa: E402
from run_all import RUNS_DIR, free_port, machine_info, stop, wait_healthy  # noqa: E402

from ifb.bench.driver import Target, run  # noqa: E402
from ifb.bench.stats import report  # noqa: E402
from ifb.bench.workloads import LengthBand, Workload  # noqa: E402

SEATS = 16
SUMMARY = HERE / "vs_llama_cpp.json"
README = HERE / "README.md"
BEGIN, END = "<!-- llama-cpp:begin (written by vs_llama_cpp.py) -->", "<!-- llama-cpp:end -->"
PROSE_BEGIN = "<!-- llama-cpp-ranges:begin (written by vs_llama_cpp.py) -->"
PROSE_END = "<!-- llama-cpp-ranges:end -->"
TOP_README = HERE.parent / "README.md"
SERVERS = ("ifb", "llama.cpp")
#: A-B-B-A, each pair of runs on its own prompts (the workload's seed + 1000 * the number): a server
#: never sees a prompt again, so a prompt cache (llama.cpp keeps each slot's last prompt) cannot
#: skip a prefill the other server computes
ORDER = (("ifb", 0), ("llama.cpp", 0), ("llama.cpp", 1), ("ifb", 1))
#: sent to each server once before measuring: the first large batches pay for allocations
WARMUP = Workload(name="warmup", kind="fixed", num_requests=16, concurrency=16, seed=999,
                  output_lengths=(LengthBand(1.0, 8, 8),), prompt_words=(300, 300))


def workloads(rate: float, scale: float = 1.0, real_weights: bool = True) -> list[Workload]:
    """The workloads, ``scale`` times as many requests (a closed loop keeps at least one per client).

    Without max_tokens a real model's answers end at EOS; a random-weight one rarely says EOS, so
    its answers run to the context's end: there the prompts are long (600 words), so that an answer
    is a few hundred tokens, the server's cap (the context) deciding where it stops."""

    def n(count: int, clients: int = 1) -> int:
        return max(clients, round(count * scale))

    if real_weights:
        no_max = Workload(name="no_max_tokens", kind="fixed", num_requests=n(8, 8), concurrency=8,
                          prompt_words=(4, 8), ignore_eos=False, send_max_tokens=False,
                          instruction="In one short sentence, which of these words is the oddest?")
    else:
        no_max = Workload(name="no_max_tokens", kind="fixed", num_requests=n(4, 4), concurrency=4,
                          prompt_words=(600, 600), ignore_eos=False, send_max_tokens=False)
    return [
        Workload(name="batch1", kind="fixed", num_requests=n(4), concurrency=1),
        Workload(name="concurrent8", kind="fixed", num_requests=n(16, 8), concurrency=8),
        Workload(name="concurrent16", kind="fixed", num_requests=n(32, 16), concurrency=16),
        Workload(name="poisson", kind="skewed", num_requests=n(48, 8), rate=rate * scale, seed=1,
                 output_lengths=(LengthBand(0.8, 8, 32), LengthBand(0.2, 128, 256)), prompt_words=(8, 96)),
        Workload(name="prompt_heavy", kind="fixed", num_requests=n(16, 8), concurrency=8,
                 output_lengths=(LengthBand(1.0, 32, 32),), prompt_words=(700, 700)),
        no_max,
    ]


#: requests per workload for each model, against the 0.5B shape's (bigger models: fewer requests)
SCALES = {"qwen2.5-0.5b": 1.0, "qwen2.5-1.5b": 0.5, "qwen2.5-3b": 0.25}


def quick(workload: Workload) -> Workload:
    bands = tuple(LengthBand(b.weight, min(b.min_tokens, 8), min(b.max_tokens, 12)) for b in workload.output_lengths)
    return attrs.evolve(workload, num_requests=min(workload.num_requests, 4), output_lengths=bands,
                        prompt_words=(min(workload.prompt_words[0], 100), min(workload.prompt_words[1], 100)))


@attrs.frozen
class Model:
    """One GGUF both servers load: the default model, or a random-weight shape in a mix."""

    key: str
    path: Path
    num_bytes: int
    title: str


def default_model() -> Model:
    from ifb_plugins.text.default_model import resolve_model

    path = Path(resolve_model(None))
    return Model("default", path, gguf_shapes.tensor_bytes(path), "SmolLM2-135M-Instruct (Q4_1, real weights)")


def shape_model(key: str, models_dir: Path, vocab_dir: Path, context: int) -> Model:
    name, _, mix = key.partition(":")
    if name not in gguf_shapes.SHAPES or mix not in gguf_shapes.MIXES:
        raise SystemExit(f"unknown model {key!r}: give default or SHAPE:MIX with SHAPE in "
                         f"{', '.join(gguf_shapes.SHAPES)} and MIX in {', '.join(gguf_shapes.MIXES)}")
    shape = gguf_shapes.SHAPES[name]
    path = models_dir / f"{name}-random-{mix}-ctx{context}.gguf"
    if not path.exists():
        print(f"writing {path.name} ...", flush=True)
        partial = path.with_suffix(".partial")
        counts = gguf_shapes.write_gguf(partial, shape, mix, vocab=vocab_dir / f"ggml-vocab-{shape.arch}.gguf",
                                        context_length=context)
        partial.rename(path)
        print(f"   {path.stat().st_size / 2**30:.2f} GiB, matrices by type {counts}", flush=True)
    return Model(key, path, gguf_shapes.tensor_bytes(path), f"{name} shape, {mix} (random weights)")


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory now and at its peak (MiB)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[name].split()[0]) / 1024 for key, name in (("rss", "VmRSS"), ("peak", "VmHWM"))}


def start_server(name: str, model: Model, binary: Path, context: int, log: Path, repack: bool,
                 threads: int, quantization: str = "auto") -> tuple[subprocess.Popen, str]:
    port = free_port()
    if name == "ifb":
        command = [sys.executable, "-m", "ifb", "serve", str(model.path), "--port", str(port),
                   "--enable-in-flight-batching", "--max-batch-size", str(SEATS),
                   "--max-kv-cache-capacity", str(SEATS * context), "--queue-timeout", "900",
                   "--max-queued-requests", "256", "--log-level", "warning", "--quantization", quantization]
    else:  # one slot per seat, each with the same context; the same KV room in all
        command = [str(binary), "-m", str(model.path), "--port", str(port), "-np", str(SEATS),
                   "-c", str(SEATS * context), "-t", str(threads), "--no-webui", "--log-disable"]
        if not repack:
            command.append("--no-repack")
    handle = log.open("w")
    proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=HERE.parent)
    handle.close()
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    wait_healthy(url, proc, timeout)
    # one short request: the first forward passes pay for allocation and warm-up
    httpx.post(url + "/v1/completions", timeout=600,
               json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}).raise_for_status()


def read_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of summing a buffer far larger than the caches, on every core torch uses (the best run)."""
    import torch

    buffer = torch.ones(size_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        float(buffer.sum())
        best = min(best, time.perf_counter() - started)
    return size_bytes / best / 1e9


def measure_model(model: Model, binary: Path, chosen: list[Workload], out_dir: Path, args: argparse.Namespace) -> dict:
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    mode = args.quantization
    result: dict = {"model": model.key + ("" if mode == "auto" else f"@{mode}"),
                    "title": model.title + ("" if mode == "auto" else f"; ifb `--quantization {mode}`"),
                    "quantization": mode, "bytes_per_token": model.num_bytes,
                    "file_bytes": model.path.stat().st_size, "workloads": {}, "date": dt.date.today().isoformat(),
                    "requests": {w.name: w.num_requests for w in chosen}}
    try:
        for name in SERVERS:  # one at a time, so the load-time peaks are each server's own
            log = out_dir / f"{result['model']}.{name}.log".replace(":", "-").replace("@", "-")
            procs[name] = start_server(name, model, binary, args.context, log, args.repack, args.threads, mode)
            wait_ready(procs[name][1], procs[name][0], args.startup_timeout)
        result["memory_mib_loaded"] = {name: rss_mib(proc.pid) for name, (proc, _) in procs.items()}
        for _, url in procs.values():
            run(Target(url), quick(WARMUP) if args.quick else WARMUP, progress=False)
        result["memory_mib_warm"] = {name: rss_mib(proc.pid) for name, (proc, _) in procs.items()}
        for workload in chosen:
            runs: dict[str, list[dict]] = {name: [] for name in SERVERS}
            for name, pair in ORDER:
                sent = attrs.evolve(workload, seed=workload.seed + 1000 * pair)
                summary = report(run(Target(procs[name][1], endpoint=_endpoint(workload)), sent,
                                     progress=False))["summary"]
                runs[name].append(summary)
                print(f"   {model.key} {workload.name:14} {name:9} {summary['output_tokens_per_s']:8.1f} tok/s  "
                      f"errors {summary['num_errors']}", flush=True)
            result["workloads"][workload.name] = runs
        result["memory_mib_after"] = {name: rss_mib(proc.pid) for name, (proc, _) in procs.items()}
    finally:
        for proc, _ in procs.values():
            stop(proc)
    return result


def _endpoint(workload: Workload) -> str:
    return "completions" if workload.send_max_tokens else "chat"


def _mean(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


#: how a cell's run-to-run spread decides between a win and a tie (said under every table)
TIE_RULE = ("A cell is a tie, not a win, when its ratio differs from 1 by no more than the run-to-run spread: "
            "each server's spread is its runs' max minus min over their mean, and the larger of the two counts.")


def _rates(runs: list[dict]) -> list[float]:
    return [r["output_tokens_per_s"] for r in runs]


def spread(runs: list[dict]) -> float:
    """One server's run-to-run spread on a workload: (max - min) / mean of its runs' tokens/s."""
    rates = _rates(runs)
    return (max(rates) - min(rates)) / (sum(rates) / len(rates))


def is_tie(runs: dict[str, list[dict]]) -> bool:
    """Whether one workload's ratio is within the spread of either server (``TIE_RULE``)."""
    ratio = _mean(runs["ifb"], "output_tokens_per_s") / _mean(runs["llama.cpp"], "output_tokens_per_s")
    return abs(ratio - 1) <= max(spread(runs["ifb"]), spread(runs["llama.cpp"]))


def _span(values: list[float], unit: str = "x", digits: int = 2) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}{unit}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else \
        f"{lo:.{digits}f}-{hi:.{digits}f}{unit}"


def bandwidth_fraction(summary: dict, model: dict, server: str) -> float:
    """A server's batch-1 tokens/s times the file's bytes a token, over the run's read bandwidth."""
    rate = _mean(model["workloads"]["batch1"][server], "output_tokens_per_s")
    return rate * model["bytes_per_token"] / 1e9 / model.get("bandwidth_gb_s", summary["bandwidth_gb_s"])


#: the ``--quantization`` modes a row may run ifb with besides the default, as the prose names them
OTHER_MODES = {"int8-prompt": "8-bit codes on prompt tokens, 15-bit on generated ones",
               "int8": "llama.cpp's precision"}


def render_prose(summary: dict) -> str:
    """The ranges the READMEs quote, from ``summary``: batch 1, the batched workloads, prompt-heavy,
    and the ``int8`` rows, each as ifb's output tokens/s over llama.cpp's, ties counted apart."""
    groups: dict[str, tuple[list[float], list[str]]] = {}
    for m in summary["models"]:
        mode = m.get("quantization", "auto")
        mode = "default" if mode == "auto" else mode
        for w, runs in m["workloads"].items():
            if not runs:
                continue
            key = f"{mode}:{'batch1' if w == 'batch1' else 'prompt_heavy' if w == 'prompt_heavy' else 'batched'}"
            ratio = _mean(runs["ifb"], "output_tokens_per_s") / _mean(runs["llama.cpp"], "output_tokens_per_s")
            ratios, ties = groups.setdefault(key, ([], []))
            (ties.append(f"{m['title']}, {w}") if is_tie(runs) else ratios.append(ratio))

    def said(key: str, what: str) -> str:
        ratios, ties = groups.get(key, ([], []))
        wins = f"{_span(ratios)}" if ratios else "no win"
        tie = f" (a tie: {', '.join(ties)})" if ties else ""
        return f"{what} {wins}{tie}"

    machine = summary["machine"]
    parts = [said("default:batch1", "batch 1"), said("default:batched", "the batched workloads"),
             said("default:prompt_heavy", "prompt-heavy")]
    dates = sorted({m.get("date", machine["date"]) for m in summary["models"]} | {machine["date"]})
    text = (f"Against llama.cpp's server on the same GGUF files ({machine['cpu']}, {machine['cores']} cores, "
            f"{' and '.join(dates)}; {len(summary['models'])} rows), ifb's output tokens/s over llama.cpp's at its "
            f"default precision: {'; '.join(parts)}.")
    for mode, what in OTHER_MODES.items():
        found = [said(f"{mode}:{w}", name) for w, name in (("batch1", "batch 1"), ("batched", "the batched workloads"),
                                                          ("prompt_heavy", "prompt-heavy")) if f"{mode}:{w}" in groups]
        if found:
            text += f" With `--quantization {mode}` ({what}): {'; '.join(found)}."
    fractions = {name: [100 * bandwidth_fraction(summary, m, name) for m in summary["models"]
                        if m["workloads"].get("batch1")] for name in SERVERS}
    if fractions["ifb"]:
        text += (f" At batch 1 ifb reads {_span(fractions['ifb'], ' %', 0)} of the measured read bandwidth's "
                 f"worth of the file's bytes a second, llama.cpp {_span(fractions['llama.cpp'], ' %', 0)}.")
    return text + " " + TIE_RULE


def render(summary: dict) -> str:
    machine = summary["machine"]
    rates = sorted({round(m.get("bandwidth_gb_s", summary["bandwidth_gb_s"]), 1) for m in summary["models"]}
                   or {round(summary["bandwidth_gb_s"], 1)})
    bandwidth = f"{rates[0]:.1f}" if len(rates) == 1 else f"{rates[0]:.1f}-{rates[-1]:.1f}"
    per_run = "" if len(rates) == 1 else ", measured at the start of each run that added models"
    lines = [f"Measured {machine['date']} on {machine['cpu']} ({machine['cores']} cores); read bandwidth "
             f"{bandwidth} GB/s (`torch.sum` over 1 GiB, best of 5{per_run}); llama.cpp from "
             f"llama-cpp-python {summary['llama_cpp_version']}'s vendored tree, `-np {SEATS} -t "
             f"{summary['threads']}`{' (its weight repacking on)' if summary['repack'] else ' --no-repack'}; ifb `--enable-in-flight-batching "
             f"--max-batch-size {SEATS}`; the same KV room ({summary['context']} tokens a seat). Output tokens/s, "
             "each server's mean of its two runs in A-B-B-A order." + (" **Quick run: not representative.**"
                                                                        if summary["quick"] else ""), ""]
    names = [w for w in summary["workloads"]]
    lines.append("| model | " + " | ".join(names) + " | batch-1 decode, of bandwidth | RSS loaded / peak (MiB) |")
    lines.append("|---|" + "---:|" * (len(names) + 2))
    for m in summary["models"]:
        cells = []
        for w in names:
            runs = m["workloads"].get(w)
            if not runs:
                cells.append("-")
                continue
            a, b = _mean(runs["ifb"], "output_tokens_per_s"), _mean(runs["llama.cpp"], "output_tokens_per_s")
            errors = sum(r["num_errors"] for rs in runs.values() for r in rs)
            verdict = f"{a / b:.2f}x, tie" if is_tie(runs) else f"**{a / b:.2f}x**"
            cells.append(f"{a:.1f} / {b:.1f} ({verdict})" + (f" {errors} errors" if errors else ""))
        frac = [f"{100 * bandwidth_fraction(summary, m, name):.0f} %" for name in SERVERS] \
            if m["workloads"].get("batch1") else []
        mem = " ; ".join(f"{m['memory_mib_loaded'][n]['rss']:.0f} / {m['memory_mib_after'][n]['peak']:.0f}"
                         for n in SERVERS)
        date = m.get("date", machine["date"])
        title = m["title"] + ("" if date == machine["date"] else f" (measured {date})")
        lines.append(f"| {title}, {m['bytes_per_token'] / 2**20:.0f} MiB a token | " + " | ".join(cells)
                     + f" | {' / '.join(frac) or '-'} | {mem} |")
    lines += ["", "Cells: ifb / llama.cpp (ratio). " + TIE_RULE + " Memory: ifb ; llama.cpp."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    keys = ["default"] + [f"{s}:{m}" for s in gguf_shapes.SHAPES for m in gguf_shapes.MIXES]
    parser.add_argument("--models", default=",".join(keys), help="Comma-separated subset of: %(default)s")
    parser.add_argument("--workloads", default=None, help="Comma-separated subset of the workloads (default: all).")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens a seat, in both servers.")
    parser.add_argument("--rate", type=float, default=4.0, help="Arrivals per second of the poisson workload.")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads.")
    parser.add_argument("--repack", action="store_true", help="Let llama.cpp repack weights (AMX).")
    parser.add_argument("--quantization", choices=("auto", "int16", "int8-prompt", "int8"), default="auto",
                        help="ifb's --quantization; int8: 8-bit activation codes, as llama.cpp's CPU path "
                             "(a row of its own: MODEL@int8).")
    parser.add_argument("--quick", action="store_true", help="A few short requests: checks the setup.")
    parser.add_argument("--publish", action="store_true", help="Write vs_llama_cpp.json and the README table.")
    parser.add_argument("--table-only", type=Path, metavar="SUMMARY",
                        help="Only publish the table of a run's summary.json (with --publish).")
    parser.add_argument("--append", action="store_true",
                        help="Add to (or replace models in) this date's summary instead of starting a new one.")
    parser.add_argument("--models-dir", type=Path, default=llama_cpp_build.cache_dir("models"))
    parser.add_argument("--llama-cpp-version", default=llama_cpp_build.DEFAULT_VERSION)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.publish and args.quick:
        parser.error("a quick run is not representative: --publish takes a full run")
    names = [w.name for w in workloads(args.rate)]
    wanted = [w.strip() for w in args.workloads.split(",")] if args.workloads else names
    unknown = set(wanted) - set(names)
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(sorted(unknown))}")

    def chosen_for(key: str) -> list[Workload]:
        scale = SCALES.get(key.partition(":")[0], 1.0)
        chosen = [w for w in workloads(args.rate, scale, key == "default") if w.name in wanted]
        return [quick(w) for w in chosen] if args.quick else chosen

    if args.table_only is not None:
        summary = json.loads(args.table_only.read_text())
        print(render(summary))
        if args.publish:
            publish(summary)
        return 0
    binary = llama_cpp_build.build(args.llama_cpp_version)
    vocab_dir = llama_cpp_build.cache_dir(args.llama_cpp_version) / "src" / "models"
    args.models_dir.mkdir(parents=True, exist_ok=True)
    date = dt.date.today().isoformat()
    out_dir = RUNS_DIR / f"{date}-llama-cpp{'-quick' if args.quick else ''}"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"machine": machine_info(quick=args.quick), "bandwidth_gb_s": read_bandwidth(),
               "llama_cpp_version": args.llama_cpp_version, "threads": args.threads, "repack": args.repack,
               "context": args.context, "quick": args.quick, "workloads": wanted, "models": []}
    print(f"read bandwidth {summary['bandwidth_gb_s']:.1f} GB/s", flush=True)
    previous = out_dir / "summary.json"
    if args.append and previous.exists():  # earlier models stay, each with the bandwidth of its own run
        earlier = json.loads(previous.read_text())
        summary["models"] = earlier["models"]
        summary["workloads"] = list(dict.fromkeys(earlier["workloads"] + summary["workloads"]))
    for key in [k.strip() for k in args.models.split(",") if k.strip()]:
        model = default_model() if key == "default" else shape_model(key, args.models_dir, vocab_dir, args.context)
        print(f"== {model.title}", flush=True)
        measured = measure_model(model, binary, chosen_for(key), out_dir, args)
        measured["bandwidth_gb_s"] = summary["bandwidth_gb_s"]
        summary["models"] = [m for m in summary["models"] if m["model"] != measured["model"]] + [measured]
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n" + render(summary))
    if args.publish:
        publish(summary)
    return 0


def replace_block(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what lies between ``begin`` and ``end`` replaced by ``body``."""
    if begin not in text or end not in text:
        raise ValueError(f"the markers {begin} ... {end} are missing")
    head, rest = text.split(begin, 1)
    return head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1]


def published_texts(summary: dict) -> dict[Path, str]:
    """Each README as ``summary`` writes it: the table and the ranges (``benchmarks/README.md``), and
    the ranges again in the top-level README."""
    table = replace_block(README.read_text(), BEGIN, END, render(summary))
    return {README: replace_block(table, PROSE_BEGIN, PROSE_END, render_prose(summary)),
            TOP_README: replace_block(TOP_README.read_text(), PROSE_BEGIN, PROSE_END, render_prose(summary))}


def publish(summary: dict) -> None:
    """``summary`` as ``vs_llama_cpp.json``, and its table and ranges in the READMEs between the markers."""
    SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")
    for path, text in published_texts(summary).items():
        path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
