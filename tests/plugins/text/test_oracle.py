"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the
same file. Both get the same token ids: transformers' GGUF tokenizer conversion does not
split digits, so feeding both the same text would compare tokenizers, not models.

Both sides dequantize with ``gguf.quants.dequantize`` into float32, so the weights are
bit-identical and the first-step logits agree to float32 round-off (measured: 0.0).
"""

from __future__ import annotations

import inspect
from typing import Iterator

import pytest
import torch

from ifb_plugins.text.default_model import resolve_model
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model, load_checkpoint
from ifb_plugins.common.models.decoder import TextModel
from tests.models.text import greedy_generate_batch
from tests.plugins.common.test_loaders import prefill_logits

pytestmark = pytest.mark.e2e

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12345 + 678?",
    "List three primary colors.",
    "Explain in one sentence what a KV cache is.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Run this module single-threaded: on a small shared machine, OpenMP's spinning barriers
    make a 135M model's small matmuls several times slower with two threads than with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded() -> LoadedCheckpoint:
    return load_checkpoint(resolve_model(None))


@pytest.fixture(scope="module")
def ours(loaded: LoadedCheckpoint) -> TextModel:
    return build_model(loaded)


@pytest.fixture(scope="module")
def hf(loaded: LoadedCheckpoint) -> torch.nn.Module:
    import accelerate  # noqa: F401 - transformers 5 loads GGUF only with accelerate (in the test extra)
    from transformers import AutoModelForCausalLM

    path = loaded.path
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedCheckpoint) -> list[list[int]]:
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy with transformers' own KV cache; never stops early (no EOS handling), like ours."""
    from transformers import DynamicCache

    # transformers 5.x renamed ``past_key_values`` to ``cache``; the cache fills in place.
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    kv = {key: DynamicCache()}
    out: list[int] = []
    step = torch.tensor([ids])
    for _ in range(n):
        result = hf(input_ids=step, use_cache=True, **kv)
        out.append(int(result.logits[0, -1].argmax()))
        step = torch.tensor([[out[-1]]])
    return out


def test_config_is_the_known_default(loaded: LoadedCheckpoint) -> None:
    c = loaded.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and c.eos_token_ids == (2,)


def test_first_step_logits_match_transformers(
    ours: TextModel, hf: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    worst = 0.0
    for ids in prompt_ids:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (prefill_logits(ours, ids, block_size=16) - ref).abs().max().item())
    print(f"max abs logit diff vs transformers: {worst:.3g}")
    assert worst <= 1e-4


def test_greedy_tokens_match_transformers(
    ours: TextModel, hf: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    # Ours decodes all five prompts in one ragged paged batch; transformers one at a time.
    batched = greedy_generate_batch(ours, prompt_ids, NEW_TOKENS)
    for ids, got in zip(prompt_ids, batched):
        assert got == hf_greedy(hf, ids, NEW_TOKENS)
