"""Every expert block type on the native kernels (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0/1, Q5_0/1, MXFP4), and a
tiny Qwen3-MoE converted by llama.cpp's ``convert_hf_to_gguf.py`` and rewritten in its ``Q4_K_M`` mix
(``ffn_down_exps`` in Q6_K) run with each tensor on its own kernel, in the layer loop and inside the
native whole-stack decoder (batched == alone with mid-flight joins)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.layers.moe import ExpertModules, SparseMoE
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.loading.gguf import GGUFTensor
from ifb_plugins.common.models.native_decoder import NativeDecoder
from ifb_plugins.common.quant import blocks as quant_blocks, int4_torch as quant_torch, linear as quant
from tests.helpers import submit_staggered
from tests.models.text import build_on_blocks, greedy_generate_batch
from tests.native import needs_kernels
from tests.plugins.common.test_kquants import integer_reference, random_blocks
from tests.plugins.common.test_loaders import prefill_logits
from tests.plugins.common.test_quant import KERNELS

Q = gguf.GGMLQuantizationType
#: the interleaved kind each expert type runs on (Q5_0 and MXFP4 rewritten as Q8_0 blocks)
EXPERT_KINDS = {Q.Q4_0: 0, Q.Q4_1: 1, Q.Q8_0: 2, Q.Q4_K: 3, Q.Q6_K: 4, Q.Q5_K: 5, Q.Q5_1: 5, Q.Q5_0: 2,
                Q.MXFP4: 2}
PROMPTS = [[5, 17, 33, 90, 4, 200, 11, 7, 61], [3, 4, 5], list(range(10, 40)), [250, 12]]


def random_mxfp4(n: int, k: int, seed: int = 0, exponents: tuple[int, int] = (110, 130)) -> np.ndarray:
    """Valid random MXFP4 rows ``[n, k / 32 * 17]``: random 4-bit indices, exponents in ``exponents``."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*exponents, size=(n, k // 32))
    return raw.reshape(n, -1)


def random_rows(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    return random_mxfp4(n, k, seed) if qtype == Q.MXFP4 else random_blocks(qtype, n, k, seed)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's 12 * 2^127 is inf
def test_mxfp4_decodes_as_gguf_dequantizes_and_rewrites_as_q8_0_exactly() -> None:
    every = random_mxfp4(6, 256, seed=1, exponents=(0, 256))  # every exponent: ggml's subnormal halves too
    codes = quant_blocks.decode(Q.MXFP4, torch.from_numpy(every))
    assert codes.codes.dtype == torch.int8 and codes.codes.abs().max() == 12
    assert np.array_equal(codes.dequantize().numpy(), gguf.quants.dequantize(every, Q.MXFP4))
    raw = random_mxfp4(7, 256, seed=2, exponents=(104, 144))  # what a float16 holds: 2^-24 .. 2^15
    raw.reshape(7, 8, 17)[0, 3, 1:] = 0  # a zero block: any exponent
    raw.reshape(7, 8, 17)[0, 3, 0] = 3
    weight = quant.BlockWeight(Q.MXFP4, torch.from_numpy(raw), 256)
    as_q8 = quant.mxfp4_as_q8_0(weight)
    assert as_q8.qtype == Q.Q8_0 and as_q8.shape == (7, 256)
    assert torch.equal(as_q8.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, Q.MXFP4)))
    outside = raw.copy()
    outside.reshape(7, 8, 17)[2, 5, 0] = 103
    with pytest.raises(ValueError, match="1 MXFP4 blocks have scales no float16 holds"):
        quant.mxfp4_as_q8_0(quant.BlockWeight(Q.MXFP4, torch.from_numpy(outside), 256))
    kept = quant.native_form(quant.BlockWeight(Q.MXFP4, torch.from_numpy(outside), 256), integer_activations=True)
    assert kept.qtype == Q.MXFP4  # left to the torch reference


