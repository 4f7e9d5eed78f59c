"""Read a Qwen3.5 or Qwen3.5-MoE GGUF file (llama.cpp's ``qwen35`` / ``qwen35moe``) onto ``HybridModel``.

What llama.cpp's converter does to a ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` checkpoint,
undone here:

- the zero-centered RMSNorms are stored as ``1 + weight`` (``attn_norm``, ``post_attention_norm``,
  ``attn_{q,k}_norm``, ``output_norm``), which is how ``HybridModel`` holds them; the DeltaNet's
  gated norm (``ssm_norm``) is stored as it is;
- ``A_log`` as ``ssm_a = -exp(A_log)`` (the model's ``A``), ``dt_bias`` as ``ssm_dt.bias``, the conv
  kernel squeezed to ``[C, K]``, ``in_proj_{a,b}`` as ``ssm_{alpha,beta}``, ``in_proj_z`` as
  ``attn_gate``, ``in_proj_qkv`` as ``attn_qkv``;
- when there are more value heads than key heads, every value-head axis (the V rows of
  ``attn_qkv`` and of the conv, ``attn_gate``, ``ssm_alpha/beta``, ``ssm_a``, ``ssm_dt``, the columns of
  ``ssm_out``) is reordered from grouped by key head ``[K, V/K, d]`` to tiled ``[V/K, K, d]``
  (ggml's broadcast order): ``_untile`` puts them back;
- the experts stacked ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp``, the shared expert
  ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``.

The converter always writes ``rope.dimension_sections`` (interleaved MRoPE, ``[11, 11, 10]`` by
default): a text prompt's three position ids are equal, so that RoPE is the plain one over
``rope.dimension_count`` dimensions, which is what is run. A file with the multi-token-prediction
block (``nextn_predict_layers``; converted without ``--no-mtp``) is refused, naming the key: that
block is a draft head this loader does not read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ifb_plugins.mamba.config import ATTENTION, DELTANET, FFN_QWEN_MOE, FFN_SWIGLU, ConfigError, HybridConfig

ARCHS = ("qwen35", "qwen35moe")

#: GGUF layer tensor -> HybridModel name under ``backbone.layers.N.``, no reordering
_PLAIN = {"attn_norm.weight": "norm.weight", "post_attention_norm.weight": "ffn_norm.weight",
          "attn_q.weight": "mixer.q_proj.weight", "attn_k.weight": "mixer.k_proj.weight",
          "attn_v.weight": "mixer.v_proj.weight", "attn_output.weight": "mixer.o_proj.weight",
          "attn_q_norm.weight": "mixer.q_norm.weight", "attn_k_norm.weight": "mixer.k_norm.weight",
          "ssm_norm.weight": "mixer.norm.weight",
          "ffn_gate.weight": "ffn.gate_proj.weight", "ffn_up.weight": "ffn.up_proj.weight",
          "ffn_down.weight": "ffn.down_proj.weight", "ffn_gate_inp.weight": "ffn.gate.weight",
          "ffn_gate_shexp.weight": "ffn.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "ffn.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "ffn.shared_expert.down_proj.weight",
          "ffn_gate_inp_shexp.weight": "ffn.shared_expert_gate.weight",
          "ffn_down_exps.weight": "ffn.experts.down_proj"}


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> HybridConfig:
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata {arch}.{name} is missing")
        return value

    if meta.get(f"{arch}.nextn_predict_layers"):
        raise ConfigError(f"GGUF metadata {arch}.nextn_predict_layers: the multi-token-prediction block is "
                          "not read; convert the checkpoint with --no-mtp")
    recurrent = [bool(r) for r in key("attention.recurrent_layers")]
    num_layers = int(key("block_count"))
    if len(recurrent) != num_layers:
        raise ConfigError(f"GGUF metadata {arch}.attention.recurrent_layers lists {len(recurrent)} layers, "
                          f"block_count is {num_layers}")
    value_heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    moe = arch == "qwen35moe"
    moe_fields = dict(
        ffn=FFN_QWEN_MOE, num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        shared_intermediate_size=int(key("expert_shared_feed_forward_length")),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
    ) if moe else dict(ffn=FFN_SWIGLU)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return HybridConfig(
        family="qwen3_5", pattern="".join(DELTANET if r else ATTENTION for r in recurrent),
        vocab_size=int(tensors["token_embd.weight"].shape[0]), hidden_size=int(key("embedding_length")),
        num_heads=int(key("attention.head_count")), num_kv_heads=int(key("attention.head_count_kv")),
        head_dim=int(key("attention.key_length")), **moe_fields,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or 0) if moe
        else int(key("feed_forward_length")),
        mamba_num_heads=0, mamba_head_dim=0, ssm_state_size=0, n_groups=1,
        conv_kernel=int(key("ssm.conv_kernel")),
        linear_num_key_heads=int(key("ssm.group_count")), linear_num_value_heads=value_heads,
        linear_key_head_dim=int(key("ssm.state_size")), linear_value_head_dim=inner // value_heads,
        gated_attention=True, layer_norm_epsilon=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")), rotary_dim=int(key("rope.dimension_count")),
        rope_theta=float(key("rope.freq_base")), tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),))


def _untile(t: torch.Tensor, dim: int, config: HybridConfig, head_dim: int) -> torch.Tensor:
    """Value heads along ``dim`` from llama.cpp's tiled order ``[V/K, K, d]`` back to grouped ``[K, V/K, d]``."""
    k, v = config.linear_num_key_heads, config.linear_num_value_heads
    if k == v:
        return t  # the converter reorders nothing then
    dim %= t.dim()
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], v // k, k, head_dim, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape).contiguous()


