"""Guided requests in a running batch: served with the plain ones, against running each alone.

8 guided (JSON schema) and 8 plain requests arrive staggered (one every ``--gap`` seconds, guided and
plain alternating) at a 16-seat in-flight engine on the default model. Run four times in one process on
the same runtime, A-B-B-A:

- ``served``: this build's declaration: guided requests join the running batch and plain ones join theirs;
- ``runs-alone``: the spec's V0 policy (the runtime declared ``runs-alone`` for guided decoding): a guided
  request waits for the batch to drain, then runs with nobody joining.

Reported per run: aggregate tokens/s (generated tokens / wall time from the first arrival to the last
finish), steps in which guided and plain rows shared the forward, that every guided output
validates against its schema, and where a served step's time goes: the whole step, the forward, and the
guided work (masks computed on the worker thread, the step's wait for them after its forward, applying
them, advancing the matchers), per step with guided rows. Then, at 16 guided seats decoding together,
the step time with the masks computed while the forward runs (a worker thread) and after it (on the
engine thread). ``--rounds`` repeats the A-B-B-A round in the same process, so the ratios' spread is
measured rather than guessed; each leg records the machine's load average as it ended. The raw numbers
go to ``--out`` (under bench-results/, out of git).

    python benchmarks/guided_batching.py [--gap 0.05] [--max-tokens 64] [--rounds 3] [--out bench-results/guided_batching.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import attrs

from ifb import LLM, SamplingParams
from ifb.capabilities import OptionSupport, Support
from ifb.engine import RequestEngine
from ifb.params import RequestSpec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def validates(text: str) -> bool:
    """``text`` is a JSON value that SCHEMA accepts."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"}
            and isinstance(value["name"], str) and len(value["name"]) <= 16
            and isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
            and value["city"] in SCHEMA["properties"]["city"]["enum"])


def workload(max_tokens: int) -> list[RequestSpec]:
    specs = []
    for i in range(8):
        specs.append(RequestSpec(
            messages=[{"role": "user", "content": f"Describe person number {i} as JSON with name, age and city."}],
            params=SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens), extras={"response_format": FORMAT},
            request_id=f"guided-{i}"))
        specs.append(RequestSpec(
            messages=[{"role": "user", "content": f"Write a short story about the number {i}."}],
            params=SamplingParams(temperature=0.7, seed=100 + i, max_tokens=max_tokens, ignore_eos=True),
            request_id=f"plain-{i}"))
    return specs


def run(engine: RequestEngine, specs: list[RequestSpec], gap: float) -> dict:
    runtime = engine.runtime
    shared = [0, 0]  # steps with guided and plain rows together, all steps
    step_ms, forward_ms = [], []  # steps with guided rows: the whole step, its forward
    execute, hidden = runtime.execute, runtime._hidden

    def counting(step):
        ids = [s.request_id for s in step.seqs]
        shared[0] += any(i.startswith("guided") for i in ids) and any(i.startswith("plain") for i in ids)
        shared[1] += 1
        start = time.perf_counter()
        out = execute(step)
        if any(i.startswith("guided") for i in ids):
            step_ms.append((time.perf_counter() - start) * 1e3)
        return out

    def forward(step, seats):
        start = time.perf_counter()
        out = hidden(step, seats)
        if any(s.request_id.startswith("guided") for s in step.seqs):
            forward_ms.append((time.perf_counter() - start) * 1e3)
        return out

    stats = runtime.guided.stats
    before = attrs.asdict(stats)
    runtime.execute, runtime._hidden = counting, forward
    try:
        start = time.perf_counter()
        handles = []
        for spec in specs:
            handles.append(engine.submit(spec, wait=True))
            time.sleep(gap)
        results = [h.result() for h in handles]
        wall = time.perf_counter() - start
    finally:
        del runtime.execute, runtime._hidden
    spent = {k: (v - before[k]) / 1e6 / max(1, len(step_ms)) for k, v in attrs.asdict(stats).items() if k != "num_tokens"}
    tokens = sum(r.num_output_tokens for r in results)
    guided = [r for s, r in zip(specs, results) if s.request_id.startswith("guided")]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "shared_steps": shared[0],
            "steps": shared[1], "guided_valid": sum(validates(r.text) for r in guided), "guided": len(guided),
            "stalls_guided": engine.counters.stalls["stalls_guided"],
            # per step with guided rows, in ms: medians of the step and its forward, means of the guided work
            "guided_steps": len(step_ms), "step_ms": statistics.median(step_ms) if step_ms else 0.0,
            "forward_ms": statistics.median(forward_ms) if forward_ms else 0.0,
            "mask_compute_ms": spent["mask_ns"] - spent["apply_ns"], "mask_wait_ms": spent["wait_ns"],
            "mask_apply_ms": spent["apply_ns"], "advance_ms": spent["advance_ns"], "load_1m": os.getloadavg()[0]}


