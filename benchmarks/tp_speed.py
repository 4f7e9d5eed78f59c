"""Tensor parallelism on this machine: decode tokens/s on one rank and on N gloo ranks, and the bytes
rank 0 broadcasts each step.

Two models:

- ``--model default``: the default model (SmolLM2-135M, dequantized to float32 on both sides); its 9
  heads and 3 KV heads divide by 3, not by 2, so it runs on 1 and 3 ranks;
- ``--model shape``: a random-weight GGUF of Qwen2.5-0.5B's shape (``gguf_shapes``; 14 heads, 2 KV
  heads: it divides by 2) in ``--mix`` (Q8_0 by default: its down projection's 4864 input features
  split into 2432 a rank, whole 32-weight blocks; Q4_K_M's K-quant super-blocks of 256 would be cut,
  and that split is refused), run on its blocks on 1 and 2 ranks, with the default model's tokenizer
  (so its vocabulary, 49152, not Qwen's 151936).

The runs alternate A-B-B-A so a drifting load hits both alike.

    python benchmarks/tp_speed.py [--model default|shape] [--ranks 1 3] [--batch 4] [--tokens 64]
        [--out bench-results/tp_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec

sys.path.insert(0, str(Path(__file__).parent))
import gguf_shapes  # noqa: E402


def run(model: str | None, ranks: int, batch: int, tokens: int, quantization: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Write a story about the number {i}." for i in range(batch)]
    with LLM(model, tensor_parallel_size=ranks, enable_in_flight_batching=True, max_batch_size=batch,
             max_kv_cache_capacity=4096, quantization=quantization) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
        started = time.perf_counter()
        handles = [llm.engine.submit(RequestSpec(prompt=p, params=params)) for p in prompts]
        made = sum(len(h.result().token_ids) for h in handles)
        elapsed = time.perf_counter() - started
        sizes = list(getattr(llm.deployment.runtime, "command_bytes", []))
    out = {"ranks": ranks, "batch": batch, "tokens": made, "seconds": round(elapsed, 2),
           "tokens_per_s": round(made / elapsed, 1), "cores": os.cpu_count(),
           "load_average": round(os.getloadavg()[0], 1)}
    if sizes:
        decode = sizes[-tokens // 2:]  # the late steps: decodes only
        out["command_bytes"] = {"median_decode_step": statistics.median(decode), "max_step": max(sizes)}
    return out


def shape_gguf(directory: Path, mix: str, layers: int | None) -> Path:
    from ifb_plugins.text.default_model import resolve_model

    vocab = Path(resolve_model(None))  # its tokenizer fields, copied whole
    shape = attrs.evolve(gguf_shapes.SHAPES["qwen2.5-0.5b"], vocab=49152)
    if layers:
        shape = attrs.evolve(shape, num_layers=layers)
    path = directory / f"qwen2.5-0.5b-shape-{mix}.gguf"
    counts = gguf_shapes.write_gguf(path, shape, mix, vocab=vocab)
    print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {shape.num_layers} layers, tensors {counts}",
          flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("default", "shape"), default="default")
    parser.add_argument("--mix", default="Q8_0")
    parser.add_argument("--layers", type=int, default=None, help="the shape's layers (default: all 24)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "bench-results" / "tp_speed.json")
    args = parser.parse_args()
    ranks = args.ranks or ([1, 3] if args.model == "default" else [1, 2])
    order = [*ranks, *reversed(ranks)]  # A-B-B-A
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = None if args.model == "default" else str(shape_gguf(Path(tmp), args.mix, args.layers))
        quantization = "none" if args.model == "default" else "auto"
        for n in order:
            results.append({"model": args.model, **({"mix": args.mix} if model else {}),
                            **run(model, n, args.batch, args.tokens, quantization)})
            print(json.dumps(results[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
