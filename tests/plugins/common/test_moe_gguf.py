"""Mixture-of-experts GGUF files written as llama.cpp's converter writes them, from the tiny transformers
checkpoints of test_moe_hf: the float32 path against the HF copy, the native block path against
the float32 one, and batched == alone on the native path under the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import attrs
import gguf
import pytest
import torch

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.quant import kernels as qkernels, linear as quant
from ifb_plugins.common.loading.gguf import read_gguf_tensors
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.layers.moe import ExpertModules, SparseMoE
from ifb_plugins.common.models.native_decoder import NativeDecoder
from tests.models.text import build_on_blocks, greedy_generate_batch
from tests.models.moe import save_tiny_moe, write_moe_gguf
from tests.helpers import submit_staggered
from tests.native import needs_kernels
from tests.plugins.common.test_loaders import prefill_logits

Q = gguf.GGMLQuantizationType
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
PROMPTS = [[5, 17, 33, 90, 4, 200, 11, 7, 61], [3, 4, 5], list(range(10, 40)), [250, 12]]



@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Single-threaded torch: on a small shared machine OpenMP's spinning barriers make these tiny
    models' small ops several times slower with two threads than with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: save_tiny_moe(tmp_path_factory.mktemp(arch), arch, seed=5) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_gguf_gives_the_hf_copys_greedy_tokens(arch: str, hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_moe_gguf(hf_dirs[arch], tmp_path / f"{arch}.gguf")
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
            "blk.0.ffn_down_exps.weight"} <= names
    assert ("blk.0.ffn_gate_inp_shexp.weight" in names) == (arch == "qwen2_moe")
    hf, ours = load_checkpoint(hf_dirs[arch]), load_checkpoint(path)
    # the only difference: the norm epsilon, stored as a float32 in GGUF
    assert attrs.evolve(ours.config, rms_norm_eps=hf.config.rms_norm_eps) == hf.config
    assert sorted(ours.state_dict) == sorted(hf.state_dict)
    assert all(torch.equal(ours.state_dict[k], hf.state_dict[k]) for k in hf.state_dict)
    assert greedy_generate_batch(build_model(ours), PROMPTS, 32) == greedy_generate_batch(build_model(hf), PROMPTS, 32)


def quantized(arch: str, hf_dirs: dict[str, Path], directory: Path, qtype: Q) -> Path:
    return write_moe_gguf(hf_dirs[arch], directory / f"{arch}-{qtype.name}.gguf", qtype)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_experts_compute_the_float32_model(arch: str, qtype: Q, hf_dirs: dict[str, Path],
                                                  tmp_path: Path) -> None:
    path = quantized(arch, hf_dirs, tmp_path, qtype)
    loaded = load_checkpoint(path)
    reference = build_model(loaded)  # float32 on the dequantized blocks
    model, report = build_on_blocks(loaded, read_gguf_tensors(path), "native", activations="float32")
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.experts, ExpertModules)
    assert all(isinstance(m, quant.BlockLinear) for m in (*moe.experts.gate_up, *moe.experts.down))
    assert report.num_kept == 0
    worst = max((prefill_logits(model, ids) - prefill_logits(reference, ids)).abs().max().item() for ids in PROMPTS)
    assert worst <= 1e-4  # the same weights, summed in another order


@needs_kernels
def test_native_dispatch_computes_each_row_exactly_as_alone(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = quantized("qwen2_moe", hf_dirs, tmp_path, Q.Q4_0)
    model, _ = build_on_blocks(load_checkpoint(path), read_gguf_tensors(path), "native", activations="int16")
    moe = model.model.layers[1].mlp
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = moe(x)
        assert all(torch.equal(moe(x[i:i + 1])[0], batched[i]) for i in range(x.shape[0]))
        assert all(torch.equal(moe(x[i:i + 7]), batched[i:i + 7]) for i in range(0, 40, 7))


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 40, 9, 23, 2, 31])]


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_batched_greedy_equals_each_prompt_alone(arch: str, qtype: Q, hf_dirs: dict[str, Path],
                                                       tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = quantized(arch, hf_dirs, tmp_path, qtype)
    with caplog.at_level("INFO", logger="ifb.text"):
        llm = LLM(str(path), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    try:
        runtime = llm.deployment.runtime
        # routing and every expert's block matmuls inside the native whole-stack decoder, and said so
        assert isinstance(runtime.model.layer_stack, NativeDecoder)
        assert "layers run natively" in caplog.text and "the layer loop runs in Python" not in caplog.text
        assert isinstance(runtime.model.model.layers[0].mlp.experts, ExpertModules)
        specs = [RequestSpec(prompt_token_ids=tuple(ids), params=GREEDY) for ids in ENGINE_PROMPTS]
        alone = [list(llm.engine.submit(s, wait=True).result().token_ids) for s in specs]
        before = llm.health()["scheduling"]["admitted_mid_flight"]
        batched = submit_staggered(llm.engine, specs, gap_steps=1)
        assert [list(r.token_ids) for r in batched] == alone
        assert llm.health()["scheduling"]["admitted_mid_flight"] > before
        assert len({t for r in alone for t in r}) > 8  # not one token forever
    finally:
        llm.close()
