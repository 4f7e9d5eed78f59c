"""Block-diffusion throughput: 4 requests denoised together in flight against one at a time.

A random-weight DiffusionGemma built by transformers and saved with ``save_pretrained``
(hidden 256, 6 layers (5 sliding, 1 full), 8 heads, 8 experts top-2, vocabulary 4096,
canvas 16) is served through ``ifb.LLM`` twice: on the blocking path (one request at a
time) and under in-flight batching with 4 seats. Both answer the same requests (prompts of
about 24 tokens, 64 output tokens = 4 blocks, the checkpoint's sampler with 16 denoising
steps, seeds 0..N-1); the in-flight run's answers are checked equal to the blocking run's.
Throughput is output tokens over wall time; the best of ``--repeats`` runs is kept.

    python benchmarks/diffusion_batching.py            # about 2 minutes on 2 cores
    python benchmarks/diffusion_batching.py --out diffusion.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

TEXT_CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, global_head_dim=64, num_global_key_value_heads=2, sliding_window=64,
    num_experts=8, top_k_experts=2, moe_intermediate_size=128, max_position_embeddings=4096,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def write_model(directory: Path) -> None:
    import torch
    import transformers

    config = transformers.DiffusionGemmaConfig(
        text_config=TEXT_CONFIG, canvas_length=16,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    torch.manual_seed(0)
    transformers.DiffusionGemmaForBlockDiffusion(config).eval().save_pretrained(directory)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(TEXT_CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1").save_pretrained(
        directory)


def run(llm, prompts: list[str], max_tokens: int) -> tuple[float, list[tuple[int, ...]], int]:
    from ifb.params import RequestSpec, SamplingParams

    start = time.perf_counter()
    handles = [llm.engine.submit(RequestSpec(prompt=p, params=SamplingParams(
        max_tokens=max_tokens, seed=i, ignore_eos=True)), wait=True) for i, p in enumerate(prompts)]
    results = [h.result() for h in handles]
    wall = time.perf_counter() - start
    return wall, [r.token_ids for r in results], sum(len(r.token_ids) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from ifb import LLM

    prompts = [" ".join(f"w{(7 * i + 13 * j) % 4000 + 10}" for j in range(24)) for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp))
        settings = dict(plugin="diffusion", diffusion_steps=16)
        alone = LLM(tmp, **settings)
        batched = LLM(tmp, enable_in_flight_batching=True, max_batch_size=4, **settings)
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for name, llm in (("one at a time", alone), ("4 in flight", batched)):
                wall, answers, num_tokens = run(llm, prompts, args.max_tokens)
                best[name] = max(best.get(name, 0.0), num_tokens / wall)
                if name == "one at a time":
                    reference = answers
                else:
                    assert answers == reference, "in-flight answers differ from one-at-a-time ones"
        alone.deployment.shutdown()
        batched.deployment.shutdown()
    summary = {"requests": args.requests, "max_tokens": args.max_tokens, "denoising_steps": 16,
               "tokens_per_s": {k: round(v, 1) for k, v in best.items()},
               "speedup": round(best["4 in flight"] / best["one at a time"], 2)}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
