"""GGUF block matmuls: the native kernels, the torch int4 fallback, the native decoder, and a quantized model.

Tiny GGUF checkpoints are written the way llama.cpp converts (Q/K rows permuted,
Q4_1 projections, Q8_0 embedding) and loaded through the real loader.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from ifb_plugins.common.quant import kernels as qkernels, linear as quant, int4_torch as quant_torch
from ifb_plugins.common.layers.attention import build_attn_metadata, paged_attention
from ifb_plugins.common.loading.gguf import GGUFTensor, read_gguf_tensors
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.models.decoder import allocate_kv_cache
from ifb_plugins.common.models.native_decoder import NativeDecoder
from ifb_plugins.common.models.parts import TorchLayerStack
from tests.models.text import build_on_blocks, greedy_generate, greedy_generate_batch, save_tiny_checkpoint, save_tiny_gguf
from tests.plugins.common.test_loaders import prefill_logits
from tests.native import kernels_or_none, needs_kernels

Q = gguf.GGMLQuantizationType
KERNELS = kernels_or_none()
needs_int4 = pytest.mark.skipif(not quant_torch.supported(), reason="torch has no int4 CPU kernel")


def _other_builds() -> list[tuple[str, qkernels.Kernels | None]]:
    """Where the CPU runs them: the AVX2 code, and the AVX-512 code without VNNI."""
    if KERNELS is None or KERNELS.isa != 512:
        return []
    builds = [("avx2", kernels_or_none("x86-64-v3"))]
    if "avx512_vnni" in qkernels.cpu_signature():  # the feature flags the native build keys on
        builds.append(("avx512", kernels_or_none("skylake-avx512")))
    return builds


KERNEL_BUILD_NAMES, _builds = zip(("native", KERNELS), *_other_builds())
KERNEL_BUILDS = list(_builds)
PROMPTS = [[5, 17, 33], list(range(40, 61)), [7] * 9, list(range(100, 137))]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quant")
    return save_tiny_gguf(save_tiny_checkpoint(root / "hf", "llama", seed=7), root / "tiny.gguf")


def gguf_tensor(qtype: Q, n: int, k: int, seed: int = 0) -> GGUFTensor:
    """A random [n, k] matrix quantized by gguf itself."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    return GGUFTensor(gguf_name="w", ggml_type=qtype, shape=(n, k), data=gguf.quants.quantize(w, qtype))


#: the integer activations' code range (``qkernels.ACTIVATIONS``)
LEVELS = {"int8": 127.0, "int16": 32512.0}


