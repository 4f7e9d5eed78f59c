"""The Triton kernels a model on a CUDA device is built on (``quant.triton_blocks``,
``layers.triton_attention``, ``quant.triton_parts``) against the references they replace.

Triton binds a kernel to its interpreter only if ``TRITON_INTERPRET=1`` is set when the kernel
module is first imported, so the CPU comparisons run once, in a subprocess that executes this file
as a script (tiny shapes: the interpreter is slow); each case is asserted here. The same
comparisons run compiled on a CUDA device in the ``gpu`` suite (tests/gpu).

Bounds: a block matmul equals ``gguf.quants.dequantize(blocks) @ x`` (float64) to within
``2**-16`` of ``|x| @ |W|.T`` elementwise (float32 summation in another order; ``2**-7`` with
16-bit activations); attention equals the torch path to 1e-5 (float32, values of order 1; 3e-2
with 16-bit inputs, against the float32 path on the same rounded inputs). The 16-bit cases run in
float16 under the interpreter (its ``tl.dot`` mishandles bfloat16) and in both on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

Q = gguf.GGMLQuantizationType
QTYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
#: (rows of activations, output rows, input width, with a bias)
MATMUL_SHAPES = {"decode": (1, 40, 512, False), "prefill-bias": (20, 24, 256, True), "half": (3, 32, 256, False)}
ATTENTION_CASES = ("plain", "window", "sinks", "window-sinks", "gemma-window", "half-window-sinks")
MATMUL_BOUND = 2.0 ** -16
ATTENTION_BOUND = 1e-5
#: 16-bit activations ("half": float16 under the interpreter, whose ``tl.dot`` cannot take bfloat16;
#: both on a GPU): the weights rounded to that dtype (bfloat16: 2**-9) and the result too
MATMUL_HALF_BOUND = 2.0 ** -7
#: 16-bit queries, keys, values and probabilities (bfloat16: 2**-9 each), outputs of order 1
ATTENTION_HALF_BOUND = 3e-2


def random_blocks(qtype: Q, rows: int, width: int, seed: int) -> np.ndarray:
    """Rows of ``qtype`` blocks: random codes and scales, every float16 field a finite value."""
    qk, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, width // qk, size), dtype=np.uint8)
    offsets = {Q.Q6_K: (208,), Q.Q4_K: (0, 2)}.get(qtype, (0,))
    for offset in offsets:
        scales = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def compare_matmuls(device: str, half: torch.dtype = torch.float16) -> dict[str, float]:
    """Each case's largest error as a share of its bound (passes below 1)."""
    from ifb_plugins.common.quant.triton_blocks import block_matmul

    results = {}
    for qi, name in enumerate(QTYPES):
        qtype = Q[name]
        for si, (shape, (m, n, k, has_bias)) in enumerate(MATMUL_SHAPES.items()):
            raw = random_blocks(qtype, n, k, seed=10 * qi + si)
            weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float64))
            gen = torch.Generator().manual_seed(qi * 7 + si)
            x = torch.randn(m, k, generator=gen)
            dtype, bound = (half, MATMUL_HALF_BOUND) if shape == "half" else (torch.float32, MATMUL_BOUND)
            x = x.to(dtype)
            bias = torch.randn(n, generator=gen) if has_bias else None
            out = block_matmul(x.to(device), qtype, torch.from_numpy(raw).to(device), k,
                               None if bias is None else bias.to(device)).cpu().double()
            ref = x.double() @ weight.T + (0 if bias is None else bias.double())
            scale = x.double().abs() @ weight.abs().T + 1e-30
            results[f"{name}-{shape}"] = ((out - ref).abs() / scale).max().item() / bound
    return results


def compare_attention(device: str, half: torch.dtype = torch.float16) -> dict[str, float]:
    from ifb_plugins.common.layers.attention import build_attn_metadata, paged_attention as torch_attention
    from ifb_plugins.common.layers.triton_attention import paged_attention
    from ifb_plugins.common.models.gemma4 import windowed_attention
    from ifb_plugins.common.models.gpt_oss import sink_attention

    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, hkv, hq, d = 16, 12, 2, 4, 32
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    # a whole prompt, a chunk after a 17-token prefix (its blocks in the table), two decode tokens
    seqs = [(0, 20, [3, 5]), (17, 23, [1, 7, 9]), (30, 1, [2, 4]), (5, 1, [11])]
    attn = build_attn_metadata(seqs, block_size)
    q = torch.randn(attn.num_tokens, hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen)
    refs = {
        "plain": (torch_attention(q, k_cache, v_cache, attn), {}),
        "window": (sink_attention(q, k_cache, v_cache, attn, torch.full((hq,), -1e9), d ** -0.5, 8),
                   dict(window=8, scale=d ** -0.5)),
        "sinks": (sink_attention(q, k_cache, v_cache, attn, sinks, d ** -0.5, None), dict(sinks=sinks)),
        "window-sinks": (sink_attention(q, k_cache, v_cache, attn, sinks, d ** -0.5, 8),
                         dict(window=8, sinks=sinks, scale=d ** -0.5)),
        "gemma-window": (windowed_attention(q, k_cache, v_cache, attn, 5), dict(window=5, scale=1.0)),
    }
    q16, k16, v16 = (t.to(half) for t in (q, k_cache, v_cache))
    ref16 = sink_attention(q16.float(), k16.float(), v16.float(), attn, sinks, d ** -0.5, 8)
    dev_attn = build_attn_metadata(seqs, block_size, device)
    results = {}
    for name, (ref, kwargs) in refs.items():
        kwargs = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
        out = paged_attention(q.to(device), k_cache.to(device), v_cache.to(device), dev_attn, **kwargs).cpu()
        results[name] = (out - ref).abs().max().item() / ATTENTION_BOUND
    out = paged_attention(q16.to(device), k16.to(device), v16.to(device), dev_attn, window=8,
                          sinks=sinks.to(device), scale=d ** -0.5).cpu()
    assert out.dtype == half
    results["half-window-sinks"] = (out.float() - ref16).abs().max().item() / ATTENTION_HALF_BOUND
    return results


