"""The native paged attention with a sliding window and learned sinks, against the torch paths it
replaces (gpt-oss's ``sink_attention``, Gemma 4's ``windowed_attention``)."""

from __future__ import annotations

import pytest
import torch

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.gemma4 import windowed_attention
from ifb_plugins.common.models.gpt_oss import sink_attention
from tests.native import kernels_or_none, needs_kernels
from tests.plugins.common.test_quant import KERNEL_BUILD_NAMES, KERNEL_BUILDS

KERNELS = kernels_or_none()
BLOCK = 4
#: a decode past the window, a prefill chunk straddling it, a whole prompt longer than it, a first token
LONG_TABLE = [10, 11, 35, 12, 13, 14, 15, 16, 17, 18]
SEQS = [(13, 1, [5, 9, 2, 30]), (14, 25, LONG_TABLE), (0, 12, [20, 21, 22]), (0, 1, [3])]


def _inputs(dim: int, kv_dtype: torch.dtype, heads: int = 6, kv_heads: int = 2):
    g = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(40, BLOCK, kv_heads, dim, generator=g).to(kv_dtype) for _ in range(2))
    attn = build_attn_metadata(SEQS, BLOCK)
    q = torch.randn(attn.num_tokens, heads + kv_heads, dim, generator=g)[:, :heads]  # a strided view
    sinks = torch.randn(heads, generator=g) * 2
    return q, k_cache, v_cache, attn, sinks


@needs_kernels
@pytest.mark.parametrize("build", range(len(KERNEL_BUILDS)), ids=lambda i: KERNEL_BUILD_NAMES[i])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["kv-float32", "kv-float16"])
@pytest.mark.parametrize("dim", [32, 64])  # 64: the value sums kept in registers
@pytest.mark.parametrize("window", [None, 1, 5])  # 5: windows that start inside a block
def test_sinks_and_window_match_gpt_oss_torch_attention(build: int, kv_dtype: torch.dtype, dim: int,
                                                        window: int | None) -> None:
    kernels = KERNEL_BUILDS[build]
    q, k_cache, v_cache, attn, sinks = _inputs(dim, kv_dtype)
    got = kernels.paged_attention(q, k_cache, v_cache, attn, scale=dim ** -0.5, window=window, sinks=sinks)
    want = sink_attention(q, k_cache.float(), v_cache.float(), attn, sinks, dim ** -0.5, window)
    assert (got - want).abs().max().item() < 1e-5


@needs_kernels
@pytest.mark.parametrize("window", [None, 3, 7])
def test_window_with_scale_one_matches_gemma4_torch_attention(window: int | None) -> None:
    q, k_cache, v_cache, attn, _ = _inputs(64, torch.float32)
    q = q * 0.125  # Gemma 4's scale is 1 (its q norm keeps the logits small)
    got = KERNELS.paged_attention(q, k_cache, v_cache, attn, scale=1.0, window=window)
    want = windowed_attention(q, k_cache, v_cache, attn, window)
    assert (got - want).abs().max().item() < 1e-5


@needs_kernels
def test_blocks_before_the_window_are_never_read() -> None:
    """A sliding layer's blocks past its window may be freed and reused: poisoning them changes nothing."""
    q, k_cache, v_cache, attn, sinks = _inputs(64, torch.float32)
    window = 6
    clean = KERNELS.paged_attention(q, k_cache, v_cache, attn, window=window, sinks=sinks)
    # sequence 1 ends at position 38 (its chunk starts at 14): its first query sees 9..14, so blocks
    # 0 and 1 of its table (positions 0..7) are never needed; sequence 0's query at 13 sees 8..13
    for b, first_needed in ((0, 2), (1, 2)):
        for blk in attn.block_tables[b, :first_needed].tolist():
            k_cache[blk] = float("nan")
            v_cache[blk] = float("nan")
    poisoned = KERNELS.paged_attention(q, k_cache, v_cache, attn, window=window, sinks=sinks)
    assert torch.equal(poisoned[:26], clean[:26])  # the queries of sequences 0 and 1


@needs_kernels
def test_windowed_rows_do_not_depend_on_chunking() -> None:
    q, k_cache, v_cache, attn, sinks = _inputs(64, torch.float16)
    full = KERNELS.paged_attention(q, k_cache, v_cache, attn, window=5, sinks=sinks)
    for chunks in ([(14, 10), (24, 15)], [(p, 1) for p in range(14, 39)]):
        rows = [KERNELS.paged_attention(q[1 + s0 - 14:1 + s0 - 14 + n], k_cache, v_cache,
                                        build_attn_metadata([(s0, n, LONG_TABLE)], BLOCK), window=5, sinks=sinks)
                for s0, n in chunks]
        assert torch.equal(torch.cat(rows), full[1:26])


@needs_kernels
def test_bad_window_or_sinks_are_refused() -> None:
    q, k_cache, v_cache, attn, sinks = _inputs(32, torch.float32)
    with pytest.raises(ValueError, match="sees nothing"):
        KERNELS.paged_attention(q, k_cache, v_cache, attn, window=0)
    with pytest.raises(ValueError, match="query heads"):
        KERNELS.paged_attention(q, k_cache, v_cache, attn, sinks=sinks[:3])


@needs_kernels
@pytest.mark.parametrize("family", ["gpt_oss", "gemma4"])
def test_a_family_model_on_the_native_kernel_equals_its_torch_attention(family: str, tmp_path) -> None:
    """The whole model, native attention against the torch path on the same weights: a prompt longer
    than the sliding window, then decode steps of it and a second sequence batched together."""
    import attrs

    from ifb_plugins.text.families import build_family_model
    from tests.models.gemma4 import save_tiny_gemma4
    from tests.models.gpt_oss import save_tiny_gpt_oss

    save = save_tiny_gpt_oss if family == "gpt_oss" else save_tiny_gemma4
    native, _ = build_family_model(save(tmp_path / family, seed=3))
    assert native.config.attention_backend == "native"
    with torch.device("meta"):
        twin = type(native)(attrs.evolve(native.config, attention_backend="torch"))
    twin.load_state_dict(native.state_dict(), strict=True, assign=True)
    prompt = [(5 * i) % 280 + 7 for i in range(41)]  # past the window (16)
    steps = [[(0, 41, [0, 1, 2])], [(41, 1, [0, 1, 2]), (0, 9, [4])], [(42, 1, [0, 1, 2]), (9, 1, [4])]]
    tokens = [prompt, [11] + list(range(30, 39)), [13, 14]]
    outs = {}
    for name, model in (("native", native), ("torch", twin)):
        caches = model.allocate_kv_caches(6, 16, torch.float32, "cpu")
        outs[name] = []
        for step, ids in zip(steps, tokens):
            attn = build_attn_metadata(step, 16)
            positions = torch.cat([torch.arange(s, s + n) for s, n, _ in step])
            with torch.no_grad():
                outs[name].append(model.compute_logits(model(torch.tensor(ids), positions, attn, caches)))
    for got, want in zip(outs["native"], outs["torch"]):
        assert (got - want).abs().max().item() < 1e-4