def integer_rows(x: torch.Tensor, activations: str) -> torch.Tensor:
    """``x`` as the integer-activation kernels see it: per 32-block, codes ``round(x * L / max|x|)``
    (ties to even) times the scale ``max|x| / L``, in float64. 15-bit codes are 256 * h + l with
    h = round(code / 256) and l clamped to -127..127 (the two int8 passes)."""
    levels = LEVELS[activations]
    blocks = x.reshape(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    # tensor / tensor: a true division (a scalar / tensor may run as a reciprocal and a product)
    inv = torch.where(top > 0, torch.full_like(top, levels) / top, torch.zeros_like(top))
    codes = (blocks * inv).round().clamp(-levels, levels)
    if activations == "int16":
        high = (codes / 256).round()
        codes = 256 * high + (codes - 256 * high).clamp(-127, 127)
    return (codes.double() * (top / levels).double()).reshape(x.shape)


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> quant.BlockWeight:
    block = quant.read_blocks(gguf_tensor(qtype, n, k, seed))
    assert block is not None
    return block


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_dequantize_like_gguf(qtype: Q) -> None:
    tensor = gguf_tensor(qtype, 48, 96)
    ref = torch.from_numpy(gguf.quants.dequantize(tensor.data, qtype))
    block = quant.read_blocks(tensor)
    assert block is not None and block.bits == (8 if qtype == Q.Q8_0 else 4) and block.shape == (48, 96)
    assert torch.equal(block.dequantize(), ref)
    assert quant.read_blocks(GGUFTensor("n", Q.F32, (4, 32), torch.zeros(4, 32).numpy())) is None
    if qtype != Q.Q8_0:  # torch's int4 convention holds the same weights
        assert torch.allclose(block.to_int4pack().dequantize(), ref, atol=1e-6)


@contextlib.contextmanager
def restored_threads(kernels: qkernels.Kernels):
    """Whatever the block sets, the pool goes back to its thread count after it."""
    threads = kernels.num_threads
    try:
        yield
    finally:
        kernels.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
@pytest.mark.parametrize("activations", ["int16", "int8", "float32"])
def test_native_matmul_matches_its_reference_on_every_row_whatever_the_batch(qtype: Q, build: int,
                                                                             activations: str) -> None:
    kernels = KERNEL_BUILDS[build]
    assert kernels is not None and kernels.isa in (256, 512)
    # 130 outputs: 8 groups of 16 columns and a padded ninth
    block = random_blocks(qtype, 130, 160, seed=1)
    linear = quant.BlockLinear(block, torch.randn(130), kernels, activations=activations)  # type: ignore[arg-type]
    x = torch.randn(45, 160, generator=torch.Generator().manual_seed(2))
    x[3] = 0.0  # an all-zero row: zero scales
    weights = block.dequantize().double()
    rows = x.double() if activations == "float32" else integer_rows(x, activations)
    ref = nn.functional.linear(rows, weights, linear.bias.double())
    full = linear(x)
    assert full.dtype == torch.float32 and torch.allclose(full.double(), ref, rtol=1e-5, atol=1e-4)
    exact = nn.functional.linear(x.double(), weights, linear.bias.double())
    error = (full.double() - exact).abs().max().item() / exact.abs().max().item()
    # 8-bit codes move a result by well under 1% of the output's scale; 15-bit ones 256 times less
    assert error < {"int8": 1e-2, "int16": 1e-4, "float32": 1e-6}[activations]
    with pytest.raises(ValueError, match="expected 160 input features"):
        linear(x[:, :96])
    with restored_threads(kernels):
        for n in (1, 2, 3):
            kernels.set_num_threads(n)
            # every row alone, and windows of rows (float32: few rows unpack the weights in each
            # tile, 32 and more once into a panel; integers: AMX tiles of 16 rows where the CPU
            # has them, and from 9 rows left over a tile padded with zero rows), give the bits
            # they gave in the full batch
            assert all(torch.equal(linear(x[i:i + 1]), full[i:i + 1]) for i in range(45))
            assert all(torch.equal(linear(x[i:i + w]), full[i:i + w])
                       for w in (2, 5, 9, 13, 17, 32, 37) for i in range(0, 45 - w, 3))


@needs_kernels
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
def test_15_bit_codes_at_the_seam_of_their_two_passes(build: int) -> None:
    # Codes 256 * h + 128 would need a low part of +-128, which int8 sign tricks cannot negate:
    # they move one step towards 256 * h, and no other code moves. A weight of ones in column j
    # (Q8_0: d = 1/127 rounded to float16, codes 127) reads the codes of column j back.
    kernels = KERNEL_BUILDS[build]
    codes = torch.tensor([32512, 128, -128, 384, -384, 32384, -32384, 127, 129, -129, 255, 256,
                          257, 1, 0, -1] + list(range(1000, 17000, 1000)), dtype=torch.float64)
    x = codes.float().reshape(1, 32)  # max|x| = 32512: the codes are x itself, at a scale of 1
    weight = torch.zeros(32, 32)
    weight.fill_diagonal_(1.0)
    tensor = GGUFTensor("w", Q.Q8_0, (32, 32), gguf.quants.quantize(weight.numpy(), Q.Q8_0))
    block = quant.read_blocks(tensor)
    assert block is not None
    y = quant.BlockLinear(block, None, kernels, activations="int16")(x).double()  # type: ignore[arg-type]
    one = block.dequantize().double()[0, 0]
    high = (codes / 256).round()
    expected = 256 * high + (codes - 256 * high).clamp(-127, 127)
    assert torch.allclose(y[0] / one, expected, rtol=0, atol=1e-2)
    assert torch.equal(expected != codes, (codes - 256 * high).abs() == 128)
    assert (expected != codes).sum() == 7 and (expected - codes).abs().max() == 1  # 16000 = 62.5 * 256 too


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_integer_matmul_gives_the_same_bits_on_every_instruction_set_it_runs(qtype: Q, activations: str) -> None:
    # integer block sums, then the same float32 operations in the same order: every build this CPU
    # runs (AVX2 everywhere; AVX-512 with and without VNNI, and AMX, where the CPU has them) gives
    # the bits of the torch reference, so a checkpoint's output does not depend on the CPU. The
    # builds a CPU cannot run are compiled by test_every_instruction_set_variant_compiles.
    raw = torch.from_numpy(gguf.quants.quantize(
        torch.randn(70, 96, generator=torch.Generator().manual_seed(8)).numpy(), qtype))
    reference = quant_torch.BlockTorchLinear(qtype, raw, 96, None, activations=activations)
    block = quant.BlockWeight(qtype, raw, 96)
    # on an AMX CPU, 37 rows are two tiles of 16 rows and 5 rows on the vector code; 45 rows are
    # three tiles, the last one of 13 rows padded with zero rows
    for num_rows in (37, 45):
        x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(9)) * 3
        want = reference(x)
        for name, kernels in zip(KERNEL_BUILD_NAMES, KERNEL_BUILDS):
            assert kernels is not None, f"the {name} build does not load"
            assert torch.equal(quant.BlockLinear(block, None, kernels, activations=activations)(x), want), name


