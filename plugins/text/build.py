"""Build a TextRuntime from a deploy configuration."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Literal

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model, load_checkpoint
from ifb_plugins.common.runtime.lora import lora_enabled, lora_set
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.models.parts import ModelParts
from ifb_plugins.common.runtime.placement import device_of, weights_dtype
from ifb_plugins.common.runtime.text import TextRuntime

log = logging.getLogger("ifb.text")

#: the native kernels' activations in each mode that runs the GGUF's blocks
_ACTIVATIONS = {"auto": "int16", "int16": "int16", "int8-prompt": "int16", "int8": "int8", "weights-only": "float32"}
#: the modes whose native decoder quantizes prompt rows to other codes than generated ones
_PROMPT_ACTIVATIONS = {"int8-prompt": "int8"}
#: values of ``DeployConfig.options["quantization"]``: those, and ``none`` (float32 weights)
QUANTIZATION_MODES = (*_ACTIVATIONS, "none")
#: what runs the layers of a quantized model: the native decoder where they fit it (``auto``), or the
#: layer loop (``torch``; ``quant.parts.BlockParts``)
StackChoice = Literal["auto", "torch"]
#: values of ``DeployConfig.options["kv_cache_dtype"]``
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16}


def model_name_for(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def mode_for_activations(activations: str) -> str:
    """The quantization mode whose native kernels take ``activations``."""
    return next(mode for mode, a in _ACTIVATIONS.items() if a == activations)


def quantization_mode(config: DeployConfig) -> str:
    """How a GGUF's matrices run: ``auto`` (the default: its blocks times activations quantized
    to about 15 bits per block of 32), ``int8`` (times 8-bit activations, as llama.cpp: faster,
    coarser), ``weights-only`` (times float32 activations: the float32 model's results up to
    summation order) or ``none`` (dequantized to float32)."""
    mode = config.options.get("quantization") or "auto"
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {mode!r}")
    return mode


@attrs.frozen
class PreparedModel:
    """How ``build_text_model`` built the model."""

    description: str
    #: the matmuls run on the native kernels' threads (see ``TextRuntime.step_torch_threads``)
    is_native: bool = False
    #: the native kernels' greedy pick over a batch of logits (see ``sampling.sample``), or None
    argmax: Callable[[torch.Tensor], list[int]] | None = None


def model_parts(loaded: LoadedCheckpoint, mode: str, *, has_lora: bool,
                layer_stack: StackChoice = "auto") -> ModelParts:
    """The parts ``loaded`` is built from in ``mode``: its GGUF blocks where the mode runs them
    (``quant.parts.BlockParts``), else the float32 modules.

    LoRA adapters hook the projections (``runtime.lora``), so a deployment that
    serves adapters runs its layers from Python: block matmuls and attention on the
    native kernels, but the layer loop, not the native whole-stack decoder (which no
    hook sees).
    """
    if mode == "none" or loaded.source != "gguf":
        return ModelParts()
    from ifb_plugins.common.quant.parts import BlockParts

    return BlockParts.for_checkpoint(loaded, activations=_ACTIVATIONS[mode],
                                     prompt_activations=_PROMPT_ACTIVATIONS.get(mode),
                                     layer_stack="torch" if has_lora else layer_stack)


def describe_model(model: TextModel, parts: ModelParts, *, has_lora: bool) -> PreparedModel:
    """What ``parts`` made of ``model``, for the load log and the runtime's settings."""
    from ifb_plugins.common.models.native_decoder import NativeDecoder
    from ifb_plugins.common.quant.parts import BlockParts

    if not isinstance(parts, BlockParts):
        return PreparedModel("float32 (LoRA adapters registered)" if has_lora else "float32")
    report = parts.report
    if parts.kernels is None or not report.num_quantized:
        return PreparedModel(report.describe())
    native = dict(is_native=True, argmax=parts.kernels.argmax)
    if has_lora:
        return PreparedModel(report.describe() + "; layers driven from Python (LoRA adapters)", **native)
    if model.config.has_moe and not isinstance(model.layer_stack, NativeDecoder):
        # experts the native decoder does not run (a type kept in torch, a split shared expert):
        # each layer's forward runs from Python, its matmuls and attention on the native kernels
        log.info("mixture-of-experts layers: the layer loop runs in Python, not the native decoder; "
                 "matmuls and attention run on the native kernels")
        return PreparedModel(report.describe() + "; mixture-of-experts layers driven from Python", **native)
    if isinstance(model.layer_stack, NativeDecoder):
        prompt = "" if model.layer_stack.prompt_passes is None else ", 8-bit codes on prompt rows"
        return PreparedModel(report.describe() + "; layers run natively" + prompt, **native)
    return PreparedModel(report.describe(), **native)


