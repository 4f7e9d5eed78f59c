"""Tensor parallelism on this machine: decode tokens/s of the default model on one rank and on
three gloo ranks (its 9 heads and 3 KV heads divide by 3, not by 2; float32 weights on both: a GGUF
is dequantized under tensor parallelism), and the bytes rank 0 broadcasts each step.

    python benchmarks/tp_speed.py [--ranks 1 3] [--batch 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec


def run(ranks: int, batch: int, tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Write a story about the number {i}." for i in range(batch)]
    with LLM(tensor_parallel_size=ranks, enable_in_flight_batching=True, max_batch_size=batch,
             max_kv_cache_capacity=4096, quantization="none") as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
        started = time.perf_counter()
        handles = [llm.engine.submit(RequestSpec(prompt=p, params=params)) for p in prompts]
        made = sum(len(h.result().token_ids) for h in handles)
        elapsed = time.perf_counter() - started
        sizes = list(getattr(llm.deployment.runtime, "command_bytes", []))
    out = {"ranks": ranks, "batch": batch, "tokens": made, "seconds": round(elapsed, 2),
           "tokens_per_s": round(made / elapsed, 1), "cores": os.cpu_count()}
    if sizes:
        decode = sizes[-tokens // 2:]  # the late steps: decodes only
        out["command_bytes"] = {"median_decode_step": statistics.median(decode), "max_step": max(sizes)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    for ranks in args.ranks:
        print(json.dumps(run(ranks, args.batch, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
