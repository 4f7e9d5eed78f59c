"""One model definition: ``TextModel(config, parts)`` takes every module from its parts as it is built,
and the native whole-stack decoder is one ``LayerStack`` beside the layer loop, built from the same
config and GGUF, computing what the loop computes."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from ifb_plugins.common.layers.attention import paged_attention
from ifb_plugins.common.loading.checkpoint import build_model, load_checkpoint
from ifb_plugins.common.loading.gguf import read_gguf_tensors
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.decoder import DecoderLayer, TextModel
from ifb_plugins.common.models.native_decoder import NativeDecoder, fits_native_decoder
from ifb_plugins.common.models.parts import ModelParts, TorchLayerStack
from ifb_plugins.common.quant import int4_torch as quant_torch, kernels as qkernels, linear as quant
from ifb_plugins.common.quant.parts import BlockParts
from tests.models.moe import write_moe_gguf
from tests.models.text import (
    build_on_blocks, greedy_generate, greedy_generate_batch, save_tiny_checkpoint, save_tiny_gguf,
)
from tests.plugins.common.test_loaders import prefill_logits
from tests.native import kernels_or_none, needs_kernels

Q = gguf.GGMLQuantizationType
KERNELS = kernels_or_none()
PROMPTS = [[5, 17, 33], list(range(40, 61)), [7] * 9, [250, 12, 3, 8]]


@pytest.fixture(scope="module", params=["llama-tied", "llama-untied", "qwen3"])
def gguf_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":  # per-head q/k norms; written as llama.cpp's converter writes it
        return write_moe_gguf(save_tiny_checkpoint(root / "hf", "qwen3", seed=3), root / "qwen3.gguf", Q.Q8_0)
    hf = save_tiny_checkpoint(root / "hf", "llama", seed=3, tie_word_embeddings=request.param == "llama-tied")
    return save_tiny_gguf(hf, root / "tiny.gguf")


@needs_kernels
def test_the_parts_choose_every_module_as_the_model_is_built(gguf_path: Path) -> None:
    loaded = load_checkpoint(gguf_path, defer_quantized=True)
    parts = BlockParts.for_checkpoint(loaded, "native")
    with torch.device("meta"):  # nothing loaded yet: what runs is already decided
        model = TextModel(loaded.config, parts)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, quant.BlockLinear) and not hasattr(attn, "q_proj")
    assert isinstance(mlp.gate_up_proj, quant.BlockLinear) and isinstance(attn.o_proj, quant.BlockLinear)
    assert attn.attention_impl.__func__ is qkernels.Kernels.paged_attention
    assert isinstance(model.head, quant.BlockLinear) and not hasattr(model, "lm_head")
    tied = loaded.config.tie_word_embeddings
    assert isinstance(model.model.embed_tokens, quant.HeadEmbedding if tied else quant.BlockEmbedding)
    assert isinstance(model.layer_stack, NativeDecoder)
    # every quantized matrix went onto blocks as it was built: none of them is loaded (nor read in float32)
    assert loaded.deferred <= parts.consumed
    assert all(t.is_meta for name, t in model.state_dict().items() if name.endswith(("norm.weight",)))

    float32 = TextModel(loaded.config, ModelParts())  # the reference parts
    attn = float32.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.Linear) and attn.qkv_proj is None and attn.attention_impl is paged_attention
    assert float32.head is None and isinstance(float32.layer_stack, TorchLayerStack)


@needs_kernels
@pytest.mark.parametrize("activations", ["float32", "int16"])
def test_native_and_torch_layer_stacks_from_one_gguf_agree(gguf_path: Path, activations: str) -> None:
    loaded = load_checkpoint(gguf_path, defer_quantized=True)
    raw = read_gguf_tensors(gguf_path)
    (loop, loop_report), (native, native_report) = (
        build_on_blocks(loaded, raw, "native", activations=activations, layer_stack=s) for s in ("torch", "auto"))
    assert isinstance(loop.layer_stack, TorchLayerStack) and isinstance(native.layer_stack, NativeDecoder)
    assert loop_report == native_report and native_report.num_kept == 0
    # the same modules either way: the native stack runs the layers the loop runs
    assert [type(m) for m in loop.modules()] == [type(m) for m in native.modules()]
    for (name, a), (_, b) in zip(loop.state_dict().items(), native.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = PROMPTS[1]
    got, ref = prefill_logits(native, ids), prefill_logits(loop, ids)
    # the bound the native decoder's tests state: summation order (float32), or an activation code
    # moved by one step by the norms' last-bit differences (int16)
    bound = 1e-4 if activations == "float32" else 1e-4 * ref.abs().max().item()
    assert (got - ref).abs().max().item() < bound
    batched = greedy_generate_batch(native, PROMPTS, 8, block_size=4)
    assert batched == [greedy_generate(native, p, 8, block_size=4) for p in PROMPTS]  # bit for bit alone
    assert batched == greedy_generate_batch(loop, PROMPTS, 8, block_size=4)


def test_the_native_decoder_refuses_layers_it_does_not_compute() -> None:
    """A layer that computes something else (a subclass, a new block) is never run natively by mistake."""
    config = tiny_config()

    class Scaled(DecoderLayer):
        def forward(self, x, cos, sin, attn, kv_cache):  # type: ignore[no-untyped-def]
            return 2 * super().forward(x, cos, sin, attn, kv_cache)

    with torch.device("meta"):
        layers = nn.ModuleList([Scaled(config, 0)])
    assert not fits_native_decoder(layers, config)  # and float32 projections never fit either
    if KERNELS is not None:
        with pytest.raises(ValueError, match="every projection is a BlockLinear"):
            NativeDecoder(layers, config, KERNELS)


def tiny_config() -> TextModelConfig:
    return TextModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                           num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.skipif(not quant_torch.supported(), reason="torch has no int4 CPU kernel")
def test_the_int4_head_of_a_deferred_checkpoint_reads_the_files_table(tmp_path: Path) -> None:
    """The int4 fallback's head re-scores against the float32 table: read from the file even when the
    load deferred it, and shared with the tied embedding (no second copy)."""
    path = save_tiny_gguf(save_tiny_checkpoint(tmp_path / "hf", "llama", seed=5), tmp_path / "tiny.gguf")
    whole, deferred = load_checkpoint(path), load_checkpoint(path, defer_quantized=True)
    reference, _ = build_on_blocks(whole, backend="torch-int4")
    model, report = build_on_blocks(deferred, backend="torch-int4")
    assert isinstance(model.head, quant_torch.RescoredHead) and report.head.startswith("4-bit")
    assert model.head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(prefill_logits(model, PROMPTS[1]), prefill_logits(reference, PROMPTS[1]))


def test_build_model_stays_strict_with_block_parts(tmp_path: Path) -> None:
    path = save_tiny_gguf(save_tiny_checkpoint(tmp_path / "hf", "llama", seed=5), tmp_path / "tiny.gguf")
    loaded = load_checkpoint(path)
    stray = type(loaded)(loaded.config, {**loaded.state_dict, "model.extra.weight": torch.zeros(1)},
                         loaded.tokenizer, loaded.source, loaded.path)
    with pytest.raises(RuntimeError, match="model.extra.weight"):
        build_model(stray, parts=BlockParts.for_checkpoint(stray))
