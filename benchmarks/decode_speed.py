"""Decode speed of the default model, side by side in one process: ifb (quantized and float32)
against the transformers ``generate`` baseline on the same GGUF weights.

For each ifb weight path (``--modes``; ``quantization="auto"``: the GGUF's blocks times
15-bit integer activations, ``"int8"``: times 8-bit ones, ``"weights-only"``: times float32
ones; ``"none"``: float32 weights):

- batch 1 through ``ifb.LLM(enable_in_flight_batching=True)``: one greedy request of N tokens
  (``ignore_eos``) streamed after a warm-up; decode tokens/s is ``(N - 1) / (t_last - t_first)``,
  the end-to-end rate includes the prefill;
- batch 1, 8 and C directly: ``runtime.execute`` on hand-built decode steps, from a worker
  thread as the engine runs it (no scheduler, no detokenizer);
- C concurrent requests (threads x N tokens, ``ignore_eos``) through the same LLM: aggregate tokens/s.

The baseline (``hf_baseline.py``) is measured in the same run, so the printed ratios compare
numbers taken under the same machine load. Greedy throughout.

    python benchmarks/decode_speed.py                    # ~5 minutes on 2 cores
    python benchmarks/decode_speed.py --skip-hf --out speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPT = "Write a long story about a lighthouse keeper and a storm."
CONCURRENT_PROMPTS = (
    "Tell me about a sailor who finds a silver compass.",
    "Describe a busy market in a mountain village at dawn.",
    "Explain how rivers shape valleys over thousands of years, step by step.",
    "Invent a legend about a dragon that guards an orchard.",
    "Write a letter from a farmer to a friend in the city.",
    "Summarise the life cycle of a butterfly for a child.",
    "List the things a traveller should pack for a long winter journey.",
    "Write a long story about a lighthouse keeper and a storm.",
)


def _stream_one(llm: Any, prompt: str, num_tokens: int) -> tuple[int, float, float, float]:
    """(tokens, wall seconds, first-token time, last-token time) of one streamed greedy request."""
    from ifb import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    started = time.perf_counter()
    first = last = started
    count = 0
    for out in llm.stream(prompt, params):
        if out.token_ids:
            now = time.perf_counter()
            if count == 0:
                first = now
            last = now
            count += len(out.token_ids)
    return count, time.perf_counter() - started, first, last


def measure_llm(quantization: str, num_tokens: int, concurrency: int, repeats: int) -> dict:
    from ifb import LLM

    llm = LLM(enable_in_flight_batching=True, max_batch_size=max(8, concurrency), quantization=quantization)
    try:
        _stream_one(llm, "Hello", 16)  # warm-up: allocation, kernel selection, helper threads
        decode, e2e = [], []
        for _ in range(repeats):
            n, wall, first, last = _stream_one(llm, PROMPT, num_tokens)
            decode.append((n - 1) / (last - first))
            e2e.append(n / wall)
        results: list[int] = [0] * concurrency

        def worker(i: int) -> None:
            results[i] = _stream_one(llm, CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)], num_tokens)[0]

        aggregate = []
        for _ in range(repeats):
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            aggregate.append(sum(results) / (time.perf_counter() - started))
        direct = {b: measure_direct(llm.deployment.runtime, b) for b in direct_batches(concurrency)}
    finally:
        llm.close()
    return {
        "batch1_decode_tokens_per_s": max(decode),
        "batch1_e2e_tokens_per_s": max(e2e),
        f"concurrent{concurrency}_aggregate_tokens_per_s": max(aggregate),
        **{f"direct_batch{b}_decode_tokens_per_s": rate for b, rate in direct.items()},
    }


def direct_batches(concurrency: int) -> tuple[int, ...]:
    """The batch sizes measured on ``runtime.execute``: 1, 8, and the concurrency's (all seats)."""
    return tuple(sorted({1, 8, concurrency}))


