"""How closely the default model's quantized path follows its float32 path.

Both run the same GGUF: the float32 path dequantizes every matrix, the
quantized path multiplies the stored blocks (``plugins/common/quant/linear.py``; with the
native kernels, attention and the layer loop run natively too, as a deployment
runs them). Over a
fixed set of chat prompts, each greedy-decoded for N tokens on both paths:

- token agreement: per prompt, the fraction of the N tokens produced before the
  first divergence, averaged over prompts;
- identical prompts: the fraction of prompts whose N tokens all match;
- next-token agreement: over the float32 path's own prompts and answers, the
  fraction of positions whose greedy pick both paths share (one prefill each,
  so an early divergence does not decide the rest), and the mean KL divergence
  of the quantized path's next-token distribution from the float32 path's there
  (the answer's positions named generated tokens, as a deployment computes them);
- first-step logits: the largest absolute difference of the logits that pick
  the first token (and over every prompt position), with the logits' scale.

    python benchmarks/quant_quality.py                        # the native kernels (the default)
    python benchmarks/quant_quality.py --activations int8     # ... with 8-bit activations
    python benchmarks/quant_quality.py --prompt-activations int8   # 8-bit on prompt rows only
    python benchmarks/quant_quality.py --backend torch-int4   # torch's int4 fallback
    python benchmarks/quant_quality.py --kv-cache-dtype float32   # ... with a float32 KV cache
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12345 + 678?",
    "List three primary colors.",
    "Explain in one sentence what a KV cache is.",
    "Give me a recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How many legs does a spider have?",
    "Suggest a name for a friendly robot.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Describe a sunset over the mountains.",
)


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float, list[int]]:
    """(mean fraction of tokens before the first divergence, fraction fully identical, per-prompt prefix lengths)."""
    prefixes = []
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    total = [len(b) for b in ref]
    mean = sum(p / t for p, t in zip(prefixes, total)) / len(ref)
    identical = sum(p == t for p, t in zip(prefixes, total)) / len(ref)
    return mean, identical, prefixes


def measure(num_tokens: int = 64, backend: str | None = None, activations: Any = "int16",
            kv_cache: str = "auto", prompt_activations: Any = None) -> dict[str, Any]:
    import torch

    from ifb.capabilities import DeployConfig
    from ifb_plugins.text.build import PreparedModel, kv_cache_dtype, mode_for_activations
    from ifb_plugins.text.default_model import resolve_model
    from ifb_plugins.common.loading.gguf import read_gguf_tensors
    from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
    from ifb_plugins.common.quant.parts import BlockParts
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test tree's tiny checkpoints
    from tests.models.text import greedy_generate_batch

    path = resolve_model(None)
    loaded = load_checkpoint(path)
    reference = build_model(loaded)
    # as a deployment runs it: native matmuls, attention and (where the layers fit it) decoder
    parts = BlockParts(loaded.config, read_gguf_tensors(path), loaded.state_dict, backend,  # type: ignore[arg-type]
                       activations=activations, prompt_activations=prompt_activations)
    if parts.kernels is not None:
        parts.kernels.set_num_threads(torch.get_num_threads())
    quantized = build_model(loaded, parts=parts)
    report = parts.report
    # the quantized path's KV cache as a deployment of that mode would hold it
    kv_dtype = kv_cache_dtype(DeployConfig(options={"kv_cache_dtype": kv_cache}), mode_for_activations(activations),
                              PreparedModel(report.describe(), is_native=report.backend == "native"))
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]

    worst_first = worst_all = scale = 0.0
    for ids in prompts:
        with torch.inference_mode():
            a, b = _prefill_logits(quantized, ids, kv_dtype, len(ids)), _prefill_logits(reference, ids)
        worst_first = max(worst_first, (a[-1] - b[-1]).abs().max().item())
        worst_all = max(worst_all, (a - b).abs().max().item())
        scale = max(scale, b.abs().max().item())
    with torch.inference_mode():
        ours = greedy_generate_batch(quantized, prompts, num_tokens, kv_dtype=kv_dtype, with_prompt_lengths=True)
        ref = greedy_generate_batch(reference, prompts, num_tokens)
    mean, identical, prefixes = agreement(ours, ref)
    same = total = 0
    kl = 0.0
    for ids, answer in zip(prompts, ref):
        text = ids + answer[:-1]
        with torch.inference_mode():
            a, b = _prefill_logits(quantized, text, kv_dtype, len(ids)), _prefill_logits(reference, text)
        picks_a, picks_b = a[len(ids) - 1:].argmax(-1), b[len(ids) - 1:].argmax(-1)
        same += int((picks_a == picks_b).sum())
        total += len(picks_b)
        log_a, log_b = (t[len(ids) - 1:].double().log_softmax(-1) for t in (a, b))
        kl += float((log_b.exp() * (log_b - log_a)).sum())
    return {
        "weights": report.describe(),
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "prompts": len(prompts),
        "tokens_per_prompt": num_tokens,
        "token_agreement_before_first_divergence": mean,
        "prompts_fully_identical": identical,
        "prompt_activations": prompt_activations or activations,
        "next_token_agreement": same / total,
        "next_token_mean_kl": kl / total,
        "tokens_before_divergence": prefixes,
        "first_step_logit_max_abs_diff": worst_first,
        "all_positions_logit_max_abs_diff": worst_all,
        "logit_max_abs": scale,
    }


def _prefill_logits(model: Any, ids: list[int], kv_dtype: Any = None, num_prompt: int | None = None) -> Any:
    import torch

    from ifb_plugins.common.layers.attention import build_attn_metadata
    from ifb_plugins.common.models.decoder import allocate_kv_cache

    block_size = 16
    blocks = list(range(-(-len(ids) // block_size)))
    caches = allocate_kv_cache(model.config, len(blocks), block_size, kv_dtype or torch.float32)
    attn = build_attn_metadata([(0, len(ids), blocks)], block_size,
                               num_prompt_tokens=None if num_prompt is None else [num_prompt])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--backend", choices=("native", "torch-int4"), default=None,
                        help="quantized matmul to compare (default: what a deployment would pick)")
    from ifb_plugins.common.quant.kernels import ACTIVATIONS

    parser.add_argument("--activations", choices=tuple(ACTIVATIONS), default="int16",
                        help="the native kernels' activations (int8: quantization=int8, float32: weights-only)")
    parser.add_argument("--prompt-activations", choices=("int8",), default=None,
                        help="the native decoder's codes on prompt rows (quantization=int8-prompt)")
    from ifb_plugins.text.build import KV_CACHE_DTYPES

    parser.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                        help="the quantized path's KV cache (auto: as a deployment of that mode holds it)")
    args = parser.parse_args(argv)
    result = measure(args.tokens, args.backend, args.activations, args.kv_cache_dtype, args.prompt_activations)
    print(json.dumps(result, indent=1))
    r = result
    print(f"\n{r['weights']}; {r['kv_cache_dtype']} KV cache\n"
          f"token agreement before the first divergence: {r['token_agreement_before_first_divergence']:.1%}\n"
          f"prompts fully identical over {args.tokens} tokens: {r['prompts_fully_identical']:.1%}\n"
          f"next-token agreement on the float32 path's text: {r['next_token_agreement']:.1%} "
          f"(mean KL {r['next_token_mean_kl']:.3g})\n"
          f"first-step logits max abs diff: {r['first_step_logit_max_abs_diff']:.3g} "
          f"(all positions {r['all_positions_logit_max_abs_diff']:.3g}; logits up to {r['logit_max_abs']:.3g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
