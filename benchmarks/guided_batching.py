"""Guided requests in a running batch: served with the plain ones, against running each alone.

8 guided (JSON schema) and 8 plain requests arrive staggered (one every ``--gap`` seconds, guided and
plain alternating) at a 16-seat in-flight engine on the default model. Run twice in one process on
the same runtime:

- ``served``: this build's declaration: guided requests join the running batch and plain ones join theirs;
- ``runs-alone``: the spec's V0 policy (the runtime declared ``runs-alone`` for guided decoding): a guided
  request waits for the batch to drain, then runs with nobody joining.

Reported per run: aggregate tokens/s (generated tokens / wall time from the first arrival to the last
finish), steps in which guided and plain rows shared the forward, and that every guided output
validates against its schema. Then, at 16 guided seats decoding together, the step time with the
masks computed while the forward runs (a worker thread) and after it (on the engine thread).

    python benchmarks/guided_batching.py [--gap 0.05] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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
    execute = runtime.execute

    def counting(step):
        ids = [s.request_id for s in step.seqs]
        shared[0] += any(i.startswith("guided") for i in ids) and any(i.startswith("plain") for i in ids)
        shared[1] += 1
        return execute(step)

    runtime.execute = counting
    try:
        start = time.perf_counter()
        handles = []
        for spec in specs:
            handles.append(engine.submit(spec, wait=True))
            time.sleep(gap)
        results = [h.result() for h in handles]
        wall = time.perf_counter() - start
    finally:
        del runtime.execute
    tokens = sum(r.num_output_tokens for r in results)
    guided = [r for s, r in zip(specs, results) if s.request_id.startswith("guided")]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "shared_steps": shared[0],
            "steps": shared[1], "guided_valid": sum(validates(r.text) for r in guided), "guided": len(guided),
            "stalls_guided": engine.counters.stalls["stalls_guided"]}


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
    args = parser.parse_args()
    specs = workload(args.max_tokens)
    with LLM(enable_in_flight_batching=True, max_batch_size=16, max_num_batched_tokens=512) as llm:
        runtime = llm.deployment.runtime
        runtime.guided.compile(FORMAT)  # the vocabulary pass happens once, before timing
        run(llm.engine, specs[:2], 0.0)  # warm-up
        served = run(llm.engine, specs, args.gap)
        declared = runtime.caps
        llm.engine.shutdown()
        runtime.caps = attrs.evolve(declared, options={**declared.options, "guided_decoding": OptionSupport(
            Support.RUNS_ALONE, reason="the spec's V0 policy", stall_counter="stalls_guided")})
        alone_engine = RequestEngine(runtime, llm.deployment.config, llm.engine.options)
        try:
            alone = run(alone_engine, specs, args.gap)
        finally:
            alone_engine.shutdown()
            runtime.caps = declared
        llm.deployment.engine = RequestEngine(runtime, llm.deployment.config, llm.engine.options)
        masks = mask_overlap(llm, args.mask_steps)
    for name, r in (("served", served), ("runs-alone", alone)):
        print(f"{name:>10}: {r['tokens_per_s']:6.1f} tokens/s ({r['tokens']} tokens in {r['wall_s']:.1f} s); "
              f"guided and plain shared {r['shared_steps']} of {r['steps']} steps; "
              f"{r['guided_valid']}/{r['guided']} guided outputs validate; stalls_guided {r['stalls_guided']}")
    print(f"served / runs-alone: {served['tokens_per_s'] / alone['tokens_per_s']:.2f}x")
    print(f"16 guided seats decoding, median step: masks during the forward {masks['overlapped']:.2f} ms, "
          f"after it {masks['after_forward']:.2f} ms")


if __name__ == "__main__":
    main()
