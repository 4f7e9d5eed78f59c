"""The text plugin's build: the quantization mode and KV cache dtype it picks, and a served GGUF
quantized by default that batches like each request alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ifb import LLM, SamplingParams
from ifb.capabilities import DeployConfig
from ifb.params import RequestSpec
from ifb_plugins.common.quant import kernels as qkernels, linear as quant
from ifb_plugins.common.loading.checkpoint import load_checkpoint
from ifb_plugins.common.models.native_decoder import NativeDecoder
from ifb_plugins.common.models.parts import TorchLayerStack
from tests.models.text import save_tiny_checkpoint, save_tiny_gguf
from ifb_plugins.text.build import PreparedModel, build_text_model, kv_cache_dtype, quantization_mode
from tests.helpers import submit_staggered
from tests.plugins.common.test_quant import PROMPTS, needs_kernels


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quant")
    return save_tiny_gguf(save_tiny_checkpoint(root / "hf", "llama", seed=7), root / "tiny.gguf")


@needs_kernels
def test_served_gguf_is_quantized_by_default_and_batches_like_solo(tiny_gguf: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(tiny_gguf), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    try:
        runtime = llm.deployment.runtime
        down = runtime.model.model.layers[0].mlp.down_proj
        assert isinstance(down, quant.BlockLinear) and down.activations == "int16"
        assert runtime.step_torch_threads == 1
        assert runtime.model.model.layers[0].self_attn.attention_impl.__func__ is qkernels.Kernels.paged_attention
        assert isinstance(runtime.model.layer_stack, NativeDecoder)
        assert runtime.kv_caches[0][0].dtype == torch.float16
        assert runtime.greedy_argmax is not None and runtime.greedy_argmax.__func__ is qkernels.Kernels.argmax
        alone = [list(llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=params)).result().token_ids)
                 for p in PROMPTS]
        # staggered arrivals and a 16-token budget: chunked prefills share steps with decodes
        batched = submit_staggered(llm.engine, [RequestSpec(prompt_token_ids=tuple(p), params=params)
                                                for p in PROMPTS], gap_steps=1)
        assert [list(r.token_ids) for r in batched] == alone
    finally:
        llm.close()
    exact = LLM(str(tiny_gguf), quantization="weights-only")
    try:
        down = exact.deployment.runtime.model.model.layers[0].mlp.down_proj
        assert isinstance(down, quant.BlockLinear) and down.activations == "float32"
        assert exact.deployment.runtime.kv_caches[0][0].dtype == torch.float32
    finally:
        exact.close()
    fp32 = LLM(str(tiny_gguf), quantization="none")
    try:
        assert isinstance(fp32.deployment.runtime.model.model.layers[0].mlp.down_proj, nn.Linear)
        assert fp32.deployment.runtime.step_torch_threads is None
        assert fp32.deployment.runtime.kv_caches[0][0].dtype == torch.float32
    finally:
        fp32.close()


def test_quantization_option_and_what_stays_float32(tiny_gguf: Path, tmp_path: Path) -> None:
    assert quantization_mode(DeployConfig()) == "auto"
    assert quantization_mode(DeployConfig(options={"quantization": "none"})) == "none"
    assert quantization_mode(DeployConfig(options={"quantization": "weights-only"})) == "weights-only"
    with pytest.raises(ValueError, match="quantization must be one of auto, int16, int8-prompt, int8, weights-only, none"):
        quantization_mode(DeployConfig(options={"quantization": "int3"}))
    loaded = load_checkpoint(tiny_gguf)
    model, prepared = build_text_model(loaded, "none", has_lora=False)
    assert "float32" in prepared.description
    # with adapters the GGUF's blocks still run (LoRA hooks the block matmuls), the layer loop from Python
    model, lora = build_text_model(loaded, "auto", has_lora=True)
    assert "LoRA" in lora.description and isinstance(model.layer_stack, TorchLayerStack)
    assert type(model.model.layers[0].self_attn.qkv_proj).__name__.endswith("BlockLinear")
    hf_dir = save_tiny_checkpoint(tmp_path / "hf", "llama", seed=2)
    hf = load_checkpoint(hf_dir)
    assert build_text_model(hf, "auto", has_lora=False)[1].description == "float32"


def test_kv_cache_dtype_option() -> None:
    native, torch_path = PreparedModel("blocks", is_native=True), PreparedModel("float32")
    auto = DeployConfig()
    # float16 only where the activations are rounded to integer codes anyway
    assert kv_cache_dtype(auto, "auto", native) == kv_cache_dtype(auto, "int8", native) == torch.float16
    assert kv_cache_dtype(auto, "weights-only", native) == torch.float32
    assert kv_cache_dtype(auto, "none", torch_path) == kv_cache_dtype(auto, "auto", torch_path) == torch.float32
    assert kv_cache_dtype(DeployConfig(options={"kv_cache_dtype": "float32"}), "auto", native) == torch.float32
    assert kv_cache_dtype(DeployConfig(options={"kv_cache_dtype": "float16"}), "none", torch_path) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16"):
        kv_cache_dtype(DeployConfig(options={"kv_cache_dtype": "int4"}), "auto", native)


@needs_kernels
@pytest.mark.parametrize("quantization", ["int8", "weights-only", "int8-prompt", "int16"])
def test_int8_and_weights_only_batch_like_solo_with_staggered_arrivals(tiny_gguf: Path, quantization: str) -> None:
    # the same engine-level check as the default mode's: chunked prefills of joiners share steps
    # with residents' decodes, and every request's greedy tokens are those it gets alone (int8-prompt:
    # a row's codes follow its position, whatever chunk or batch it comes in)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(tiny_gguf), quantization=quantization, enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16) as llm:
        model = llm.deployment.runtime.model
        down = model.model.layers[0].mlp.down_proj
        assert isinstance(down, quant.BlockLinear) and down.activations == {
            "int8": "int8", "weights-only": "float32", "int8-prompt": "int16", "int16": "int16"}[quantization]
        assert isinstance(model.layer_stack, NativeDecoder)
        assert model.layer_stack.prompt_passes == (1 if quantization == "int8-prompt" else None)
        alone = [list(llm.engine.submit(RequestSpec(prompt_token_ids=tuple(p), params=params)).result().token_ids)
                 for p in PROMPTS]
        batched = submit_staggered(llm.engine, [RequestSpec(prompt_token_ids=tuple(p), params=params)
                                                for p in PROMPTS], gap_steps=1, min_joined=2)
        assert [list(r.token_ids) for r in batched] == alone
