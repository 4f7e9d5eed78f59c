"""The plugins' shared model layer: what more than one plugin builds on.

Not a plugin (it registers no hooks): the ``text``, ``vlm``, ``mamba`` and ``speech`` plugins, and
third-party ones, import it; it imports no plugin. A plugin never imports another plugin's modules.

Its public API is what this package exports (``__all__``, imported lazily, so that
``import ifb_plugins.common`` loads neither torch nor a kernel)::

    from ifb_plugins.common import TextRuntime, load_checkpoint, build_model, text_options

and the names without a leading underscore of the modules in ``PUBLIC_MODULES``, one package per
kind of thing:

- ``runtime``: ``text`` (``TextRuntime``, the paged-KV stepped runtime base: ``KV_BLOCK_SIZE``,
  ``kv_capacity_tokens``), ``caps`` (what every deployment on it declares: ``text_options``,
  ``TEXT_ENDPOINTS``, ``TEXT_RUNTIME_SETTINGS``, ``MAX_BUILT_BATCH``), ``lora`` (adapters),
  ``syscache`` (the legacy system-prompt capture) and ``placement`` (``device_of``, ``weights_dtype``:
  ``--device`` / ``--dtype`` as torch values);
- ``decoding``: ``sampling`` (``sample_step``, per-sequence sampling of a step's logits),
  ``filters`` (top-k / top-p / min-p cuts without whole-vocabulary sorts), ``speculative``
  (verifying drafted tokens: greedy agreement, rejection sampling) and ``guided`` (grammar-constrained
  decoding);
- ``speculative``: draft sources, ``drafter`` (the ``Drafter`` protocol), ``ngram`` (prompt lookup)
  ``draft_model`` (a draft model over its own paged cache) and ``assistant`` (a head fed the target's
  hidden state: Gemma 4's assistant, ``models.gemma4_assistant``, over the target's own KV);
- ``chat``: ``tokenizer`` (``TextTokenizer``) and ``prompt`` (chat rendering with the checkpoint's
  template, ``prompt_token_ids``);
- ``models``: ``config`` (``TextModelConfig``), ``decoder`` (the Llama-family ``TextModel`` over a
  paged KV cache, ``RMSNorm``, RoPE), ``parts`` (``ModelParts``: what a ``TextModel`` is built from;
  ``LayerStack``), ``deepstack`` (Qwen3-VL's DeepStack decoder), ``native_decoder`` (the whole
  stack as one native call per step), ``tensor_parallel`` (the Megatron-style shards of a model
  across ranks), and the family modules with layers of their own, ``gemma4`` (Gemma 4 text) and
  ``gpt_oss`` (its GGUF files: ``gpt_oss_gguf``);
- ``layers``: ``attention`` (paged attention: ``AttnMetadata``, ``build_attn_metadata``,
  ``write_kv``), ``mrope`` (M-RoPE positions and rotary), ``moe`` (``SparseMoE``, ``route``,
  ``route_grouped_sigmoid``, ``dispatch_to_experts``, ``fuse_expert_state``), ``triton_kernels`` (the GPU hot ops) and ``triton_attention``
  (paged prefill and decode attention with sliding windows and sinks in Triton);
- ``loading``: ``checkpoint`` (``load_checkpoint``, ``build_model``: a ``.gguf`` file or a Hugging
  Face directory), ``hf``, ``gguf``, ``memory`` (the file's map, read once; the fits-in-memory check)
  and ``processor`` (``ProcessorFiles``: a checkpoint's image and audio processor settings from either
  processor file, as transformers reads them);
- ``quant``: ``linear`` (the GGUF-block linear layers), ``parts`` (``BlockParts``: a model built on
  them), ``blocks`` (their integer reference in torch), ``int4_torch`` (torch's packed int4
  fallback), ``triton_blocks`` (GGUF blocks dequantized inside a Triton matmul), ``triton_parts``
  (``DeviceParts``: a model built for a CUDA device on those kernels) and ``kernels`` (the native kernels; their C sources live in ``quant/csrc/``);
- ``media``: ``parts`` (OpenAI-style image / audio content parts: ``parse_messages``,
  ``MediaItem``), ``prompt`` (placeholders expanded at admission, embeddings spliced per step),
  ``mel`` (Whisper's log-mel features), ``image_ops`` and ``qwen2_5_vl_image`` (image
  preprocessing as the models' processors compute it), and the vision towers ``vision`` (CLIP /
  SigLIP), ``qwen2_5_vl_vision`` and ``qwen3_vl_vision`` (Qwen3-VL's, and Qwen3.5's without DeepStack),
  ``qwen3_audio`` (the Qwen3 audio encoder Qwen3-Omni and Qwen3-ASR share), and ``gemma4_vision`` /
  ``gemma4_audio`` (Gemma 4's encoders with their preprocessing).

Test fixtures (tiny reference-built checkpoints) live in the test tree (``tests/models``), not here.

``tests/plugins/test_imports.py`` holds every plugin to this: it fails on an import of another
plugin's module, of a module not listed here, or of a private name.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the modules whose public names (no leading underscore) a plugin may import
PUBLIC_MODULES = (
    "runtime.caps", "runtime.text", "runtime.lora", "runtime.syscache", "decoding.sampling", "decoding.filters",
    "decoding.guided", "chat.tokenizer", "chat.prompt", "models.config", "models.decoder",
    "models.deepstack", "models.native_decoder", "models.parts", "models.tensor_parallel", "models.gemma4",
    "models.gpt_oss", "models.gpt_oss_gguf", "layers.moe", "layers.attention", "layers.mrope", "layers.triton_kernels",
    "loading.checkpoint", "loading.hf", "loading.gguf", "loading.memory", "loading.processor", "quant.linear",
    "quant.parts",
    "quant.blocks", "quant.int4_torch", "quant.kernels", "media.parts", "media.prompt", "media.mel",
    "media.image_ops", "media.vision", "media.qwen2_5_vl_image", "media.qwen2_5_vl_vision",
    "media.qwen3_vl_vision", "media.qwen3_audio", "media.gemma4_vision", "media.gemma4_audio",
    "decoding.speculative", "speculative.drafter",
    "speculative.ngram", "speculative.draft_model", "speculative.assistant", "models.gemma4_assistant",
    "runtime.placement", "layers.triton_attention", "quant.triton_blocks", "quant.triton_parts",
)

#: what ``from ifb_plugins.common import NAME`` gives, and the module it comes from
_EXPORTS = {
    "MAX_BUILT_BATCH": "runtime.caps", "TEXT_ENDPOINTS": "runtime.caps", "TEXT_RUNTIME_SETTINGS": "runtime.caps",
    "text_options": "runtime.caps",
    "TextRuntime": "runtime.text", "KV_BLOCK_SIZE": "runtime.text", "DEFAULT_MAX_MODEL_LEN": "runtime.text",
    "kv_capacity_tokens": "runtime.text",
    "SeqSample": "decoding.sampling", "sample_step": "decoding.sampling",
    "TextTokenizer": "chat.tokenizer", "prompt_token_ids": "chat.prompt", "render_chat": "chat.prompt",
    "TextModelConfig": "models.config",
    "LoadedCheckpoint": "loading.checkpoint", "load_checkpoint": "loading.checkpoint",
    "build_model": "loading.checkpoint",
    "load_hf_state_dict": "loading.hf", "read_gguf_tensors": "loading.gguf",
    "TextModel": "models.decoder", "RMSNorm": "models.decoder",
    "AttnMetadata": "layers.attention", "build_attn_metadata": "layers.attention", "write_kv": "layers.attention",
    "LoraSet": "runtime.lora",
}

__all__ = ["PUBLIC_MODULES", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