def measure_direct(runtime: Any, batch: int, context: int = 100, steps: int = 40) -> float:
    """Decode tokens/s of ``runtime.execute`` on ``batch`` sequences of ``context`` tokens, from a worker thread."""
    from ifb.params import SamplingParams
    from ifb.runtime import NewSeq, ScheduledSeq, ScheduledStep

    params = SamplingParams(temperature=0.0, max_tokens=context + steps + 8, ignore_eos=True)
    block_size = runtime.kv_block_size
    per_seq = (context + steps + 8) // block_size + 1
    times: list[float] = []
    failures: list[BaseException] = []

    def run() -> None:
        ids: list[list[int]] = []
        for b in range(batch):  # each sequence seated and prefilled (its whole block table sent once)
            blocks = tuple(range(b * per_seq, (b + 1) * per_seq))
            prompt = tuple((7 * b + i) % 1000 + 10 for i in range(context))
            out = runtime.execute(ScheduledStep(0, (ScheduledSeq(f"d{b}", b, prompt, 0, blocks, True),),
                                                (NewSeq(f"d{b}", b, prompt, context, params),)))
            ids.append(list(prompt) + [out.seqs[0].token_id])
        for i in range(steps + 3):  # then decode steps carry only the new token
            step = ScheduledStep(i + 1, tuple(ScheduledSeq(f"d{b}", b, (seq[-1],), len(seq) - 1, (), True)
                                              for b, seq in enumerate(ids)))
            started = time.perf_counter()
            out = runtime.execute(step)
            if i >= 3:  # the first steps warm up
                times.append(time.perf_counter() - started)
            for seq, seq_out in zip(ids, out.seqs):
                seq.append(seq_out.token_id)

    def guarded() -> None:
        try:
            run()
        except BaseException as e:  # re-raised in the caller: a worker's error must not read as "no data"
            failures.append(e)

    worker = threading.Thread(target=guarded)
    worker.start()
    worker.join()
    if failures:
        raise failures[0]
    return batch / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per ifb request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="runs per ifb measurement (the best is kept)")
    parser.add_argument("--hf-tokens", type=int, default=64, help="tokens per transformers generate call")
    parser.add_argument("--hf-repeats", type=int, default=1)
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline (no ratios)")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON")
    from ifb_plugins.text.build import QUANTIZATION_MODES

    parser.add_argument("--modes", nargs="+", default=list(QUANTIZATION_MODES), choices=QUANTIZATION_MODES,
                        help="ifb quantization modes to measure")
    args = parser.parse_args(argv)

    import torch

    report: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "tokens": args.tokens,
                              "concurrency": args.concurrency}
    for quantization in args.modes:
        print(f"ifb, quantization={quantization} ...", flush=True)
        report[f"ifb_{quantization}"] = measure_llm(quantization, args.tokens, args.concurrency, args.repeats)
        print(json.dumps(report[f"ifb_{quantization}"], indent=1), flush=True)
    if not args.skip_hf:
        sys.path.insert(0, str(HERE))
        import hf_baseline

        report["hf"] = hf_baseline.measure(num_tokens=args.hf_tokens, batch_size=args.concurrency,
                                           repeats=args.hf_repeats)
    print_table(report, args.concurrency, args.modes)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def print_table(report: dict, concurrency: int, modes: list[str]) -> None:
    hf = report.get("hf")
    base1 = hf["batch1_decode_tokens_per_s"] if hf else None
    base8 = hf["static_batch_generate_tokens_per_s"] if hf else None
    agg = f"concurrent{concurrency}_aggregate_tokens_per_s"
    rows = [("batch 1 decode (LLM, streamed)", "batch1_decode_tokens_per_s", base1),
            ("batch 1 end to end (LLM, prefill incl.)", "batch1_e2e_tokens_per_s", base1),
            *((f"batch {b} decode (runtime.execute)", f"direct_batch{b}_decode_tokens_per_s", base1 if b == 1 else base8)
              for b in direct_batches(concurrency)),
            (f"{concurrency} concurrent, aggregate (LLM)", agg, base8)]
    print(f"\n{'tokens/s':44} " + " ".join(f"{m:>12}" for m in modes) + "   (ratio to transformers)")
    for title, key, base in rows:
        values = [report[f"ifb_{m}"][key] for m in modes]
        ratios = " ".join(f"{v / base:5.1f}x" for v in values) if base else ""
        print(f"{title:44} " + " ".join(f"{v:12.1f}" for v in values) + f"   {ratios}")
    if hf:
        print(f"{'transformers generate, batch 1 decode':44} {base1:10.1f}")
        print(f"{'transformers generate, static batch ' + str(concurrency):44} {base8:10.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
