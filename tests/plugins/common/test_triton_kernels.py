"""The Triton kernels against the torch path they replace.

Triton binds a kernel to its interpreter only if ``TRITON_INTERPRET=1`` is set
when the kernel module is first imported, which another test may already have
done in this process; so the CPU comparisons run once, in a subprocess that
executes this file as a script, and each case is asserted here. The same
comparisons run in-process on CUDA when a GPU is present. References always
come from the torch path on CPU: on CUDA the model's hooks would route the
torch entry points to the kernels under test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Callable, NamedTuple

import pytest
import torch

from ifb_plugins.common.layers import triton_kernels
from ifb_plugins.common.layers.attention import _decode_attention, build_attn_metadata, paged_attention
from ifb_plugins.common.models.decoder import RMSNorm

# (atol, rtol) per dtype: one or two units in the last place of the output. The
# interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so an op that
# rounds twice, as RMSNorm does, may land two bf16 units away.
TOLERANCES = {torch.float32: (1e-4, 0.0), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class AttnCase(NamedTuple):
    dtype: str
    seq_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    #: prompt chunk lengths of extra prefill sequences sharing the step
    prefill_lens: tuple[int, ...] = ()
    #: call the raw kernel with int32 block tables and lengths
    int32_index: bool = False
    block_size: int = 16


class NormCase(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    weight_dtype: str | None = None  # None: the same as the input


ATTN_CASES = {
    # SmolLM2's attention shape: 9 query heads over 3 KV heads of dim 64.
    **{f"gqa3-d64-{name}": AttnCase(name, (1, 17, 33, 100), 9, 3, 64) for name in DTYPES},
    **{f"gqa1-d128-{name}": AttnCase(name, (33, 1, 100), 2, 2, 128) for name in DTYPES},
    "gqa3-d64-fp32-batch1": AttnCase("fp32", (100,), 9, 3, 64),
    "gqa3-d64-fp32-batch6": AttnCase("fp32", (17, 1, 100, 33, 16, 2), 9, 3, 64),
    "gqa1-d64-fp32-with-prefill": AttnCase("fp32", (33, 17), 3, 3, 64, prefill_lens=(5, 20)),
    "gqa3-d64-fp32-int32-index": AttnCase("fp32", (1, 17, 33, 100), 9, 3, 64, int32_index=True),
    # Beyond the powers of two: query heads split into two tiles, block size and head dim padded.
    "gqa12-d48-fp32-block12": AttnCase("fp32", (1, 13, 40), 12, 1, 48, block_size=12),
}
NORM_CASES = {
    **{f"{name}-5x576": NormCase(name, (5, 576)) for name in DTYPES},
    **{f"{name}-qk-norm-4x9x64": NormCase(name, (4, 9, 64)) for name in DTYPES},
    "fp32-1x64": NormCase("fp32", (1, 64)),
    "bf16-input-fp32-weight": NormCase("bf16", (3, 576), weight_dtype="fp32"),
}


class Comparison(NamedTuple):
    max_abs_err: float
    #: max of |out - ref| / (atol + rtol * |ref|): at most 1 passes
    worst_ratio: float
    same_shape_dtype: bool


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> Comparison:
    """Tolerances follow ``dtype`` (default: the reference's), the least precise input."""
    out = out.cpu()
    same = out.shape == ref.shape and out.dtype == ref.dtype
    atol, rtol = TOLERANCES[dtype or ref.dtype]
    err = (out.double() - ref.double()).abs()
    ratio = err / (atol + rtol * ref.double().abs())
    return Comparison(err.max().item(), ratio.max().item(), same)


Step = list[tuple[int, int, list[int]]]


def _random_step(case: AttnCase, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Step]:
    """A paged cache filled with noise (so unmasked padding would show), queries, and the step's sequences."""
    dtype = DTYPES[case.dtype]
    prefill = [(0, n) for n in case.prefill_lens]
    decode = [(n - 1, 1) for n in case.seq_lens]
    # Interleave so decode tokens are not simply the first rows of q.
    seqs = [s for pair in zip(decode, prefill) for s in pair] + decode[len(prefill) :] + prefill[len(decode) :]
    needed = [math.ceil((start + n) / case.block_size) for start, n in seqs]
    num_blocks = sum(needed) + 3
    # Shuffled block ids: a sequence's context is scattered through the cache.
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    step: Step = []
    for (start, n), k in zip(seqs, needed):
        step.append((start, n, ids[:k]))
        ids = ids[k:]
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(n for _, n in seqs), case.num_q_heads, case.head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, step


def _run_attn(case: AttnCase, device: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q, k_cache, v_cache, step = _random_step(case, g)
    attn = build_attn_metadata(step, case.block_size)
    ref = _decode_attention(q, k_cache, v_cache, attn)  # CPU: the torch path
    qd, kd, vd = q.to(device), k_cache.to(device), v_cache.to(device)
    if case.int32_index:
        out = triton_kernels.paged_decode_attention(
            qd.index_select(0, attn.decode_token_idx.to(device)),
            kd,
            vd,
            attn.block_tables.index_select(0, attn.decode_seq_idx).to(device, torch.int32),
            attn.seq_lens.index_select(0, attn.decode_seq_idx).to(device, torch.int32),
            case.head_dim**-0.5,
        )
    else:
        out = triton_kernels.decode_attention(qd, kd, vd, build_attn_metadata(step, case.block_size, device))
    return out, ref


def _run_empty_context(device: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # A zero-length context has nothing to attend to: zeros, not 0/0.
    q = torch.randn(2, 4, 64, generator=g).to(device)
    cache = torch.randn(3, 16, 2, 64, generator=g).to(device)
    tables = torch.tensor([[1], [2]], device=device)
    lens = torch.tensor([0, 5], device=device)
    out = triton_kernels.paged_decode_attention(q, cache, cache, tables, lens, 0.125)
    return out[0], torch.zeros(4, 64)


def _run_norm(case: NormCase, device: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    dtype = DTYPES[case.dtype]
    hidden = case.shape[-1]
    norm = RMSNorm(hidden, 1e-6).to(DTYPES[case.weight_dtype or case.dtype])
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
        # Rows of varied scale: the normalization must not depend on it.
        x = (torch.randn(case.shape, generator=g) * torch.rand(case.shape[:-1] + (1,), generator=g) * 8).to(dtype)
        ref = norm(x)
        out = triton_kernels.rms_norm(x.to(device), norm.weight.to(device), norm.eps)
    return out, ref, dtype


CASE_NAMES = [*ATTN_CASES, "empty-context", *NORM_CASES]


def _run_case(name: str, device: str) -> Comparison:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if name in ATTN_CASES:
        return _compare(*_run_attn(ATTN_CASES[name], device, g))
    if name == "empty-context":
        return _compare(*_run_empty_context(device, g))
    return _compare(*_run_norm(NORM_CASES[name], device, g))


def compare_all(device: str) -> dict[str, Comparison]:
    """Every case's kernel output against the CPU torch path."""
    return {name: _run_case(name, device) for name in CASE_NAMES}


def _check(name: str, result: Comparison) -> None:
    assert result.same_shape_dtype, f"{name}: output shape or dtype differs from the torch path"
    assert result.worst_ratio <= 1.0, f"{name}: max abs error {result.max_abs_err:.3g} is out of tolerance"


needs_triton = pytest.mark.skipif(not triton_kernels.HAS_TRITON, reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Comparison]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: Comparison(*values) for name, values in json.loads(proc.stdout.splitlines()[-1]).items()}


@needs_triton
@pytest.mark.parametrize("name", CASE_NAMES)
def test_interpreted_kernel_matches_torch_path(interpreted: dict[str, Comparison], name: str) -> None:
    _check(name, interpreted[name])


@needs_triton
@pytest.mark.parametrize(
    "call",
    [
        lambda: triton_kernels.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6),
        lambda: triton_kernels.paged_decode_attention(
            torch.randn(1, 5, 64), torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0.125,
        ),
        lambda: triton_kernels.paged_decode_attention(
            torch.randn(1, 4, 32), torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0.125,
        ),
        lambda: triton_kernels.paged_decode_attention(
            torch.randn(2, 4, 64), torch.randn(2, 16, 2, 64), torch.randn(2, 16, 2, 64),
            torch.zeros(1, 1, dtype=torch.long), torch.ones(2, dtype=torch.long), 0.125,
        ),
    ],
    ids=["weight-size", "uneven-gqa", "head-dim", "table-rows"],
)  # fmt: skip
def test_bad_shapes_are_refused_before_launch(call: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(ValueError):
        call()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@needs_triton
def test_compiled_kernels_match_torch_path_on_cuda() -> None:
    for name, result in compare_all("cuda").items():
        _check(name, result)


@pytest.mark.gpu
@gpu
@needs_triton
def test_model_ops_dispatch_to_kernels_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hooks: in inference on CUDA, RMSNorm and paged_attention take the kernels and agree with CPU.
    calls: list[str] = []
    for name in ("rms_norm", "decode_attention"):
        real = getattr(triton_kernels, name)
        monkeypatch.setattr(triton_kernels, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    g = torch.Generator().manual_seed(0)
    case = ATTN_CASES["gqa1-d64-fp32-with-prefill"]
    q, k_cache, v_cache, step = _random_step(case, g)
    norm = RMSNorm(576, 1e-6)
    x = torch.randn(7, 576, generator=g)
    with torch.inference_mode():
        ref = paged_attention(q, k_cache, v_cache, build_attn_metadata(step, case.block_size))
        ref_norm = norm(x)
        assert not calls, "the CPU path must not use the kernels"
        dev_attn = build_attn_metadata(step, case.block_size, "cuda")
        out = paged_attention(q.cuda(), k_cache.cuda(), v_cache.cuda(), dev_attn)
        out_norm = norm.cuda()(x.cuda())
    assert calls == ["decode_attention", "rms_norm"]
    _check("paged_attention", _compare(out, ref))
    _check("RMSNorm", _compare(out_norm, ref_norm))


if __name__ == "__main__":
    # Run by the `interpreted` fixture with TRITON_INTERPRET=1: one JSON line of results.
    print(json.dumps({name: list(r) for name, r in compare_all("cpu").items()}))
