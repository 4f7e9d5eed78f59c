"""8-bit activation codes on prompt rows, 15-bit ones on generated rows: the block matmul that
takes each row's own codes, and the native decoder that gives them by position."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.models.decoder import allocate_kv_cache
from ifb_plugins.common.models.native_decoder import NativeDecoder
from ifb_plugins.common.quant import int4_torch as quant_torch, linear as quant
from tests.models.text import build_on_blocks, greedy_generate, greedy_generate_batch, save_tiny_checkpoint
from tests.native import needs_kernels
from tests.plugins.common.test_kquants import random_blocks
from tests.plugins.common.test_quant import KERNEL_BUILD_NAMES, KERNEL_BUILDS, PROMPTS, blocks_of

Q = gguf.GGMLQuantizationType
#: which rows of 37 take 8-bit codes: runs of every length the tiles take (1-4 rows and more)
ROW_PATTERN = [r % 11 < 6 or r in (13, 30) for r in range(37)]


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q5_0])
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
def test_rows_of_mixed_codes_give_each_row_the_bits_of_its_own_codes(qtype: Q, build: int) -> None:
    kernels = KERNEL_BUILDS[build]
    assert kernels is not None
    raw = torch.from_numpy(random_blocks(qtype, 50, 512, seed=31))
    weight = quant.BlockWeight(qtype, raw, 512)
    linear = quant.BlockLinear(quant.q5_0_as_q8_0(weight) if qtype == Q.Q5_0 else weight,
                               torch.randn(50, generator=torch.Generator().manual_seed(32)), kernels)
    x = torch.randn(37, 512, generator=torch.Generator().manual_seed(33))
    rows = ["int8" if eight else "int16" for eight in ROW_PATTERN]
    got = kernels.block_matmul(x, linear.blocks, linear.kind, 50, linear.bias, row_activations=rows)
    # the torch reference of each row's codes (the integer scheme in torch; its rows do not depend
    # on one another)
    reference = {a: quant_torch.BlockTorchLinear(qtype, raw, 512, linear.bias, activations=a)(x)
                 for a in ("int16", "int8")}
    expected = torch.stack([reference[a][r] for r, a in enumerate(rows)])
    assert torch.equal(got, expected)
    for a in ("int16", "int8"):  # and a call whose rows all take one kind of codes
        same = torch.tensor([r == a for r in rows])
        assert torch.equal(got[same], linear.kernels.block_matmul(x[same], linear.blocks, linear.kind, 50,
                                                                  linear.bias, activations=a))
    for m in (1, 2, 5, 9):  # fewer rows: the same bits for each
        assert torch.equal(kernels.block_matmul(x[:m], linear.blocks, linear.kind, 50, linear.bias,
                                                row_activations=rows[:m]), got[:m])


@needs_kernels
def test_row_codes_are_refused_where_they_do_not_apply() -> None:
    from tests.plugins.common.test_quant import KERNELS

    raw = torch.from_numpy(random_blocks(Q.Q4_0, 16, 64, seed=1))
    linear = quant.BlockLinear(quant.BlockWeight(Q.Q4_0, raw, 64), None, KERNELS)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="row_activations"):
        KERNELS.block_matmul(x, linear.blocks, linear.kind, 16, activations="float32", row_activations=["int8"] * 2)
    with pytest.raises(ValueError, match="row_activations"):
        KERNELS.block_matmul(x, linear.blocks, linear.kind, 16, row_activations=["int8"])


def _hidden(model, ids: list[int], num_prompt: int | None, chunks: tuple[int, ...]) -> torch.Tensor:
    """Every position's last hidden state (the head's input: the head, outside the decoder, keeps
    its own codes), ``ids`` computed in steps of ``chunks`` tokens (the prompt's length named to
    each step when ``num_prompt`` is given)."""
    block_size = 4
    blocks = [5, 0, 7, 2, 6, 1, 3, 4, 8, 9][:-(-len(ids) // block_size)]
    caches = allocate_kv_cache(model.config, 10, block_size, torch.float32)
    out, start = [], 0
    for n in chunks:
        attn = build_attn_metadata([(start, n, blocks)], block_size,
                                   num_prompt_tokens=None if num_prompt is None else [num_prompt])
        with torch.no_grad():
            out.append(model(torch.tensor(ids[start:start + n]), torch.arange(start, start + n), attn, caches))
        start += n
    return torch.cat(out)


@needs_kernels
def test_native_decoder_takes_8_bit_codes_on_prompt_rows_only(tmp_path: Path) -> None:
    loaded = load_checkpoint(save_tiny_checkpoint(tmp_path, "qwen2", seed=11, hidden_size=128))
    raw = blocks_of(build_model(loaded))
    mixed, _ = build_on_blocks(loaded, raw, "native", layer_stack="auto", prompt_activations="int8")
    eight, _ = build_on_blocks(loaded, raw, "native", activations="int8", layer_stack="auto")
    fifteen, _ = build_on_blocks(loaded, raw, "native", layer_stack="auto")
    assert isinstance(mixed.layer_stack, NativeDecoder) and mixed.layer_stack.prompt_passes == 1
    ids = PROMPTS[3][:30]
    # a prompt: its rows are the 8-bit model's, bit for bit
    prompt = _hidden(mixed, ids, len(ids), (len(ids),))
    assert torch.equal(prompt, _hidden(eight, ids, None, (len(ids),)))
    assert not torch.equal(prompt, _hidden(fifteen, ids, None, (len(ids),)))
    # without prompt lengths every row keeps its weights' 15-bit codes
    assert torch.equal(_hidden(mixed, ids, None, (len(ids),)), _hidden(fifteen, ids, None, (len(ids),)))
    # 21 prompt tokens and 9 generated ones: the codes follow the positions, however the steps cut
    # them (one step crossing from the prompt into the generated tokens, or chunks and single rows)
    whole = _hidden(mixed, ids, 21, (30,))
    for chunks in ((21, 9), (8, 13, 1, 1, 1, 1, 1, 1, 1, 1, 1), (20, 1, 9), (5, 25)):
        assert torch.equal(_hidden(mixed, ids, 21, chunks), whole), chunks
    assert torch.equal(whole[:21], prompt[:21])


@needs_kernels
def test_native_decoder_with_prompt_codes_batches_like_solo(tmp_path: Path) -> None:
    loaded = load_checkpoint(save_tiny_checkpoint(tmp_path, "llama", seed=11, hidden_size=128))
    raw = blocks_of(build_model(loaded))
    model, _ = build_on_blocks(loaded, raw, "native", layer_stack="auto", prompt_activations="int8")
    batched = greedy_generate_batch(model, PROMPTS, 10, block_size=4, with_prompt_lengths=True)
    assert batched == [greedy_generate(model, p, 10, block_size=4, with_prompt_lengths=True) for p in PROMPTS]
