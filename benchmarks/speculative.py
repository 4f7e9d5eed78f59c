"""Speculative decoding on the default model, side by side in one run.

1. batch 1, an input-grounded workload (repeat / rewrite a given piece of code): decode tokens/s without
   drafts and with n-gram prompt lookup (auto policy, and drafting K every step);
2. a ``--quantization none`` target alone and with its own GGUF drafting on the int8-activation kernels;
3. 16 busy seats on the same workload: throughput without drafts and with n-gram drafts under the policy;
4. the policy's input: a step's time for 1..9 positions of one sequence (the cost of a verified position).

    python benchmarks/speculative.py [--max-tokens 96] [--out bench-results/speculative.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec

CODE = (Path(__file__).resolve().parents[1] / "core" / "kv.py").read_text()[:1500]
TASKS = [
    f"Repeat this Python code exactly, then say what it does:\n\n{CODE}",
    f"Rewrite this code with the class renamed to BlockPool and nothing else changed:\n\n{CODE}",
]


def decode_rate(llm: LLM, prompt: str, max_tokens: int) -> float:
    """Decode tokens/s of one request: from its first token to its last."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first, n = None, 0
    for out in llm.stream(messages=[{"role": "user", "content": prompt}], params=params):
        if out.token_ids and first is None:
            first, n = time.perf_counter(), 0
        n += len(out.token_ids)
    return (n - 1) / (time.perf_counter() - first)


def batch1(options: dict, max_tokens: int) -> dict:
    with LLM(**options) as llm:
        decode_rate(llm, "Hi", 4)  # warm-up
        rates = [decode_rate(llm, task, max_tokens) for task in TASKS]
        spec = llm.health().get("speculative_decoding")
    out = {"decode_tok_s": statistics.mean(rates), "per_task": rates}
    if spec:
        out["acceptance_rate"] = spec["acceptance_rate"]
        out["accepted_per_drafting_step"] = spec["accepted"] / max(1, spec["steps_drafted"])
    return out


def busy(options: dict, num_seats: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(enable_in_flight_batching=True, max_batch_size=num_seats, max_num_batched_tokens=512, **options) as llm:
        specs = [RequestSpec(messages=({"role": "user", "content": TASKS[i % 2] + f"\n# {i}"},), params=params)
                 for i in range(num_seats)]
        start = time.perf_counter()
        results = [h.result() for h in [llm.engine.submit(s) for s in specs]]
        wall = time.perf_counter() - start
        spec = llm.health().get("speculative_decoding")
    tokens = sum(len(r.token_ids) for r in results)
    out = {"output_tok_s": tokens / wall, "wall_s": wall}
    if spec:
        out["drafted"], out["accepted"], out["steps_drafted"] = spec["drafted"], spec["accepted"], spec["steps_drafted"]
    return out


def position_cost(quantization: str) -> dict:
    """One sequence's step time for 1..9 positions after a 512-token context (ms, medians of 7)."""
    from ifb.capabilities import DeployConfig
    from ifb.runtime import NewSeq, ScheduledSeq, ScheduledStep
    from ifb_plugins.text import declare
    from ifb_plugins.text.build import load_text_runtime
    from ifb_plugins.text.default_model import resolve_model

    config = DeployConfig(model=str(resolve_model(None)), options={"quantization": quantization},
                          max_kv_cache_capacity=1024)
    runtime = load_text_runtime(config, declare(config))
    prompt = tuple(range(100, 612))
    params = SamplingParams(temperature=0.0)
    runtime.execute(ScheduledStep(1, (ScheduledSeq("r", 0, prompt, 0, tuple(range(40)), True),),
                                  (NewSeq("r", 0, prompt, len(prompt), params),)))
    times = {}
    for n in (1, 2, 3, 5, 9):
        samples = []
        for i in range(10):
            runtime.seats.seats["r"].token_ids = list(prompt)
            step = ScheduledStep(2, (ScheduledSeq("r", 0, tuple(range(200, 200 + n)), len(prompt), (), True),))
            t = time.perf_counter()
            runtime.execute(step)
            if i >= 3:  # the first runs of a shape warm its kernels up
                samples.append(time.perf_counter() - t)
        times[n] = statistics.median(samples) * 1e3
    per_position = statistics.mean((times[n] - times[1]) / (n - 1) / times[1] for n in (2, 3, 5, 9))
    return {"step_ms": times, "position_cost": per_position}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--none-max-tokens", type=int, default=32)
    parser.add_argument("--seats", type=int, default=16)
    parser.add_argument("--busy-max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "bench-results" / "speculative.json")
    args = parser.parse_args()
    ngram = dict(speculative_method="ngram", num_speculative_tokens=6)
    report: dict = {}
    report["position_cost"] = {mode: position_cost(mode) for mode in ("auto", "none")}
    print(json.dumps(report["position_cost"], indent=1), flush=True)
    report["batch1"] = {
        "plain": batch1({}, args.max_tokens),
        "ngram": batch1(ngram, args.max_tokens),
        "ngram_always": batch1({**ngram, "speculative_policy": "always"}, args.max_tokens),
    }
    print(json.dumps(report["batch1"], indent=1), flush=True)
    none = {"quantization": "none"}
    report["none_target"] = {
        "plain": batch1(none, args.none_max_tokens),
        "int8_draft": batch1({**none, "speculative_model": "smollm2-135m-instruct", "num_speculative_tokens": 4},
                             args.none_max_tokens),
    }
    print(json.dumps(report["none_target"], indent=1), flush=True)
    report["busy"] = {"plain": busy({}, args.seats, args.busy_max_tokens),
                      "ngram": busy(ngram, args.seats, args.busy_max_tokens)}
    print(json.dumps(report["busy"], indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