def compare_model_route(model_dir: str, gguf_path: str) -> dict[str, float]:
    """The models a CUDA deployment builds (``text.build.build_device_model``: ``DeviceParts``), here on
    the CPU under the interpreter, against the torch parts over one ragged step of two prompts and a
    decode token: a transformers checkpoint (Triton attention) and its llama.cpp Q8_0 file (Triton
    attention and block matmuls, against the same file dequantized to float32)."""
    from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
    from ifb_plugins.text.build import build_device_model

    cpu = torch.device("cpu")
    found = {}
    loaded = load_checkpoint(Path(model_dir))
    routed, _ = build_device_model(loaded, "auto", cpu, torch.float32)
    found["qwen2-step"] = _step_difference(build_model(loaded), routed) / 1e-4
    reference = build_model(load_checkpoint(Path(gguf_path), defer_quantized=False))
    routed, prepared = build_device_model(load_checkpoint(Path(gguf_path), defer_quantized=True), "auto", cpu,
                                          torch.float32)
    assert prepared.description.startswith("14 projections on GGUF blocks (Triton), 0 in float32"), prepared.description
    found["llama-q8_0-step"] = _step_difference(reference, routed) / 1e-4
    return found


def _step_difference(reference, routed) -> float:
    from ifb_plugins.common.layers.attention import build_attn_metadata

    out = {}
    for name, model in (("torch", reference), ("triton", routed)):
        caches = [(torch.zeros(8, 16, model.config.num_kv_heads, model.config.head_dim),) * 2
                  for _ in range(model.config.num_layers)]
        caches = [(torch.zeros_like(k), torch.zeros_like(k)) for k, _ in caches]
        attn = build_attn_metadata([(0, 9, [0]), (0, 20, [1, 2]), (0, 1, [3])], 16)
        ids = torch.tensor([(7 * i) % 300 + 3 for i in range(30)])
        positions = torch.tensor([*range(9), *range(20), 0])
        with torch.no_grad():
            out[name] = model.compute_logits(model(ids, positions, attn, caches))
    return (out["triton"] - out["torch"]).abs().max().item()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, float]:
    pytest.importorskip("triton")
    from tests.models import llama_cpp
    from tests.models.converted import save_tiny_dense

    root = tmp_path_factory.mktemp("route")
    model_dir = save_tiny_dense(root / "qwen2", "qwen2", seed=4)
    llama_dir = save_tiny_dense(root / "llama", "llama", seed=3)
    llama_cpp.convert([(llama_dir, root / "llama-q8_0.gguf", "q8_0")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(root / "llama-q8_0.gguf")],
                          capture_output=True, text=True, env=env,
                          timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [f"{q}-{s}" for q in QTYPES for s in MATMUL_SHAPES])
def test_block_matmul_equals_dequantize_times_activations(interpreted: dict[str, float], case: str) -> None:
    assert interpreted[case] < 1.0, f"{case}: {interpreted[case]:.3g} of the bound"


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_paged_attention_equals_the_torch_paths(interpreted: dict[str, float], case: str) -> None:
    assert interpreted[case] < 1.0, f"{case}: {interpreted[case]:.3g} of the bound"


@pytest.mark.parametrize("case", ["qwen2-step", "llama-q8_0-step"])
def test_a_model_built_for_cuda_routes_to_the_triton_kernels(interpreted: dict[str, float], case: str) -> None:
    # first-step logits of the model built on DeviceParts equal the torch-parts model's to 1e-4
    assert interpreted[case] < 1.0, f"{case}: {interpreted[case]:.3g} of the bound"


def test_corrupt_blocks_are_caught() -> None:
    # the bound is tight enough to see a wrong layout: Q4_0's nibble order swapped
    raw = random_blocks(Q.Q4_0, 4, 64, seed=1)
    swapped = raw.reshape(4, 2, 18).copy()
    swapped[..., 2:] = ((swapped[..., 2:] & 0x0F) << 4) | (swapped[..., 2:] >> 4)
    a = gguf.quants.dequantize(raw, Q.Q4_0)
    b = gguf.quants.dequantize(swapped.reshape(4, -1), Q.Q4_0)
    x = np.random.default_rng(0).standard_normal(64)
    assert (np.abs(a @ x - b @ x) / (np.abs(a) @ np.abs(x))).max() > 100 * MATMUL_BOUND


def test_unsupported_types_and_shapes_are_refused() -> None:
    from ifb_plugins.common.quant import triton_blocks

    if not triton_blocks.HAS_TRITON:
        pytest.skip("needs the triton package")
    with pytest.raises(ValueError, match="no Triton block matmul for Q5_K"):
        triton_blocks.block_matmul(torch.zeros(1, 256), Q.Q5_K, torch.zeros(1, 176, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="do not hold"):
        triton_blocks.block_matmul(torch.zeros(1, 64), Q.Q8_0, torch.zeros(1, 34, dtype=torch.uint8), 64)


if __name__ == "__main__":  # the interpreter run (see the module docstring)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    found = {**compare_matmuls("cpu"), **compare_attention("cpu"), **compare_model_route(*sys.argv[1:3])}
    print(json.dumps(found))