def build_text_model(loaded: LoadedCheckpoint, mode: str, *, has_lora: bool, layer_stack: StackChoice = "auto",
                     device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32) -> tuple[TextModel, PreparedModel]:
    """The deployment's model: built from ``model_parts`` (on a CUDA device, ``DeviceParts``: the
    Triton kernels), then the deferred matrices it still holds (types without a block path, or a
    float32 deployment) read from the file."""
    if device.type == "cuda":
        return build_device_model(loaded, mode, device, dtype)
    if dtype != torch.float32 and loaded.source == "gguf" and mode != "none":
        raise ValueError(f"--dtype {str(dtype).removeprefix('torch.')}: a GGUF file's blocks run on the CPU's "
                         f"native kernels with float32 activations; on the CPU --dtype applies to Hugging Face "
                         f"checkpoints (or --quantization none)")
    parts = model_parts(loaded, mode, has_lora=has_lora, layer_stack=layer_stack)
    kernels = getattr(parts, "kernels", None)
    if kernels is not None:
        kernels.set_num_threads(torch.get_num_threads())
    model = build_model(loaded, dtype=dtype, parts=parts)
    _materialize(model, loaded, parts)
    prepared = describe_model(model, parts, has_lora=has_lora)
    if dtype != torch.float32:
        prepared = attrs.evolve(prepared, description=prepared.description.replace("float32", str(dtype)[6:]))
    return model, prepared


def build_device_model(loaded: LoadedCheckpoint, mode: str, device: torch.device,
                       dtype: torch.dtype) -> tuple[TextModel, PreparedModel]:
    """The model on a CUDA device: ``quant.triton_parts.DeviceParts`` (Triton attention, and a GGUF's
    blocks in Triton matmuls unless ``mode`` is ``none``), the other weights in ``dtype``."""
    from ifb_plugins.common.quant.triton_parts import DeviceParts

    parts = DeviceParts.for_checkpoint(loaded) if mode != "none" else DeviceParts()
    model = build_model(loaded, dtype=dtype, device=device, parts=parts)
    _materialize(model, loaded, parts)
    return model, PreparedModel(parts.describe(dtype))


def _materialize(model: TextModel, loaded: LoadedCheckpoint, parts: ModelParts) -> None:
    if loaded.deferred - parts.consumed:
        from ifb_plugins.common.loading.gguf import materialize

        materialize(model, loaded.path, loaded.deferred - parts.consumed)


def kv_cache_dtype(config: DeployConfig, mode: str, prepared: PreparedModel,
                   weights: torch.dtype = torch.float32) -> torch.dtype:
    """The KV cache's dtype: ``kv_cache_dtype`` if set, else (``auto``) float16 where the native
    kernels run the model with integer activations, whose attention reads float16 at half the
    bytes per context token, the weights' dtype when it is not float32 (``--dtype``), and float32
    everywhere else (the float32-exact modes included)."""
    choice = config.options.get("kv_cache_dtype") or "auto"
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {choice!r}")
    dtype = KV_CACHE_DTYPES[choice]
    if dtype is None and weights != torch.float32:  # a bfloat16 / float16 model keeps its KV in its dtype
        dtype = weights
    if dtype is None:
        dtype = torch.float16 if prepared.is_native and _ACTIVATIONS.get(mode) in ("int16", "int8") else torch.float32
    return dtype


def load_text_runtime(config: DeployConfig, caps: DeploymentCaps, *, layer_stack: StackChoice = "auto") -> TextRuntime:
    """The text deployment's runtime (``layer_stack``: see ``StackChoice``; benchmarks compare them)."""
    if config.num_ranks > 1:
        return load_text_shard(config, caps)
    path = Path(config.model)
    from ifb_plugins.text.families import family_of_dir, is_gpt_oss_gguf, load_family_runtime

    if (path.is_dir() and family_of_dir(path)) or is_gpt_oss_gguf(path):  # model modules of their own
        return load_family_runtime(config, caps)
    mode = quantization_mode(config)
    has_lora = lora_enabled(config)
    device, dtype = device_of(config), weights_dtype(config)
    if has_lora and dtype != torch.float32:
        raise ValueError(f"LoRA adapters are served with float32 weights: pass --dtype float32 "
                         f"(auto is {str(dtype).removeprefix('torch.')} on {device.type})")
    # the matrices that go onto blocks are never dequantized: a deferred one still needed afterwards
    # (a type with no block path, or a float32 deployment after all) is read in float32 then
    loaded = load_checkpoint(path, defer_quantized=mode != "none")
    model, prepared = build_text_model(loaded, mode, has_lora=has_lora, layer_stack=layer_stack, device=device,
                                       dtype=dtype)
    name = config.options.get("served_model_name") or model_name_for(path)
    lora = lora_set(model, config)
    kv_dtype = kv_cache_dtype(config, mode, prepared, dtype)
    log.info("loaded %s (%s, %d layers, hidden %d; %s; %s KV cache; on %s)", name, loaded.source,
             loaded.config.num_layers, loaded.config.hidden_size, prepared.description,
             str(kv_dtype).removeprefix("torch."), device)
    runtime = TextRuntime(model=model, tokenizer=loaded.tokenizer, caps=caps, config=config, model_name=name,
                          lora=lora, kv_dtype=kv_dtype)
    if prepared.is_native:
        runtime.step_torch_threads = 1
    runtime.greedy_argmax = prepared.argmax
    if caps.speculation is not None:
        from ifb_plugins.text.drafting import build_drafter

        runtime.drafter, speculation = build_drafter(config, caps.speculation, runtime)
        runtime.caps = attrs.evolve(caps, speculation=speculation)
        log.info("speculative decoding: %s, up to %d drafts per request and step", speculation.description,
                 speculation.max_num_drafts)
    return runtime