def mask_overlap(llm: LLM, num_steps: int) -> dict:
    """Mean step time at 16 guided seats decoding, masks overlapped with the forward and not."""
    runtime = llm.deployment.runtime
    out = {}
    for is_overlapped in (True, False):
        runtime.guided.is_overlapped = is_overlapped
        times = []
        execute = runtime.execute

        def timing(step):
            t = time.perf_counter()
            result = execute(step)
            if all(len(s.token_ids) == 1 for s in step.seqs) and len(step.seqs) == 16:
                times.append(time.perf_counter() - t)
            return result

        runtime.execute = timing
        try:
            params = SamplingParams(temperature=0.7, max_tokens=num_steps)
            fmt = {"type": "regex", "regex": "[a-z ]{%d}" % num_steps}  # never complete early: every row guided
            handles = [llm.engine.submit(RequestSpec(prompt_token_ids=(1, 2 + i), params=params,
                                                     extras={"response_format": fmt}), wait=True) for i in range(16)]
            for h in handles:
                h.result()
        finally:
            del runtime.execute
        out["overlapped" if is_overlapped else "after_forward"] = statistics.median(times) * 1e3
    runtime.guided.is_overlapped = True
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between arrivals")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mask-steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1, help="A-B-B-A rounds in this process")
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "bench-results" / "guided_batching.json")
    args = parser.parse_args()
    specs = workload(args.max_tokens)
    legs = ("served", "runs-alone", "runs-alone", "served") * args.rounds  # A-B-B-A, repeated
    runs: list[tuple[str, dict]] = []
    with LLM(enable_in_flight_batching=True, max_batch_size=16, max_num_batched_tokens=512) as llm:
        runtime, config, options = llm.deployment.runtime, llm.deployment.config, llm.engine.options
        runtime.guided.compile(FORMAT)  # the vocabulary pass happens once, before timing
        run(llm.engine, specs[:2], 0.0)  # warm-up
        llm.engine.shutdown()
        declared = runtime.caps
        alone_caps = attrs.evolve(declared, options={**declared.options, "guided_decoding": OptionSupport(
            Support.RUNS_ALONE, reason="the spec's V0 policy", stall_counter="stalls_guided")})
        for leg in legs:
            runtime.caps = declared if leg == "served" else alone_caps
            engine = RequestEngine(runtime, config, options)
            try:
                runs.append((leg, run(engine, specs, args.gap)))
            finally:
                engine.shutdown()
                runtime.caps = declared
        llm.deployment.engine = RequestEngine(runtime, config, options)
        masks = mask_overlap(llm, args.mask_steps)
    for name, r in runs:
        print(f"{name:>10}: {r['tokens_per_s']:6.1f} tokens/s ({r['tokens']} tokens in {r['wall_s']:.1f} s); "
              f"guided and plain shared {r['shared_steps']} of {r['steps']} steps; "
              f"{r['guided_valid']}/{r['guided']} guided outputs validate; stalls_guided {r['stalls_guided']}; "
              f"load {r['load_1m']:.1f}")
        print(f"{'':>10}  per step with guided rows: step {r['step_ms']:.1f} ms, forward {r['forward_ms']:.1f} ms, "
              f"masks computed {r['mask_compute_ms']:.2f} ms (worker), waited for {r['mask_wait_ms']:.3f} ms, "
              f"applied {r['mask_apply_ms']:.3f} ms, matchers advanced {r['advance_ms']:.3f} ms")
    # each round's outer pair (its first A over its first B) and inner pair (its second A over its second B)
    ratios = []
    for k in range(0, len(runs), 4):
        a1, b1, b2, a2 = (r["tokens_per_s"] for _, r in runs[k:k + 4])
        ratios += [a1 / b1, a2 / b2]
    print("served / runs-alone, outer and inner pair of each round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    print(f"  median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}x-{max(ratios):.2f}x over {len(ratios)} pairs")
    print(f"16 guided seats decoding, median step: masks during the forward {masks['overlapped']:.2f} ms, "
          f"after it {masks['after_forward']:.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"legs": [{"leg": leg, **r} for leg, r in runs], "ratios": ratios,
                                    "mask_overlap_ms": masks, "gap_s": args.gap, "max_tokens": args.max_tokens},
                                   indent=1))


if __name__ == "__main__":
    main()
