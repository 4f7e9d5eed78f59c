"""Test helpers: tiny random-weight checkpoints (HF layout, and GGUF the way llama.cpp
writes it) and a greedy loop over the paged cache.

Plugin tests write a checkpoint with ``save_tiny_checkpoint`` into a temp dir
and load it through the real loader (DESIGN.md section 8).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.loading.gguf import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from ifb_plugins.common.models.decoder import TextModel, allocate_kv_cache

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Enough variety for a few hundred merges, with multi-byte UTF-8 so decode is exercised.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In-flight batching lets a request join a running batch at the next step boundary.",
    "What is the capital of France? The capital of France is Paris.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, Ελληνικά, emoji 🙂🚀",
    "def forward(self, x):\n    return self.linear(x)\n",
    "A paged KV cache stores keys and values in fixed-size blocks.",
]


def train_tiny_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE trained in-process; the special tokens get ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    # SmolLM's layout: every digit on its own, then the GPT-2 byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte in the base vocabulary, so any text (any UTF-8) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def _hf_config(arch: str, sizes: dict[str, int], head_dim: int, tie: bool, rope_scaling: dict[str, Any] | None):
    """The tiny model's config, built by transformers' own config class for ``arch``."""
    import transformers

    common: dict[str, Any] = dict(**sizes, hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-5,
                                  tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling is not None:
        rope = {"rope_theta": 10000.0, **{k: v for k, v in rope_scaling.items() if k != "type"},
                "rope_type": rope_scaling.get("rope_type", rope_scaling.get("type"))}
    if arch == "llama":
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False, rope_parameters=rope)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False, rope_parameters=rope)
    return transformers.Qwen3Config(**common, head_dim=head_dim, attention_bias=False, use_sliding_window=False,
                                    rope_parameters=rope)


def _random_weights(cfg: dict[str, Any], head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    arch = cfg["model_type"]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        # Fan-in scaling keeps activations O(1) through the layers, so logits are meaningful.
        std = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=gen) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + rand(dim, scale=0.1)  # not all ones, so a dropped norm weight shows

    # 1/sqrt(h) keeps tied logits (normed hidden . embedding row) O(1): a peaked random model
    # would emit one token forever and make batching tests pass trivially.
    sd = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h), "model.norm.weight": norm(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            sd[p + f"self_attn.{name}.weight"] = rand(rows, h)
            if arch == "qwen2":
                sd[p + f"self_attn.{name}.bias"] = rand(rows, scale=0.1)
        sd[p + "self_attn.o_proj.weight"] = rand(h, q)
        if arch == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = norm(head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sd[p + "mlp.gate_proj.weight"] = rand(inter, h)
        sd[p + "mlp.up_proj.weight"] = rand(inter, h)
        sd[p + "mlp.down_proj.weight"] = rand(h, inter)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = rand(cfg["vocab_size"], h)
    return sd


def save_tiny_checkpoint(
    directory: str | Path,
    arch: Literal["llama", "qwen2", "qwen3"] = "llama",
    seed: int = 0,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """A tiny random-weight checkpoint built by transformers' classes and written by ``save_pretrained``
    (the tokenizer by ``PreTrainedTokenizerFast``); returns the dir.

    Defaults tie the embeddings for llama and qwen3 and not for qwen2, so both
    output-head layouts are covered.
    """
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tie = arch != "qwen2" if tie_word_embeddings is None else tie_word_embeddings
    head_dim = hidden_size // num_heads
    sizes = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
    }
    config = _hf_config(arch, sizes, head_dim, tie, rope_scaling)
    weights = _random_weights({**sizes, "model_type": arch, "tie_word_embeddings": tie}, head_dim, seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set()), (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(str(directory))

    save_tiny_tokenizer(directory, min(300, vocab_size))
    return directory


def save_tiny_tokenizer(directory: str | Path, vocab_size: int = 300) -> None:
    """The tiny byte-level BPE with a ChatML template, saved by transformers' ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(vocab_size), bos_token=SPECIAL_TOKENS[0],
                                  eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0], model_max_length=512)
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(str(directory))


def saved_chat_template(hf_dir: str | Path) -> str:
    """A checkpoint's chat template: ``chat_template.jinja`` (transformers 5), else ``tokenizer_config.json``."""
    hf_dir = Path(hf_dir)
    template = hf_dir / "chat_template.jinja"
    if template.exists():
        return template.read_text()
    return json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]


