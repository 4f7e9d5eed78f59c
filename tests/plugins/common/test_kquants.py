"""GGUF block types beyond Q4_0 / Q4_1 / Q8_0 (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept as stored.

Every type's decoding is checked against ``gguf.quants.dequantize`` bit for bit
on random valid blocks; the torch integer matmul against gguf's dequantized
weights times the activations (exact in float64 on the integer codes, and
within the activation codes' bound of the float32 product), and against the
native kernels bit for bit on the types they multiply. A tiny model written
in a Q4_K_M-style mix runs each tensor on its own type's path and decodes
greedily as the float32 model dequantized from the same file does.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ifb_plugins.common.quant import kernels as qkernels, linear as quant, blocks as quant_blocks, int4_torch as quant_torch
from ifb_plugins.common.loading.gguf import GGUFTensor, read_gguf_tensors
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from tests.models.text import (
    build_on_blocks, greedy_generate, greedy_generate_batch, save_tiny_checkpoint, save_tiny_gguf,
)
from tests.plugins.common.test_loaders import prefill_logits
from tests.native import kernels_or_none, needs_kernels

Q = gguf.GGMLQuantizationType
KERNELS = kernels_or_none()
NEW_TYPES = [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
#: byte offsets of each block's float16 fields (the rest of a block is codes and packed scales)
F16_OFFSETS = {Q.Q4_0: [0], Q.Q8_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
               Q.Q5_K: [0, 2], Q.Q6_K: [208]}
PROMPTS = [[5, 17, 33], list(range(40, 61)), [7] * 9]


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF rows ``[n, row bytes]``: random code and scale bytes, finite float16 scales."""
    rng = np.random.default_rng(seed)
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // weights, nbytes), dtype=np.uint8)
    for offset in F16_OFFSETS[qtype]:
        scale = (rng.standard_normal((n, k // weights)) * 0.01).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and minima per super-block ``[B, 8]`` as GGUF's 12 bytes ``[B, 12]``."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[:, None].view(np.uint8)


def quantize_k(weights: np.ndarray, qtype: Q) -> np.ndarray:
    """A plain round-to-nearest K-quant encoder (``gguf`` has none): valid blocks close to ``weights``."""
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return gguf.quants.quantize(weights, qtype)
    n = weights.shape[0]
    x = weights.astype(np.float32).reshape(-1, 256)
    if qtype == Q.Q6_K:
        sub = x.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
        step = d[:, None, None] * sc[..., None]
        q = np.clip(np.round(sub / np.where(step > 0, step, 1)) + 32, 0, 63).astype(np.uint8).reshape(-1, 2, 128)
        ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)
        high = (q >> 4).reshape(-1, 2, 4, 32)
        qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
        blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], -1)
        return blocks.reshape(n, -1)
    top = 15 if qtype == Q.Q4_K else 31
    sub = x.reshape(-1, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, shift = (high - low) / top, -low
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (shift.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(shift / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None, None] * sc[..., None]
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, top).astype(np.uint8)  # [B, 8 sub-blocks, 32]
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(-1, 128)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn)]
    if qtype == Q.Q5_K:  # bit j of byte i: the fifth bit of weight i of sub-block j
        parts.append(sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8))
    return np.concatenate([*parts, qs], -1).reshape(n, -1)


def integer_reference(x: torch.Tensor, weights: torch.Tensor, activations: str) -> torch.Tensor:
    """The integer scheme's exact value in float64: the activation codes times their scales,
    times the weights."""
    rows = quant_blocks.quantize_rows(x, activations)
    xs = rows.xs.double().repeat_interleave(32, dim=1)
    return (rows.codes * xs) @ weights.double().T


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_blocks_decode_as_gguf_dequantizes(qtype: Q) -> None:
    raw = random_blocks(qtype, 24, 512, seed=3)
    codes = quant_blocks.decode(qtype, torch.from_numpy(raw))
    assert codes.codes.dtype == torch.int8 and codes.group == quant_blocks.SUBBLOCK[qtype]
    assert np.array_equal(codes.dequantize().numpy(), gguf.quants.dequantize(raw, qtype))
    weights = torch.randn(24, 512, generator=torch.Generator().manual_seed(4)).numpy()
    written = quantize_k(weights, qtype)  # the test models' encoder: valid, close blocks
    assert written.shape == raw.shape
    restored = gguf.quants.dequantize(written, qtype)
    assert np.abs(restored - weights).max() < {Q.Q4_K: 0.3, Q.Q6_K: 0.1}.get(qtype, 0.2)
    native = quant.read_blocks(GGUFTensor("w", qtype, (24, 512), raw))  # by default the interleaved kinds only
    assert (native is None) == (qtype not in quant.KINDS)
    assert quant.read_blocks(GGUFTensor("w", qtype, (24, 512), raw), quant.STORED).bits == quant.BITS[qtype]