def load_text_shard(config: DeployConfig, caps: DeploymentCaps) -> TextRuntime:
    """This rank's shard of a tensor-parallel deployment (``ifb.parallel``): the model cut as it is built
    (``models.tensor_parallel``), a GGUF's matrices on their blocks as on one rank (``quantization``)."""
    from ifb.parallel import current
    from ifb_plugins.common.runtime.text import kv_bytes_per_token, kv_capacity_tokens, max_model_len_for

    ctx = current()
    if device_of(config).type != "cpu" or weights_dtype(config) != torch.float32:
        raise ValueError("tensor parallelism runs float32 shards on the CPU here: pass --device cpu "
                         "(and --dtype float32 or auto)")
    if ctx is None or ctx.world_size != config.num_ranks:
        raise RuntimeError(f"a {config.num_ranks}-rank text deployment loads inside ifb.parallel's ranks")
    from ifb_plugins.common.models.tensor_parallel import ShardPlan

    mode = quantization_mode(config)
    path = Path(config.model)
    loaded = load_checkpoint(path, defer_quantized=mode != "none")
    model, prepared = build_text_shard(loaded, mode, ctx)
    # every rank loads each adapter's share at start-up; one loaded later would reach rank 0 only
    lora = lora_set(model, config, shard=ShardPlan(loaded.config, ctx.rank, ctx.world_size).shard_adapter,
                    fixed="under tensor parallelism the LoRA adapters are loaded on every rank at start-up "
                          "(--lora NAME=DIR); one loaded while serving would reach rank 0 only")
    kv_dtype = kv_cache_dtype(config, mode, prepared)
    if config.max_kv_cache_capacity is None:
        # every rank holds the same block ids: the pool is what the tightest rank affords
        device = next(model.parameters()).device
        mine = kv_capacity_tokens(config, max_model_len_for(model, config), kv_bytes_per_token(model, kv_dtype), device)
        agreed = torch.tensor([mine], dtype=torch.int64)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=ctx.group)
        config = attrs.evolve(config, max_kv_cache_capacity=int(agreed.item()))
    name = config.options.get("served_model_name") or model_name_for(path)
    if ctx.rank == 0:
        c = loaded.config
        log.info("loaded %s (%s, %d layers, hidden %d; %s; rank 0 of %d: %d of %d heads, %d of %d KV heads; %s KV cache)",
                 name, loaded.source, c.num_layers, c.hidden_size, prepared.description, ctx.world_size,
                 model.config.num_heads, c.num_heads, model.config.num_kv_heads, c.num_kv_heads,
                 str(kv_dtype).removeprefix("torch."))
    runtime = TextRuntime(model=model, tokenizer=loaded.tokenizer, caps=caps, config=config, model_name=name,
                          lora=lora, kv_dtype=kv_dtype)
    if prepared.is_native:
        runtime.step_torch_threads = 1
    runtime.greedy_argmax = prepared.argmax
    return runtime


def build_text_shard(loaded: LoadedCheckpoint, mode: str, ctx) -> tuple[TextModel, PreparedModel]:
    """Rank ``ctx.rank``'s share of the deployment's model: a GGUF's matrices on their blocks where ``mode``
    runs them (cut along whole blocks), else float32; the layers run from Python (``TensorParallelParts``)."""
    from ifb_plugins.common.models.tensor_parallel import build_sharded_model

    on_blocks = mode != "none" and loaded.source == "gguf"
    tensors = {}
    if on_blocks:
        from ifb_plugins.common.loading.gguf import read_gguf_tensors

        tensors = read_gguf_tensors(loaded.path)

    def make_parts(plan, cut_tensors, cut_state) -> ModelParts:
        if not on_blocks:
            return ModelParts()
        from ifb_plugins.common.quant.parts import BlockParts

        parts = BlockParts(plan.local, cut_tensors, cut_state, activations=_ACTIVATIONS[mode],
                           deferred=loaded.deferred, layer_stack="torch")
        if parts.kernels is not None:
            parts.kernels.set_num_threads(torch.get_num_threads())
        return parts

    model, parts = build_sharded_model(loaded.config, loaded.state_dict, tensors, ctx, make_parts,
                                       deferred=loaded.deferred)
    return model, describe_model(model, parts, has_lora=False)
