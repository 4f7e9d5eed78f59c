"""What a preempted request costs to bring back: recomputation against a swap to a host pool.

On the default model, for a few context lengths: the time to prefill the
context again (the recomputation the scheduler does: ``prefill_only``, chunks
of 512 tokens) against the time to copy its KV blocks out of the cache into a
host pool and back in (a swap: ``index_select`` out, ``index_copy_`` in, every
layer's keys and values, on one thread; pinned host memory on CUDA). Median of
``--repeats``.

    python benchmarks/preemption_cost.py                  # ~1 minute on 2 cores
    python benchmarks/preemption_cost.py --device cuda --out cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ifb import LLM


def _timed(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(lengths: list[int], repeats: int, device: str) -> list[dict]:
    capacity = max(lengths) + 64
    with LLM(max_batch_size=1, max_kv_cache_capacity=capacity, device=device) as llm:
        runtime = llm.deployment.runtime
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        caches = runtime.kv_caches
        gen = torch.Generator().manual_seed(0)
        rows = []
        for n in lengths:
            tokens = torch.randint(100, runtime.vocab_size, (n,), generator=gen).tolist()
            num_blocks = -(-n // runtime.kv_block_size)
            block_ids = list(range(num_blocks))
            index = torch.tensor(block_ids, device=runtime.device)
            host = [(torch.empty((num_blocks, *k.shape[1:]), dtype=k.dtype, pin_memory=device == "cuda"),
                     torch.empty((num_blocks, *v.shape[1:]), dtype=v.dtype, pin_memory=device == "cuda"))
                    for k, v in caches]

            def swap_out():
                for (k, v), (hk, hv) in zip(caches, host):
                    hk.copy_(k.index_select(0, index), non_blocking=True)
                    hv.copy_(v.index_select(0, index), non_blocking=True)

            def swap_in():
                for (k, v), (hk, hv) in zip(caches, host):
                    k.index_copy_(0, index, hk.to(k.device, non_blocking=True))
                    v.index_copy_(0, index, hv.to(v.device, non_blocking=True))

            recompute = _timed(lambda: runtime.prefill_only(tokens, block_ids), repeats, sync)
            # the copies are memory-bound: one thread, as OpenMP workers only add wake-ups to them
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                out = _timed(swap_out, repeats, sync)
                back = _timed(swap_in, repeats, sync)
            finally:
                torch.set_num_threads(threads)
            kv_bytes = sum(t.numel() * t.element_size() for pair in host for t in pair)
            rows.append({"tokens": n, "recompute_s": recompute, "swap_out_s": out, "swap_in_s": back,
                         "swap_s": out + back, "kv_mib": kv_bytes / 2**20,
                         "recompute_over_swap": recompute / (out + back)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = measure([int(x) for x in args.lengths.split(",")], args.repeats, args.device)
    print(f"{'tokens':>7} {'KV MiB':>7} {'recompute s':>12} {'swap out+in s':>14} {'ratio':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['kv_mib']:>7.1f} {r['recompute_s']:>12.3f} {r['swap_s']:>14.4f} "
              f"{r['recompute_over_swap']:>7.0f}x")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