_GGUF_LAYER = {hf: g for g, hf in GGUF_LAYER_NAMES.items()}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter row order for Q/K: rotate-half pairs become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def save_tiny_gguf(
    hf_dir: str | Path,
    path: str | Path,
    weight_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_1,
    embed_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
    *,
    tensor_types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
    quantize: Callable[[np.ndarray, gguf.GGMLQuantizationType], np.ndarray] = gguf.quants.quantize,
) -> Path:
    """Convert a tiny *llama* checkpoint to GGUF the way llama.cpp does (Q/K permuted, quantized).

    Matrices use ``weight_type`` and the embedding ``embed_type`` (the default
    model's layout); norms stay float32. ``tensor_types`` (GGUF tensor name ->
    type) overrides a matrix's type (a mix, as llama.cpp's ``Q4_K_M``), and
    ``quantize`` writes the blocks (for types ``gguf`` cannot quantize). The tokenizer goes into
    ``tokenizer.ggml.*`` metadata with pre-tokenizer ``smollm``.
    """
    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg["model_type"] != "llama":
        raise ValueError("save_tiny_gguf writes the llama layout only")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]  # the model's vocab is padded past the tokenizer's
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in special else 5 if t.startswith("[PAD") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(saved_chat_template(hf_dir))

    gguf_names = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
    state = load_file(str(hf_dir / "model.safetensors"))
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if name in gguf_names:
            gname = gguf_names[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"
        if name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, heads)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, kv_heads)
        qtype = embed_type if gname == "token_embd.weight" else weight_type if data.ndim == 2 else None
        if qtype is not None and tensor_types and gname in tensor_types:
            qtype = tensor_types[gname]
        if qtype is None or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@torch.no_grad()
def greedy_generate_batch(
    model: TextModel, prompts: Sequence[Sequence[int]], n: int, block_size: int = 16,
    kv_dtype: torch.dtype | None = None, with_prompt_lengths: bool = False,
) -> list[list[int]]:
    """Greedy-decode ``n`` tokens for every prompt in one ragged batch over the paged cache.

    Step 1 prefills all prompts together; every later step decodes one token per
    sequence. Block ids are interleaved across sequences so a sequence's blocks
    are never contiguous in the cache (as in a real serving run). The KV cache holds
    ``kv_dtype`` (default: the model's dtype). ``with_prompt_lengths``: each step's metadata
    names the prompts' lengths, as the serving runtime's does.
    """
    device = model.model.norm.weight.device  # the embedding may be looked up in GGUF blocks
    dtype = model.model.norm.weight.dtype
    per_seq = [math.ceil((len(p) + n) / block_size) for p in prompts]
    width = max(per_seq)
    tables = [[j * len(prompts) + b for j in range(per_seq[b])] for b in range(len(prompts))]
    caches = allocate_kv_cache(model.config, width * len(prompts), block_size, kv_dtype or dtype, device)
    starts = [0] * len(prompts)
    step_ids = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(n):
        attn = build_attn_metadata(
            [(starts[b], len(step_ids[b]), tables[b]) for b in range(len(prompts))], block_size, device,
            num_prompt_tokens=[len(p) for p in prompts] if with_prompt_lengths else None,
        )
        flat = [t for ids in step_ids for t in ids]
        positions = [starts[b] + i for b in range(len(prompts)) for i in range(len(step_ids[b]))]
        hidden = model(torch.tensor(flat, device=device), torch.tensor(positions, device=device), attn, caches)
        last = attn.query_start_loc[1:] - 1  # the last token of each sequence samples
        next_ids = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for b, tok in enumerate(next_ids):
            out[b].append(tok)
            starts[b] += len(step_ids[b])
            step_ids[b] = [tok]
    return out


def greedy_generate(model: TextModel, ids: Sequence[int], n: int, block_size: int = 16,
                    kv_dtype: torch.dtype | None = None, with_prompt_lengths: bool = False) -> list[int]:
    """Greedy-decode ``n`` tokens after ``ids`` alone (a batch of one)."""
    return greedy_generate_batch(model, [ids], n, block_size, kv_dtype, with_prompt_lengths)[0]


def build_on_blocks(loaded: Any, raw: Mapping[str, Any] | None = None, backend: str | None = None, *,
                    activations: str = "int16", layer_stack: str = "torch",
                    prompt_activations: str | None = None) -> tuple[TextModel, Any]:
    """``build_model(loaded)`` from ``quant.parts.BlockParts`` over ``raw`` (by default the file's own
    tensors): ``(model, parts.report)``. ``layer_stack="torch"`` keeps the layer loop (its matmuls
    and attention native all the same); ``"auto"``: the native decoder where the layers fit it
    (``prompt_activations``: its codes on prompt rows)."""
    from ifb_plugins.common.loading.checkpoint import build_model
    from ifb_plugins.common.loading.gguf import read_gguf_tensors
    from ifb_plugins.common.quant.parts import BlockParts

    parts = BlockParts(loaded.config, read_gguf_tensors(loaded.path) if raw is None else raw, loaded.state_dict,
                       backend, activations=activations, deferred=loaded.deferred, layer_stack=layer_stack,
                       prompt_activations=prompt_activations)
    return build_model(loaded, parts=parts), parts.report


def save_tiny_llama(directory: str | Path, seed: int = 0, *, num_heads: int = 4, num_kv_heads: int = 2,
                    hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2, vocab_size: int = 320,
                    bias: bool = False, tie_word_embeddings: bool = False) -> Path:
    """A random-weight Llama built by transformers' ``LlamaForCausalLM`` and written with ``save_pretrained``
    (``bias``: on the attention projections and the MLP), with the tiny tokenizer and a ChatML template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.moe import randomize, save_tokenizer_files

    directory = Path(directory)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=512, rms_norm_eps=1e-6, attention_bias=bias, mlp_bias=bias,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(directory)
    save_tokenizer_files(directory)
    return directory
