"""The plugins' shared model layer: what more than one plugin builds on.

Not a plugin (it registers no hooks): the ``text``, ``vlm``, ``mamba`` and ``speech`` plugins, and
third-party ones, import it; it imports no plugin. A plugin never imports another plugin's modules.

Its public API is what this package exports (``__all__``, imported lazily, so that
``import ifb_plugins.common`` loads neither torch nor a kernel)::

    from ifb_plugins.common import TextRuntime, load_checkpoint, build_model, text_options

and the names without a leading underscore of the modules in ``PUBLIC_MODULES``:

- ``caps``: the declarations every deployment on ``TextRuntime`` shares (``text_options``,
  ``TEXT_ENDPOINTS``, ``TEXT_RUNTIME_SETTINGS``, ``MAX_BUILT_BATCH``);
- ``runtime``: ``TextRuntime``, the paged-KV stepped runtime base (``KV_BLOCK_SIZE``,
  ``kv_capacity_tokens``);
- ``sampling``: ``sample_step``, per-sequence sampling of a step's logits;
- ``tokenizer`` and ``prompt``: ``TextTokenizer``, chat rendering with the checkpoint's template,
  ``prompt_token_ids``;
- ``config``, ``loader``, ``hf_loader``, ``gguf_loader``: ``TextModelConfig``, reading Hugging Face
  safetensors directories and GGUF files into a ``TextModel``;
- ``model`` and ``attention``: the Llama-family decoder (``TextModel``, ``RMSNorm``, RoPE) over a
  paged KV cache (``AttnMetadata``, ``build_attn_metadata``, ``write_kv``);
- ``media`` and ``mel``: OpenAI-style image / audio content parts (parsing, inline or local
  fetching, decoding: ``parse_messages``, ``MediaItem``) and Whisper's log-mel features in numpy
  (``log_mel_features``, ``resample_linear``); ``media_prompt``: media placeholders expanded at
  admission and their embeddings spliced into a step (``expand_media``, ``splice_embeddings``);
- ``vision``, ``qwen2_5_vl_vision``, ``qwen3_vl_vision``: vision towers (CLIP / SigLIP, Qwen2.5-VL's,
  Qwen3-VL's, which Qwen3-Omni's Thinker shares) and ``image_ops``, ``qwen2_5_vl_image``: their image
  preprocessing (Qwen2-VL's smart resize and patches); ``deepstack``: the decoder that adds
  Qwen3-VL's DeepStack features after its first layers;
- ``mrope``: M-RoPE (Qwen2-VL / Qwen3-VL): per-token ``[3, T]`` positions for media prompts and the
  sectioned rotary;
- ``moe``: sparse mixture-of-experts layers (``SparseMoE``: router, routed experts, Qwen2-MoE's
  gated shared expert; ``route``; ``fuse_expert_state`` for checkpoints' expert layouts);
- ``quant``, ``quant_torch``, ``qkernels``, ``native_decoder``, ``triton_kernels``: the GGUF-block
  linear layers and their kernels (the C sources of ``qkernels`` live in ``csrc/``);
- ``lora``, ``guided``, ``syscache``: adapters, guided decoding, the legacy system-prompt capture;
- ``testing``, ``testing_moe``: tokenizers and tiny models for plugin tests (``testing_moe``:
  transformers-built MoE checkpoints and their GGUF as llama.cpp writes it).

``tests/plugins/test_imports.py`` holds every plugin to this: it fails on an import of another
plugin's module, of a module not listed here, or of a private name.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the modules whose public names (no leading underscore) a plugin may import
PUBLIC_MODULES = (
    "caps", "runtime", "sampling", "tokenizer", "prompt", "config", "loader", "hf_loader", "gguf_loader",
    "model", "attention", "media", "media_prompt", "mel", "vision", "qwen2_5_vl_vision", "qwen3_vl_vision", "image_ops",
    "qwen2_5_vl_image", "deepstack", "moe", "mrope", "quant", "quant_torch", "qkernels", "native_decoder", "triton_kernels", "lora",
    "guided", "syscache", "testing", "testing_moe",
)

#: what ``from ifb_plugins.common import NAME`` gives, and the module it comes from
_EXPORTS = {
    "MAX_BUILT_BATCH": "caps", "TEXT_ENDPOINTS": "caps", "TEXT_RUNTIME_SETTINGS": "caps", "text_options": "caps",
    "TextRuntime": "runtime", "KV_BLOCK_SIZE": "runtime", "DEFAULT_MAX_MODEL_LEN": "runtime",
    "kv_capacity_tokens": "runtime",
    "SeqSample": "sampling", "sample_step": "sampling",
    "TextTokenizer": "tokenizer", "prompt_token_ids": "prompt", "render_chat": "prompt",
    "TextModelConfig": "config",
    "LoadedCheckpoint": "loader", "load_checkpoint": "loader", "build_model": "loader",
    "load_hf_state_dict": "hf_loader", "read_gguf_tensors": "gguf_loader",
    "TextModel": "model", "RMSNorm": "model",
    "AttnMetadata": "attention", "build_attn_metadata": "attention", "write_kv": "attention",
    "LoraSet": "lora",
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