def test_fma32_rounds_once() -> None:
    # 1 + 2^-23 + 2^-24 - 2^-70: just below a float32 midpoint; float64 rounds it onto the
    # midpoint, and float32 would then round to even (1 + 2^-22): rounded once it stays 1 + 2^-23
    a, b, c = [torch.tensor([v], dtype=torch.float32) for v in (1 + 2**-23, 2**-24 * (1 - 2**-23), 1 + 2**-23)]
    assert quant_blocks.fma32(a, b, c).item() == 1 + 2**-23
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2**-22
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(3000, generator=gen), torch.randn(3000, generator=gen)
    c = torch.where(torch.arange(3000) % 2 == 0, -(a * b), torch.randn(3000, generator=gen))  # cancellations
    got = quant_blocks.fma32(a, b, c)
    for i in range(0, 3000, 7):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        near = np.float32(float(exact))  # within one step of the correctly rounded value
        candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
        best = min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))
        assert got[i].item() == float(best)


@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("activations", ["int16", "int8", "float32"])
def test_torch_matmul_against_gguf_dequantization_and_alone_like_batched(qtype: Q, activations: str) -> None:
    raw = torch.from_numpy(random_blocks(qtype, 40, 512, seed=6))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(7))
    linear = quant_torch.BlockTorchLinear(qtype, raw, 512, bias, activations=activations)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(8))
    x[4] = 0.0
    weights = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).double()
    full = linear(x)
    assert full.dtype == torch.float32 and full.shape == (9, 40)
    exact = x.double() @ weights.T + bias.double()
    scale = (x.double().abs() @ weights.abs().T).max().item()
    if activations == "float32":  # float32 weights and sums
        assert (full.double() - exact).abs().max().item() < 1e-5 * scale
    else:
        # every sub-block's integer sum is exact; one float32 rounding per step of the fixed order
        ref = integer_reference(x, weights, activations) + bias.double()
        steps = 512 // quant_blocks.SUBBLOCK[qtype] * 2 + 2
        assert (full.double() - ref).abs().max().item() <= steps * 2**-24 * (scale + bias.abs().max().item())
        # the activation codes' rounding: at most half a step, max|x| / (2 L) per block of 32
        top = x.reshape(9, -1, 32).abs().amax(-1).double().repeat_interleave(32, dim=1)
        bound = (top / (2 * quant_blocks.LEVELS[activations])) @ weights.abs().T
        assert ((full.double() - exact).abs() <= bound + steps * 2**-24 * scale).all()
    assert torch.equal(linear(x[4:5]), bias[None])
    assert all(torch.equal(linear(x[i:i + 1]), full[i:i + 1]) for i in range(9))
    assert torch.equal(linear(x[2:7]), full[2:7]) and torch.equal(linear(x.view(3, 3, 512)), full.view(3, 3, 40))
    with pytest.raises(ValueError, match="expected 512 input features"):
        linear(x[:, :256])


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_torch_integer_path_gives_the_native_kernels_bits(qtype: Q, activations: str) -> None:
    # the torch path is the native scheme's reference: on the types both multiply, the same bits
    raw = torch.from_numpy(random_blocks(qtype, 50, 256, seed=9))
    weight = quant.BlockWeight(qtype, raw, 256)
    bias = torch.randn(50)
    native = quant.BlockLinear(weight, bias, KERNELS, activations=activations)
    ref = quant_torch.BlockTorchLinear(qtype, raw, 256, bias, activations=activations)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(10))
    assert torch.equal(native(x), ref(x))


def test_q5_0_as_q8_0_keeps_every_weight() -> None:
    raw = random_blocks(Q.Q5_0, 7, 256, seed=15)
    converted = quant.q5_0_as_q8_0(quant.BlockWeight(Q.Q5_0, torch.from_numpy(raw), 256))
    assert converted.qtype == Q.Q8_0 and converted.shape == (7, 256)
    assert torch.equal(converted.dequantize(), quant.BlockWeight(Q.Q5_0, torch.from_numpy(raw), 256).dequantize())


@needs_kernels
def test_kquant_kinds_refuse_float32_activations() -> None:
    weight = quant.BlockWeight(Q.Q4_K, torch.from_numpy(random_blocks(Q.Q4_K, 16, 256)), 256)
    with pytest.raises(ValueError, match="int16 or int8"):
        quant.BlockLinear(weight, None, KERNELS, activations="float32")


