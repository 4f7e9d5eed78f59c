"""Prefill and decode tokens/s on a GPU at 1, 16 and 64 seats: ifb against vLLM, side by side.

The models are random-weight Qwen2.5 shapes that transformers builds and ``save_pretrained``s in
bfloat16 (with a small byte-level tokenizer; the requests are token ids):

- ``1.5b``: Qwen2.5-1.5B (hidden 1536, 28 layers, 12 query / 2 KV heads, MLP 8960, vocabulary
  151936, tied head);
- ``7b``: Qwen2.5-7B (hidden 3584, 28 layers, 28 / 4 heads, MLP 18944, vocabulary 152064);
- ``tiny``: two layers of hidden 64, for a smoke run on the CPU.

Each engine serves ``seats`` requests of ``--prompt-len`` random token ids at once, greedy, EOS
ignored, with as many seats in its batch: prefill tokens/s is ``seats * prompt_len`` over the
time of a run that generates one token; decode tokens/s is ``seats * (T - 1)`` over the time a
run of ``T = --decode-tokens`` tokens takes beyond that. Both engines are measured the same way
through their offline ``LLM`` APIs (ifb under in-flight batching), each in a process of its own
(the GPU's memory is the engine's alone), in the order ifb, vLLM, vLLM, ifb (A-B-B-A); each
engine's two runs are reported with their mean, and a ratio whose runs overlap is a tie. vLLM
runs only where it imports.

    python benchmarks/gpu.py                                   # 1.5b and 7b on cuda
    python benchmarks/gpu.py --shape tiny --device cpu --seats 1 2 --prompt-len 8 --decode-tokens 4

The raw run goes to ``bench-results/gpu-<time>.json`` (out of git).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True),
}


def save_model(shape: str, directory: Path, seed: int = 0) -> Path:
    """A random-weight Qwen2.5 model of ``shape``, saved by transformers in bfloat16."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))  # the test tree's tokenizer saver
    from tests.models.text import save_tiny_tokenizer

    path = directory / f"qwen2.5-{shape}"
    if (path / "config.json").exists():
        return path
    config = transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-6,
                                      rope_theta=1e6, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 300)) for _ in range(length)] for _ in range(num)]


def run_ifb(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ifb import LLM
    from ifb.params import RequestSpec, SamplingParams

    most = max(args.seats)
    llm = LLM(str(model), device=args.device, dtype=args.dtype, enable_in_flight_batching=True,
              max_batch_size=most, max_num_batched_tokens=max(args.prompt_len * 4, most),
              max_queued_requests=most, queue_timeout=3600.0)

    def generate(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        handles = [llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=params)) for p in batch]
        outs = [h.result() for h in handles]
        elapsed = time.perf_counter() - started
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return elapsed

    try:
        return {"device": llm.deployment.config.device, **measure(generate, args)}
    finally:
        llm.close()


def run_vllm(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    import vllm

    llm = vllm.LLM(model=str(model), dtype=args.dtype if args.dtype != "auto" else "bfloat16",
                   max_num_seqs=max(args.seats), gpu_memory_utilization=0.85, seed=0)

    def generate(batch: list[list[int]], max_tokens: int) -> float:
        params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    return {"device": "cuda", "vllm": vllm.__version__, **measure(generate, args)}


def measure(generate, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill and decode tokens/s per seat count (see the module docstring), after a warm-up run."""
    rows = {}
    generate(prompts(min(args.seats), args.prompt_len, 300, seed=99), 2)
    for seats in args.seats:
        batch = prompts(seats, args.prompt_len, 300, seed=seats)
        first = generate(batch, 1)
        whole = generate(batch, args.decode_tokens)
        rows[str(seats)] = {"prefill_tok_s": seats * args.prompt_len / first,
                            "decode_tok_s": seats * (args.decode_tokens - 1) / max(whole - first, 1e-9),
                            "first_s": first, "whole_s": whole}
    return {"rows": rows}


def machine(device: str) -> dict[str, Any]:
    import platform

    import torch

    info = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def worker(args: argparse.Namespace) -> int:
    run = run_vllm if args.worker == "vllm" else run_ifb
    print(json.dumps(run(Path(args.model), args)))
    return 0


def run_order(engines: list[str]) -> list[str]:
    """Each engine twice: A-B-B-A for two, so that a drift of the machine's speed hits both alike."""
    return [engines[0], engines[1], engines[1], engines[0]] if len(engines) == 2 else engines * 2


def table(results: dict[str, Any]) -> str:
    lines = ["| shape | seats | engine | prefill tok/s (runs) | decode tok/s (runs) |", "|---|---|---|---|---|"]
    for shape, engines in results.items():
        seats = next(iter(engines.values()))[0]["rows"].keys()
        for s in seats:
            for engine, runs in engines.items():
                cells = []
                for key in ("prefill_tok_s", "decode_tok_s"):
                    values = [r["rows"][s][key] for r in runs]
                    cells.append(f"{sum(values) / len(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})")
                lines.append(f"| {shape} | {s} | {engine} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable [default: 1.5b, 7b]")
    parser.add_argument("--seats", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--engines", nargs="+", default=["ifb", "vllm"], choices=["ifb", "vllm"])
    parser.add_argument("--model-dir", type=Path, default=None, help="where the models are saved (kept)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=["ifb", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2")
    if args.worker:
        return worker(args)
    engines = [e for e in args.engines if e != "vllm" or importlib.util.find_spec("vllm") is not None]
    if engines != args.engines:
        print("vLLM is not installed here: ifb alone", file=sys.stderr)
    order = run_order(engines)
    results: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or Path(tmp)
        for shape in args.shape or ["1.5b", "7b"]:
            model = save_model(shape, model_dir)
            results[shape] = {e: [] for e in engines}
            for engine in order:
                command = [sys.executable, __file__, "--worker", engine, "--model", str(model), "--device",
                           args.device, "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
                           "--decode-tokens", str(args.decode_tokens), "--seats", *map(str, args.seats)]
                proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    raise RuntimeError(f"{engine} on {shape} failed:\n{proc.stderr[-4000:]}")
                results[shape][engine].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    report = {"machine": machine(args.device), "settings": {k: v for k, v in vars(args).items()
                                                            if k not in ("worker", "model", "out", "model_dir")},
              "order": order, "results": results}
    out = args.out or ROOT / "bench-results" / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(table(results))
    print(f"raw run: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