@needs_kernels
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv-float32", "kv-float16"])
@pytest.mark.parametrize("dim", [32, 64])  # 64: the value sums kept in registers for a group of heads
def test_native_attention_matches_the_torch_path_and_ignores_chunking(build: int, kv_dtype: torch.dtype,
                                                                      dim: int) -> None:
    kernels = KERNEL_BUILDS[build]
    assert kernels is not None
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, block = 6, 2, 4
    k_cache, v_cache = (torch.randn(40, block, kv_heads, dim, generator=g).to(kv_dtype) for _ in range(2))
    # a decode, a later prefill chunk (its context spans several runs of scores), a whole prompt
    # and a first token, with scattered block tables
    long_table = [10, 11, 35, 12, 13, 14, 15, 16, 17, 18]
    seqs = [(13, 1, [5, 9, 2, 30]), (14, 25, long_table), (0, 12, [20, 21, 22]), (0, 1, [3])]
    attn = build_attn_metadata(seqs, block)
    q = torch.randn(attn.num_tokens, heads + kv_heads, dim, generator=g)[:, :heads]  # a strided view
    full = kernels.paged_attention(q, k_cache, v_cache, attn)
    assert torch.allclose(full, paged_attention(q, k_cache, v_cache, attn), atol=1e-5)
    # sequence 1's tokens (flat rows 1..25) split into other chunks, or decoded one by one: same bits
    for chunks in ([(14, 10), (24, 15)], [(14, 1), (15, 24)], [(p, 1) for p in range(14, 39)]):
        rows = [kernels.paged_attention(q[1 + s0 - 14:1 + s0 - 14 + n], k_cache, v_cache,
                                        build_attn_metadata([(s0, n, long_table)], block)) for s0, n in chunks]
        assert torch.equal(torch.cat(rows), full[1:26])


