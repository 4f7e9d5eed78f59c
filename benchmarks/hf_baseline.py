"""The Hugging Face transformers ``generate`` baseline on the same weights as ``ifb serve``.

Loads the default model's GGUF (de-quantized to float32 on the CPU, as ifb runs
it) and measures, greedy and in-process:

- batch 1: generate tokens/s (prefill included) and decode tokens/s
  (``(L - 1) / (t(L) - t(1))``: the prefill and first token cancel out);
- static batch 8: ``generate`` on 8 left-padded prompts, all answers L tokens long.

Every answer is forced to exactly L tokens (``min_new_tokens``), like
``ignore_eos`` for the servers.
"""

from __future__ import annotations

import time
from typing import Callable

PROMPTS = (
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain how rivers shape valleys over thousands of years, step by step.",
    "Describe a busy market in a mountain village at dawn.",
    "Tell me about a sailor who finds a silver compass.",
    "List the things a traveller should pack for a long winter journey and say why each matters.",
    "Write a letter from a farmer to a friend in the city.",
    "Summarise the life cycle of a butterfly for a child.",
    "Invent a legend about a dragon that guards an orchard.",
)


def measure(num_tokens: int = 64, batch_size: int = 8, repeats: int = 2,
            log: Callable[[str], None] = print) -> dict:
    """Load the model and time ``generate``; returns the numbers (and what was measured)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ifb_plugins.text.default_model import resolve_model

    path = resolve_model(None)
    log(f"hf baseline: loading {path.name} with transformers (de-quantizing to float32)")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - started
    tokenizer.padding_side = "left"  # decoder-only: pad on the left so every row ends at its prompt
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def timed(prompts: tuple[str, ...], new_tokens: int) -> float:
        inputs = tokenizer(list(prompts), return_tensors="pt", padding=True)
        with torch.inference_mode():
            started = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
            elapsed = time.perf_counter() - started
        generated = out.shape[1] - inputs["input_ids"].shape[1]
        if generated != new_tokens:
            raise RuntimeError(f"generate returned {generated} new tokens, asked for {new_tokens}")
        return elapsed

    timed(PROMPTS[:1], 4)  # warm-up: first calls pay for allocation and kernel selection
    single_full = min(timed(PROMPTS[:1], num_tokens) for _ in range(repeats))
    single_first = min(timed(PROMPTS[:1], 1) for _ in range(repeats))
    log(f"hf baseline: batch 1, {num_tokens} tokens in {single_full:.2f} s")
    batch_prompts = tuple(PROMPTS[i % len(PROMPTS)] for i in range(batch_size))
    batch_full = min(timed(batch_prompts, num_tokens) for _ in range(repeats))
    log(f"hf baseline: batch {batch_size}, {batch_size} x {num_tokens} tokens in {batch_full:.2f} s")
    decode_s = single_full - single_first
    return {
        "model": path.name,
        "load_s": load_s,
        "num_tokens": num_tokens,
        "batch_size": batch_size,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "batch1_generate_tokens_per_s": num_tokens / single_full,
        "batch1_decode_tokens_per_s": (num_tokens - 1) / decode_s if decode_s > 0 else None,
        "batch1_ttft_ms": single_first * 1000,
        "static_batch_generate_tokens_per_s": batch_size * num_tokens / batch_full,
        "static_batch_wall_s": batch_full,
    }