def _deltanet(kind: str, t: torch.Tensor, config: HybridConfig) -> tuple[str, torch.Tensor] | None:
    """A DeltaNet tensor under ``mixer.``'s names in transformers' head order, or None when ``kind`` is none."""
    dv = config.linear_value_head_dim
    qk = 2 * config.linear_num_key_heads * config.linear_key_head_dim  # the q and k rows / channels
    if kind == "attn_qkv.weight":
        return "in_proj_qkv.weight", torch.cat([t[:qk], _untile(t[qk:], 0, config, dv)])
    if kind == "ssm_conv1d.weight":
        return "conv1d.weight", torch.cat([t[:qk], _untile(t[qk:], 0, config, dv)])[:, None, :]
    if kind == "attn_gate.weight":
        return "in_proj_z.weight", _untile(t, 0, config, dv)
    if kind in ("ssm_alpha.weight", "ssm_beta.weight"):
        return f"in_proj_{'a' if 'alpha' in kind else 'b'}.weight", _untile(t, 0, config, 1)
    if kind in ("ssm_a", "ssm_dt.bias"):
        return "A" if kind == "ssm_a" else "dt_bias", _untile(t.reshape(-1), 0, config, 1)
    if kind == "ssm_out.weight":
        return "out_proj.weight", _untile(t, 1, config, dv)
    return None


def our_tensors(raw: dict[str, torch.Tensor], config: HybridConfig) -> dict[str, torch.Tensor]:
    """The file's tensors (``raw``, float32, in torch's dimension order) under ``HybridModel``'s names."""
    out = {"backbone.embeddings.weight": raw.pop("token_embd.weight"),
           "backbone.norm_f.weight": raw.pop("output_norm.weight")}
    if "output.weight" in raw:
        out["lm_head.weight"] = raw.pop("output.weight")
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in raw.items():
        layer, _, kind = name.removeprefix("blk.").partition(".")
        if not name.startswith("blk.") or not layer.isdecimal():
            raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")
        p = f"backbone.layers.{layer}."
        if kind in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            experts.setdefault(int(layer), {})[kind.split("_")[1]] = t
        elif kind in _PLAIN:
            out[p + _PLAIN[kind]] = t
        elif (renamed := _deltanet(kind, t, config)) is not None:
            out[p + "mixer." + renamed[0]] = renamed[1]
        else:
            raise ConfigError(f"unexpected tensor {name!r} in the GGUF file")
    for layer, halves in experts.items():  # SparseMoE's fused [E, 2I, H]: gate rows, then up rows
        out[f"backbone.layers.{layer}.ffn.experts.gate_up_proj"] = torch.cat([halves["gate"], halves["up"]], dim=1)
    return out


def load_qwen3_5_gguf(meta: dict[str, Any], raw: dict[str, np.ndarray | torch.Tensor]
                      ) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """``(config, float32 state dict under HybridModel's names)`` of a ``qwen35`` / ``qwen35moe`` file's
    metadata and dequantized tensors."""
    tensors = {k: torch.as_tensor(v) for k, v in raw.items()}
    config = config_from_metadata(meta, tensors)
    return config, our_tensors(tensors, config)