@needs_int4
def test_torch_int4_fallback_is_close_and_row_invariant() -> None:
    block = random_blocks(Q.Q4_1, 96, 128, seed=3)
    linear = quant_torch.Int4Linear(block.to_int4pack())
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(4))
    full = linear(x)
    ref = nn.functional.linear(x, block.dequantize())
    assert (full.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()  # bfloat16 arithmetic
    assert all(torch.equal(linear(x[i:i + 1]), full[i:i + 1]) for i in range(11))
    # the re-scored head: the best logits of each row are exact
    weight = torch.randn(320, 64, generator=torch.Generator().manual_seed(5))
    head = quant_torch.RescoredHead(weight)
    hidden = torch.randn(3, 64)
    exact = hidden @ weight.T
    got = head(hidden)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    top = exact.topk(3, dim=-1).indices
    assert torch.allclose(got.gather(1, top), exact.gather(1, top), atol=1e-5)


def quantized(path: Path, backend: quant.Backend,
              activations: qkernels.Activations) -> tuple[nn.Module, quant.QuantizationReport]:
    return build_on_blocks(load_checkpoint(path), read_gguf_tensors(path), backend, activations=activations)


@pytest.mark.parametrize(("backend", "activations"), [
    pytest.param("native", "float32", marks=needs_kernels, id="native-weights-only"),
    pytest.param("native", "int16", marks=needs_kernels, id="native-int16"),
    pytest.param("native", "int8", marks=needs_kernels, id="native-int8"),
    pytest.param("torch-int4", "float32", marks=needs_int4, id="torch-int4")])
def test_quantized_model_matches_float32_and_batches_like_solo(tiny_gguf: Path, backend: quant.Backend,
                                                               activations: qkernels.Activations) -> None:
    reference = build_model(load_checkpoint(tiny_gguf))
    model, report = quantized(tiny_gguf, backend, activations)
    assert report.backend == backend and report.num_quantized == 7 * 2 and report.num_kept == 0
    assert report.activations == (activations if backend == "native" else "bfloat16")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj is not None and mlp.gate_up_proj is not None and not hasattr(attn, "q_proj")
    assert model.head is not None
    ids = PROMPTS[3]
    got, ref = prefill_logits(model, ids), prefill_logits(reference, ids)
    error, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    if backend == "native" and activations == "float32":  # the same weights, summed in another order
        assert error < 1e-4
    elif activations == "int16":  # every matmul's input rounded to ~15 bits per block of 32
        assert error < 1e-3 * scale
    elif activations == "int8":  # ... to 8 bits
        assert error < 0.1 * scale
    else:  # bfloat16 activations; only each row's best logits are re-scored exactly
        top = ref.topk(5, dim=-1).indices
        assert (got.gather(1, top) - ref.gather(1, top)).abs().max().item() < 0.1
    batched = greedy_generate_batch(model, PROMPTS, 10, block_size=4)
    assert batched == [greedy_generate(model, p, 10, block_size=4) for p in PROMPTS]
    if backend == "native" and activations != "int8":
        assert batched == greedy_generate_batch(reference, PROMPTS, 10, block_size=4)


def blocks_of(model: nn.Module, qtype: Q = Q.Q4_1) -> dict[str, GGUFTensor]:
    """Every 2-D weight of ``model`` quantized by gguf, as the loader's raw tensors would hold them."""
    raw = {}
    for name, w in model.state_dict().items():
        if w.ndim == 2 and "embed_tokens" not in name:
            raw[name] = GGUFTensor(name, qtype, tuple(w.shape), gguf.quants.quantize(w.float().numpy(), qtype))
    return raw


@needs_kernels
# qwen2 brings q/k/v biases, qwen3 the per-head q/k norms; heads of 64 take the vector RoPE
@pytest.mark.parametrize(("arch", "head_dim"), [("llama", 16), ("qwen2", 16), ("qwen3", 16), ("llama", 64)])
@pytest.mark.parametrize("activations", ["float32", "int16", "int8"])
def test_native_decoder_runs_the_layers_as_the_modules_do(tmp_path: Path, arch: str, head_dim: int,
                                                          activations: qkernels.Activations) -> None:
    heads = 64 // head_dim * 2
    loaded = load_checkpoint(save_tiny_checkpoint(tmp_path, arch, seed=11, hidden_size=128, num_heads=heads,
                                                  num_kv_heads=heads // 2))
    raw = blocks_of(build_model(loaded))
    modules, _ = build_on_blocks(loaded, raw, "native", activations=activations)
    native, _ = build_on_blocks(loaded, raw, "native", activations=activations, layer_stack="auto")
    assert isinstance(native.layer_stack, NativeDecoder) and isinstance(modules.layer_stack, TorchLayerStack)
    ids = PROMPTS[3]
    got, ref = prefill_logits(native, ids), prefill_logits(modules, ids)
    # integer codes: the norms' last-bit differences can move an activation code by one step
    tolerance = {"float32": 1e-4, "int16": 1e-4 * ref.abs().max().item(), "int8": 0.02 * ref.abs().max().item()}
    assert (got - ref).abs().max().item() < tolerance[activations]
    batched = greedy_generate_batch(native, PROMPTS, 10, block_size=4)
    assert batched == [greedy_generate(native, p, 10, block_size=4) for p in PROMPTS]
    if activations != "int8":
        assert batched == greedy_generate_batch(modules, PROMPTS, 10, block_size=4)
    with restored_threads(KERNELS):  # the elementwise steps split over the pool's threads by rows: the same bits
        for n in (1, 3):
            KERNELS.set_num_threads(n)
            assert torch.equal(prefill_logits(native, ids), got)
            assert greedy_generate_batch(native, PROMPTS, 10, block_size=4) == batched


def _prefill_caches(model: nn.Module, ids: list[int], kv_dtype: torch.dtype,
                    block_size: int = 4) -> tuple[torch.Tensor, list]:
    blocks = [3, 0, 5, 1, 4, 2][:-(-len(ids) // block_size)]  # scattered
    caches = allocate_kv_cache(model.config, 6, block_size, kv_dtype)
    attn = build_attn_metadata([(0, len(ids), blocks)], block_size)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn, caches))
    return logits, caches


@needs_kernels
def test_native_decoder_on_a_float16_cache(tmp_path: Path) -> None:
    loaded = load_checkpoint(save_tiny_checkpoint(tmp_path, "llama", seed=11))
    raw = blocks_of(build_model(loaded))
    model, _ = build_on_blocks(loaded, raw, "native", activations="int16", layer_stack="auto")
    assert isinstance(model.layer_stack, NativeDecoder)
    ids = PROMPTS[3][:21]
    exact, caches32 = _prefill_caches(model, ids, torch.float32)
    got, caches16 = _prefill_caches(model, ids, torch.float16)
    # the first layer's K/V do not depend on attention: the float16 cache holds exactly torch's
    # rounding of the float32 values
    for half, full in zip(caches16[0], caches32[0]):
        assert half.dtype == torch.float16 and torch.equal(half, full.to(torch.float16))
    assert (got - exact).abs().max().item() < 1e-2 * exact.abs().max().item()
    batched = greedy_generate_batch(model, PROMPTS, 10, block_size=4, kv_dtype=torch.float16)
    assert batched == [greedy_generate(model, p, 10, block_size=4, kv_dtype=torch.float16) for p in PROMPTS]
    # the per-module path (torch's conversion on write, the native attention) reads the same values
    modules, _ = build_on_blocks(loaded, raw, "native", activations="int16")
    assert batched == greedy_generate_batch(modules, PROMPTS, 10, block_size=4, kv_dtype=torch.float16)


@needs_kernels
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
def test_native_argmax_picks_what_torch_picks(build: int) -> None:
    kernels = KERNEL_BUILDS[build]
    assert kernels is not None
    g = torch.Generator().manual_seed(3)
    # few distinct values: maxima tie within a vector lane, across lanes and in the scalar tail
    logits = torch.randint(0, 4, (40, 1000), generator=g).float()
    logits[1, 999] = 9.0  # the tail past the last whole vector
    logits[2] = -math.inf
    logits[3, 500] = math.nan
    logits[4, 7] = logits[4, 900] = math.nan  # the first NaN
    logits[5, 998] = math.nan  # a NaN in the tail
    wide = torch.randn(3, 49152, generator=g)  # the default model's vocabulary
    for x in (logits, wide, logits[:, :20], logits[:, :1], logits[:, 3:40]):  # narrow, strided
        want = x.max(dim=-1).indices.tolist()
        assert kernels.argmax(x) == want
        assert [kernels.argmax(x[i:i + 1])[0] for i in range(x.shape[0])] == want  # whatever the batch
    with pytest.raises(ValueError, match="empty vocabulary"):
        kernels.argmax(logits[:, :0])


def test_kernels_without_a_compiler_fall_back_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("IFB_KERNEL_CACHE", str(tmp_path / "kernels"))
    qkernels.forget_loaded()
    try:
        with caplog.at_level(logging.WARNING, logger="ifb.text"):
            assert qkernels.load() is None
            backend = quant.choose_backend()
        assert "no C compiler" in caplog.text
        assert backend == ("torch-int4" if quant_torch.supported() else None)
    finally:
        qkernels.forget_loaded()


def test_a_failed_build_fails_the_tests_that_need_it_with_the_compilers_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tests import native

    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo broken-cc 1; exit 0; }\n"
                      "echo 'qkernels.c:1:1: error: expected declaration' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("IFB_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.delenv(native.OPT_OUT, raising=False)
    qkernels.forget_loaded()
    try:
        with pytest.raises(qkernels.KernelsUnavailable, match="error: expected declaration"):
            qkernels.require()
        with pytest.raises(pytest.fail.Exception, match="do not build or load: .*error: expected declaration"):
            native.require_native_kernels()
        monkeypatch.setenv(native.OPT_OUT, "1")  # only the explicit opt-out turns it into a skip
        with pytest.raises(pytest.skip.Exception, match=native.OPT_OUT):
            native.require_native_kernels()
    finally:
        qkernels.forget_loaded()