#: a Q4_K_M-style mix over two layers (llama.cpp: Q4_K mostly, Q6_K for V / down / the head, Q8_0),
#: and the other types (Q5_0, Q5_1, Q5_K) in the second layer
MIX = {
    "token_embd.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q4_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q5_0, "blk.1.attn_k.weight": Q.Q5_0, "blk.1.attn_v.weight": Q.Q5_0,
    "blk.1.attn_output.weight": Q.Q5_1, "blk.1.ffn_gate.weight": Q.Q5_K, "blk.1.ffn_up.weight": Q.Q5_K,
    "blk.1.ffn_down.weight": Q.Q8_0,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kquants")
    hf = save_tiny_checkpoint(root / "hf", "llama", seed=11, hidden_size=256, intermediate_size=512,
                              num_layers=2, num_heads=4, num_kv_heads=2)
    return save_tiny_gguf(hf, root / "mixed.gguf", tensor_types=MIX, quantize=quantize_k)


@pytest.mark.parametrize("backend", [
    pytest.param("native", marks=needs_kernels),
    pytest.param("torch-int4", marks=pytest.mark.skipif(not quant_torch.supported(), reason="no int4 kernel"))])
def test_mixed_gguf_runs_each_tensor_on_its_type_and_decodes_as_float32(mixed_gguf: Path,
                                                                       backend: quant.Backend) -> None:
    raw = read_gguf_tensors(mixed_gguf)
    assert {raw[f"model.layers.0.self_attn.{p}.weight"].ggml_type for p in ("q_proj", "v_proj")} == {Q.Q4_K, Q.Q6_K}
    reference = build_model(load_checkpoint(mixed_gguf))
    model, report = build_on_blocks(load_checkpoint(mixed_gguf), raw, backend)
    first, second = model.model.layers
    # layer 0: Q, K (Q4_K) and V (Q6_K) each on its own type; layer 1: Q/K/V (Q5_0) fused
    assert first.self_attn.q_proj.qtype == first.self_attn.k_proj.qtype == Q.Q4_K
    assert first.self_attn.v_proj.qtype == Q.Q6_K and first.mlp.down_proj.qtype == Q.Q6_K
    assert first.mlp.gate_up_proj.qtype == Q.Q4_K and first.self_attn.o_proj.qtype == Q.Q4_K
    assert second.self_attn.o_proj.qtype == Q.Q5_1 and second.mlp.gate_up_proj.qtype == Q.Q5_K
    torch_modules = [m for m in model.modules() if isinstance(m, quant_torch.BlockTorchLinear)]
    stored = [m for m in model.modules() if isinstance(m, quant.StoredBlockLinear)]
    if backend == "native":  # every type on an interleaved kernel: Q5_0 as Q8_0 blocks; Q5_1, Q5_K as K5
        assert second.self_attn.qkv_proj.qtype == Q.Q8_0 and isinstance(second.mlp.down_proj, quant.BlockLinear)
        assert all(isinstance(m, quant.BlockLinear) for m in (first.self_attn.q_proj, first.self_attn.v_proj,
                                                               first.mlp.gate_up_proj, first.mlp.down_proj))
        assert report.num_quantized == 14 and report.num_kept == 0 and report.num_torch == 0
        assert isinstance(model.head, quant.BlockLinear) and model.head.qtype == Q.Q6_K
        assert second.self_attn.o_proj.kind == second.mlp.gate_up_proj.kind == 5
        assert not stored and not torch_modules and report.head == "on GGUF blocks (Q6_K)"
    else:  # torch's integer path; Q8_0 stays float32 there, as before
        assert second.self_attn.qkv_proj.qtype == Q.Q5_0
        assert report.num_quantized == 13 and report.num_kept == 1 and report.num_torch == 13
        assert len(torch_modules) == 9 and not stored
    assert all(m.activations == "int16" for m in torch_modules + stored)
    ids = PROMPTS[1]
    got, ref = prefill_logits(model, ids), prefill_logits(reference, ids)
    if backend == "torch-int4":  # its output head: 4-bit, only each row's best logits re-scored exactly
        top = ref.topk(5, dim=-1).indices
        got, ref = got.gather(1, top), ref.gather(1, top)
    # every matmul's input rounded to ~15 bits per block of 32
    assert (got - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
    batched = greedy_generate_batch(model, PROMPTS, 8, block_size=4)
    assert batched == [greedy_generate(model, p, 8, block_size=4) for p in PROMPTS]
    assert batched == greedy_generate_batch(reference, PROMPTS, 8, block_size=4)


#: llama.cpp's Q4_K_M over two layers, as for a model whose widths are whole super-blocks: Q4_K, with
#: Q6_K for V, down and the head; Q5_0 (llama.cpp's fallback) for the first layer's gate and up
Q4_K_M = {"token_embd.weight": Q.Q6_K, **{f"blk.{i}.{name}.weight": Q.Q4_K for i in (0, 1) for name in (
    "attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
          "blk.0.attn_v.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q4_K, "blk.0.ffn_down.weight": Q.Q6_K,
          "blk.1.ffn_down.weight": Q.Q4_K, "blk.0.ffn_gate.weight": Q.Q5_0, "blk.0.ffn_up.weight": Q.Q5_0}


@needs_kernels
def test_q4_k_m_runs_on_the_native_decoder_with_q_k_v_on_their_own_kinds(tmp_path: Path) -> None:
    from ifb_plugins.common.models.native_decoder import NativeDecoder
    from ifb_plugins.common.models.parts import TorchLayerStack

    hf = save_tiny_checkpoint(tmp_path / "hf", "llama", seed=11, hidden_size=256, intermediate_size=512,
                              num_layers=2, num_heads=4, num_kv_heads=2)
    path = save_tiny_gguf(hf, tmp_path / "q4_k_m.gguf", tensor_types=Q4_K_M, quantize=quantize_k)
    raw = read_gguf_tensors(path)
    (modules, report), (native, native_report) = (build_on_blocks(load_checkpoint(path), raw, "native", layer_stack=s)
                                                  for s in ("torch", "auto"))
    for model, report in ((modules, report), (native, native_report)):
        assert report.num_quantized == 14 and report.num_torch == 0
        assert not [m for m in model.modules() if isinstance(m, quant.StoredBlockLinear)]
    first, second = native.model.layers
    assert first.self_attn.v_proj.qtype == Q.Q6_K and first.self_attn.qkv_proj is None
    assert second.self_attn.qkv_proj.qtype == Q.Q4_K and first.mlp.gate_up_proj.qtype == Q.Q8_0
    assert isinstance(native.layer_stack, NativeDecoder) and isinstance(modules.layer_stack, TorchLayerStack)
    ids = PROMPTS[1]
    got, ref = prefill_logits(native, ids), prefill_logits(modules, ids)
    # the same matmuls; the norms' last-bit differences can move an activation code by one step
    assert (got - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    batched = greedy_generate_batch(native, PROMPTS, 8, block_size=4)
    assert batched == [greedy_generate(native, p, 8, block_size=4) for p in PROMPTS]
    assert batched == greedy_generate_batch(modules, PROMPTS, 8, block_size=4)


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_deferred_matrices_are_never_dequantized_and_the_model_is_the_same(tmp_path: Path, tied: bool) -> None:
    from ifb_plugins.common.loading.gguf import materialize

    hf = save_tiny_checkpoint(tmp_path / "hf", "llama", seed=11, hidden_size=256, intermediate_size=512,
                              num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
    mix = {**Q4_K_M, "blk.1.ffn_down.weight": Q.Q5_K, "output.weight": Q.Q8_0}  # and kind K5
    path = save_tiny_gguf(hf, tmp_path / "q4_k_m.gguf", tensor_types=mix, quantize=quantize_k)
    raw = read_gguf_tensors(path)
    whole = load_checkpoint(path)
    deferred = load_checkpoint(path, defer_quantized=True)
    # every quantized projection, the embedding and (untied) the head: 14 + 1 (+ 1)
    assert len(deferred.deferred) == (15 if tied else 16) and "model.embed_tokens.weight" in deferred.deferred
    assert not whole.deferred
    (reference, _), (model, report) = build_on_blocks(whole, raw, "native"), build_on_blocks(deferred, raw, "native")
    assert report.embedding_blocks == "Q6_K" and report.is_embedding_in_head == tied
    if tied:  # looked up in the head's blocks: no copy of the table
        assert isinstance(model.model.embed_tokens, quant.HeadEmbedding) and model.head.qtype == Q.Q6_K
        assert "embedding looked up in the output head's Q6_K blocks" in report.describe()
    else:
        assert isinstance(model.model.embed_tokens, quant.BlockEmbedding) and model.head.qtype == Q.Q8_0
        assert "embedding looked up in its Q6_K blocks" in report.describe()
    assert materialize(model, path, deferred.deferred) == 0  # all of them went onto blocks
    ids = torch.tensor(PROMPTS[1])
    assert torch.equal(model.model.embed_tokens(ids), whole.state_dict["model.embed_tokens.weight"][ids])
    assert torch.equal(prefill_logits(model, PROMPTS[1]), prefill_logits(reference, PROMPTS[1]))
    # a float32 deployment after all: materialize reads every deferred matrix, as the plain load does
    plain = build_model(load_checkpoint(path, defer_quantized=True))
    assert materialize(plain, path, deferred.deferred) == len(deferred.deferred)
    for name, value in build_model(whole).state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
