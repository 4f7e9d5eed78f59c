"""The plugins' shared model layer: what more than one plugin builds on.

Not a plugin (it registers no hooks): the ``text``, ``vlm``, ``mamba`` and ``speech`` plugins, and
third-party ones, import it. Its modules are its public API:

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
- ``moe``: sparse mixture-of-experts layers (``SparseMoE``: router, routed experts, Qwen2-MoE's
  gated shared expert; ``route``; ``fuse_expert_state`` for checkpoints' expert layouts);
- ``quant``, ``quant_torch``, ``qkernels``, ``native_decoder``, ``triton_kernels``: the GGUF-block
  linear layers and their kernels;
- ``lora``, ``guided``, ``syscache``: adapters, guided decoding, the legacy system-prompt capture;
- ``testing``, ``testing_moe``: tokenizers and tiny models for plugin tests (``testing_moe``:
  transformers-built MoE checkpoints and their GGUF as llama.cpp writes it).
"""