@needs_kernels
@pytest.mark.parametrize("qtype", quant.EXPERT_TYPES)
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_every_expert_type_runs_on_its_kernel_with_the_reference_bits(qtype: Q, activations: str) -> None:
    # a stacked [E, N, K] expert tensor as the file holds it, one expert's rows after another
    e, n, k = 3, 40, 512
    stacked = np.stack([random_rows(qtype, n, k, seed=30 + i) for i in range(e)])
    tensor = GGUFTensor("blk.0.ffn_down_exps.weight", qtype, (e, n, k), stacked)
    experts = quant.read_expert_blocks(tensor)
    assert experts is not None and len(experts) == e
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(31))
    x[3] = 0.0
    for i, weight in enumerate(experts):
        linear = quant.BlockLinear(quant.native_form(weight, integer_activations=True), None, KERNELS,
                                   activations=activations)  # type: ignore[arg-type]
        assert linear.kind == EXPERT_KINDS[qtype]
        full = linear(x)
        # the torch reference over the rows as stored: the same bits, alone or batched
        reference = quant_torch.BlockTorchLinear(qtype, torch.from_numpy(stacked[i]), k, activations=activations)
        assert torch.equal(full, reference(x))
        assert all(torch.equal(linear(x[j:j + 1]), full[j:j + 1]) for j in range(21))
        # gguf's dequantization times the activation codes (exact in float64): one float32 rounding a step
        weights = torch.from_numpy(gguf.quants.dequantize(stacked[i], qtype)).double()
        scale = (x.double().abs() @ weights.abs().T).max().item()
        steps = k // quant_blocks.SUBBLOCK[qtype] * 2 + 2
        assert (full.double() - integer_reference(x, weights, activations)).abs().max() <= steps * 2**-24 * scale
        assert torch.equal(full[3], torch.zeros(n))


@needs_kernels
def test_q4_k_m_moe_runs_each_tensor_on_its_kernel_and_decodes_as_the_float32_model(kquant_moe) -> None:
    _, _, path = kquant_moe
    loaded = load_checkpoint(path)
    reference = build_model(loaded)  # float32 on the same dequantized blocks
    model, report = build_on_blocks(loaded, None, "native", activations="int16")
    assert report.num_kept == 0 and report.num_torch == 0
    for layer in model.model.layers:
        moe = layer.mlp
        assert isinstance(moe, SparseMoE) and isinstance(moe.experts, ExpertModules)
        assert {(m.qtype, m.kind) for m in moe.experts.gate_up} == {(Q.Q4_K, 3)}
        assert {(m.qtype, m.kind) for m in moe.experts.down} == {(Q.Q6_K, 4)}  # Q4_K_M's down in Q6_K
    # 15-bit activation codes: each logit within a few 1e-4 of the float32 model's (random weights, logits ~ 1-10)
    worst = max((prefill_logits(model, ids) - prefill_logits(reference, ids)).abs().max().item() for ids in PROMPTS)
    assert worst <= 2e-3
    assert greedy_generate_batch(model, PROMPTS, 24) == greedy_generate_batch(reference, PROMPTS, 24)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 40, 9, 23, 2, 31])]


@needs_kernels
def test_q4_k_m_moe_on_the_native_decoder_decodes_as_the_float32_model(kquant_moe) -> None:
    _, _, path = kquant_moe
    loaded = load_checkpoint(path)
    reference = build_model(loaded)
    model, _ = build_on_blocks(loaded, None, "native", activations="int16", layer_stack="auto")
    assert isinstance(model.layer_stack, NativeDecoder)  # routing and experts inside the whole-stack call
    loop, _ = build_on_blocks(loaded, None, "native", activations="int16", layer_stack="torch")
    for ids in PROMPTS:  # another summation order of the router and the picks than the layer loop's
        native = prefill_logits(model, ids)
        assert (native - prefill_logits(loop, ids)).abs().max().item() <= 2e-3
        assert (native - prefill_logits(reference, ids)).abs().max().item() <= 2e-3
    assert greedy_generate_batch(model, PROMPTS, 24) == greedy_generate_batch(reference, PROMPTS, 24)


@needs_kernels
def test_q4_k_m_moe_batched_on_the_native_decoder_equals_each_prompt_alone(kquant_moe) -> None:
    _, _, path = kquant_moe
    llm = LLM(str(path), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    try:
        assert isinstance(llm.deployment.runtime.model.layer_stack, NativeDecoder)
        specs = [RequestSpec(prompt_token_ids=tuple(ids), params=GREEDY) for ids in ENGINE_PROMPTS]
        alone = [list(llm.engine.submit(s, wait=True).result().token_ids) for s in specs]
        before = llm.health()["scheduling"]["admitted_mid_flight"]
        batched = submit_staggered(llm.engine, specs, gap_steps=1)
        assert [list(r.token_ids) for r in batched] == alone
        assert llm.health()["scheduling"]["admitted_mid_flight"] > before  # someone joined mid-flight
        assert len({t for r in alone for t in r}) > 8
    finally:
        llm.close()
