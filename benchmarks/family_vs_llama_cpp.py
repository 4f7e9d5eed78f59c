"""Qwen3.5 and gpt-oss random-weight GGUFs: decode and prefill tokens/s, ifb against llama.cpp's server.

The files are written by ``family_shapes`` in llama.cpp's layout (Qwen3.5 2B class in ``Q8_0``;
gpt-oss-20b's shape with ``MXFP4`` experts, scaled down in layers with ``--gpt-oss-layers`` when
the whole model does not fit beside the machine's other work). Each server is started on the
same file with one seat and the same context; a server that cannot load a file is recorded with
the reason its log gives, and the other is measured alone. Both are measured the same way, from
the client, one request at a time, greedy:

- prefill: a prompt of ``--prompt-words`` words and one output token: prompt tokens / seconds;
- decode: a 4-word prompt and ``--decode-tokens`` tokens, less the same prompt's one-token request:
  (tokens - 1) / the difference in seconds.

Each measurement is repeated ``--repeats`` times in A-B-B-A order (every prompt new: no prompt
cache can skip a prefill), the mean kept with the spread (worst / best).

    python benchmarks/family_vs_llama_cpp.py --out bench-results/family_vs_llama_cpp.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import attrs
import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import family_shapes  # noqa: E402
import llama_cpp_build  # noqa: E402
from run_all import stop, wait_healthy  # noqa: E402
from vs_llama_cpp import Model, rss_mib, start_server  # noqa: E402

MODELS_DIR = HERE.parent / "bench-results" / "models"
WORDS = "river stone quiet number garden light paper window over under seven market yellow silver".split()


def write_models(gpt_oss_layers: int, qwen_layers: int, vocab: Path) -> list[tuple[Model, str]]:
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    out = []
    qwen = attrs.evolve(family_shapes.QWEN35_2B, num_layers=qwen_layers)
    oss = attrs.evolve(family_shapes.GPT_OSS_20B, num_layers=gpt_oss_layers)
    for shape, write, title in (
            (qwen, family_shapes.write_qwen35, f"Qwen3.5 2B class, Q8_0, {qwen_layers} layers"),
            (oss, family_shapes.write_gpt_oss,
             f"gpt-oss-20b shape, MXFP4 experts, {gpt_oss_layers} of 24 layers")):
        path = MODELS_DIR / f"{shape.name}-random-{shape.num_layers}l.gguf"
        if not path.exists():
            print(f"writing {path.name} ...", flush=True)
            partial = path.with_suffix(".partial")
            write(partial, shape, vocab)
            partial.rename(path)
        out.append((Model(shape.name, path, path.stat().st_size, title), title))
    return out


def prompt(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def request(url: str, text: str, max_tokens: int) -> tuple[float, int, int]:
    """(seconds, prompt tokens, output tokens) of one greedy completion."""
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "model": "m"}
    started = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=1800)
    seconds = time.perf_counter() - started
    r.raise_for_status()
    usage = r.json()["usage"]
    return seconds, int(usage["prompt_tokens"]), int(usage["completion_tokens"])


def measure(url: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    seconds, prompt_tokens, _ = request(url, prompt(args.prompt_words, seed), 1)
    short = prompt(4, seed + 1)
    first, _, _ = request(url, short + " a", 1)
    whole, _, produced = request(url, short + " b", args.decode_tokens)
    return {"prefill_tokens_per_s": prompt_tokens / seconds, "prompt_tokens": prompt_tokens,
            "decode_tokens_per_s": (produced - 1) / max(whole - first, 1e-9)}


def start(name: str, model: Model, binary: Path, log: Path, args: argparse.Namespace):
    """The server's process and address, or (None, why) when it cannot load the file."""
    proc, url = start_server(name, model, binary, args.context, log, repack=False, threads=args.threads)
    try:
        wait_healthy(url, proc, args.startup_timeout)
        request(url, "hello", 2)  # the first forward passes pay for allocation
        return proc, url
    except Exception as exc:  # noqa: BLE001 - any failure to come up is a failure to load, recorded
        stop(proc)
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "rror" in line or "refus" in line or "not" in line),
                   lines[-1] if lines else repr(exc))
        return None, why.strip()[-400:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpt-oss-layers", type=int, default=6)
    parser.add_argument("--qwen-layers", type=int, default=24)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--decode-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=1, help="A-B-B-A rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    binary = llama_cpp_build.build()  # cached: the built server when there is one
    vocab = llama_cpp_build.cache_dir(llama_cpp_build.DEFAULT_VERSION) / "src" / "models" / "ggml-vocab-qwen2.gguf"
    log_dir = HERE.parent / "bench-results" / "family-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": {}}
    for model, title in write_models(args.gpt_oss_layers, args.qwen_layers, vocab):
        entry: dict = {"title": title, "file_gib": model.path.stat().st_size / 2**30, "servers": {}}
        servers = {}
        for name in ("ifb", "llama.cpp"):
            proc, url_or_why = start(name, model, binary, log_dir / f"{model.key}.{name}.log", args)
            if proc is None:
                entry["servers"][name] = {"loaded": False, "why": url_or_why}
                print(f"{model.key}: {name} could not load it: {url_or_why}", flush=True)
            else:
                servers[name] = (proc, url_or_why)
                entry["servers"][name] = {"loaded": True, "rss_mib": rss_mib(proc.pid), "runs": []}
        try:
            order = [n for pair in range(args.repeats) for n in (("ifb", "llama.cpp", "llama.cpp", "ifb"))]
            for i, name in enumerate(order):
                if name in servers:
                    run = measure(servers[name][1], 1000 * i, args)
                    entry["servers"][name]["runs"].append(run)
                    print(f"{model.key} {name:9} {json.dumps({k: round(v, 2) for k, v in run.items()})}", flush=True)
        finally:
            for proc, _ in servers.values():
                stop(proc)
        for name in servers:
            runs = entry["servers"][name]["runs"]
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
                values = [r[key] for r in runs]
                entry["servers"][name][key] = sum(values) / len(values)
                entry["servers"][name][key.replace("_per_s", "_spread")] = min(values) / max(values)
        report["models"][model.key] = entry
    print(f"\n{'model':16} {'server':10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for key, entry in report["models"].items():
        for name, s in entry["servers"].items():
            if s["loaded"]:
                print(f"{key:16} {name:10} {s['prefill_tokens_per_s']:14.1f} {s['decode_tokens_per_s']:13.2f}")
            else:
                print(f"{key:16} {name:10} {'cannot load: ' + s['why'][:80]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
