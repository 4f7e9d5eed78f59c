"""Time to first token on a hybrid Mamba model for prompts that share a long prefix, with and without reuse.

The model is a random-weight Nemotron-H built by transformers (``NemotronHForCausalLM``,
``save_pretrained``), larger than the test models (``--hidden``, ``--pattern``); its weights do
not change the timing. Each leg serves the same prompts, ``prefix`` shared tokens plus
``suffix`` tokens of their own, under in-flight batching:

- one warm-up request (with reuse it publishes the prefix's KV blocks and state checkpoints);
- ``--sequential`` requests one after another: TTFT of each (submit to first token);
- ``--burst`` requests submitted at once: their TTFTs (they share the batch and the token budget).

    python benchmarks/hybrid_prefix_ttft.py                  # ~2 minutes on 2 cores
    python benchmarks/hybrid_prefix_ttft.py --out ttft.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _ttft(handle, started: float) -> float:
    for out in handle:
        if out.token_ids:
            return time.perf_counter() - started
    raise RuntimeError("the request produced no token")


def run_leg(path: Path, reuse: bool, prompts: list[list[int]], burst: int, max_tokens: int,
            budget: int) -> dict:
    from ifb import LLM
    from ifb.params import RequestSpec, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec = lambda ids: RequestSpec(prompt_token_ids=tuple(ids), params=params)  # noqa: E731
    with LLM(model=str(path), plugin="mamba", enable_in_flight_batching=True, max_batch_size=max(4, burst),
             max_num_batched_tokens=budget, enable_context_reuse=reuse) as llm:
        started = time.perf_counter()
        warmup = _ttft(llm.engine.submit(spec(prompts[0])), started)
        sequential = []
        for ids in prompts[1:-burst]:
            started = time.perf_counter()
            sequential.append(_ttft(llm.engine.submit(spec(ids)), started))
        started = time.perf_counter()
        handles = [llm.engine.submit(spec(ids)) for ids in prompts[-burst:]]
        bursts = [_ttft(h, started) for h in handles]
        health = llm.health()
    return {"reuse": reuse, "warmup_ttft_s": warmup, "sequential_ttft_s": sequential, "burst_ttft_s": bursts,
            "prefix_cache": health.get("prefix_cache")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--pattern", default="M-M-M*-M-M-M*-")
    parser.add_argument("--prefix", type=int, default=1024, help="shared prompt tokens")
    parser.add_argument("--suffix", type=int, default=32, help="tokens of each prompt's own")
    parser.add_argument("--sequential", type=int, default=4)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--budget", type=int, default=256, help="per-step token budget")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test tree's tiny checkpoints
    from tests.models.hybrid import save_tiny_nemotron_h

    h = args.hidden
    path = save_tiny_nemotron_h(
        Path(tempfile.mkdtemp()) / "nemotron_h", seed=0, pattern=args.pattern, vocab_size=1024, hidden_size=h,
        intermediate_size=4 * h, num_attention_heads=h // 32, num_key_value_heads=2, head_dim=32,
        mamba_num_heads=h // 16, mamba_head_dim=32, ssm_state_size=64, n_groups=2, chunk_size=64,
        max_position_embeddings=4096)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(args.prefix)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(args.suffix)]
               for _ in range(1 + args.sequential + args.burst)]
    legs = [run_leg(path, reuse, prompts, args.burst, args.max_tokens, args.budget) for reuse in (False, True)]
    print(f"Nemotron-H hidden {h}, pattern {args.pattern}: {args.prefix} shared + {args.suffix} own tokens")
    print(f"{'':>10} {'warm-up':>9} {'sequential (median)':>20} {'burst (median, max)':>22}  hits")
    for leg in legs:
        seq, burst = leg["sequential_ttft_s"], leg["burst_ttft_s"]
        hits = (leg["prefix_cache"] or {}).get("hits", "-")
        print(f"{'reuse' if leg['reuse'] else 'no reuse':>10} {leg['warmup_ttft_s'] * 1e3:7.0f}ms "
              f"{statistics.median(seq) * 1e3:18.0f}ms {statistics.median(burst) * 1e3:12.0f}ms "
              f"{max(burst) * 1e3:6.0f}ms  {hits}")
    base, fast = (statistics.median(leg["sequential_ttft_s"]) for leg in legs)
    print(f"sequential TTFT: {base / fast:.1f}x faster with reuse")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "legs": legs}, indent=2))


if __name__ == "__main__":
    main()
