"""Test helpers: a tiny random Gemma 4 text model built with transformers' ``Gemma4ForCausalLM`` and
saved with ``save_pretrained``, with every text feature on: sliding-window and full layers of
different head widths and KV heads, KV sharing, per-layer inputs, keys as values on the full
layers, double-wide shared-layer MLPs, final logit soft-capping."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.models.text import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer

VOCAB_SIZE = 320
SLIDING_WINDOW = 16
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention")


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Fan-in scaled matrices, norms and layer scalars near one: transformers' init leaves
    near-zero logits, which would make a comparison prove little."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("layer_scalar"):
            p.copy_(0.75 + 0.5 * torch.rand(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2:  # the embeddings too: scaled by sqrt(hidden) on input, tied as the output head
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


#: the tiny SentencePiece-style tokenizer's special tokens (Gemma's ids 0..3)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def save_gemma_style_tokenizer(directory: str | Path) -> None:
    """Replace a saved tiny model's tokenizer by one of Gemma's kind, saved by ``PreTrainedTokenizerFast``:
    a BPE over ``▁``-for-space text with byte fallback (every byte a ``<0xNN>`` token) and a
    Sequence decoder, ``VOCAB_SIZE`` tokens in all. llama.cpp's Gemma 4 converter reads the
    vocabulary with ``gguf.LlamaHfVocab``, which takes only that kind: given the byte-level BPE of
    ``train_tiny_tokenizer`` it stops with ``FileNotFoundError: Cannot find Llama BPE tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.models.text import _CORPUS

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                  special_tokens=[*GEMMA_SPECIALS, *(f"<0x{i:02X}>" for i in range(256))])
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    directory = Path(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink(missing_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", model_max_length=2048)
    fast.save_pretrained(str(directory))


def save_tiny_gemma4(directory: str | Path, seed: int = 0, **overrides) -> Path:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, sliding_window=SLIDING_WINDOW,
        vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        final_logit_softcapping=30.0, attention_k_eq_v=True, use_double_wide_mlp=True,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**fields, **overrides})).float().eval()
    _redraw(model, seed)
    directory = Path(directory)
    model.save_pretrained(str(directory))
    tok = train_tiny_tokenizer(vocab_size=300)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML_TEMPLATE,
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": 2048}, indent=2))
    return directory


def save_tiny_gemma4_assistant(directory: str | Path, seed: int = 0, use_ordered_embeddings: bool = False) -> Path:
    """A tiny ``Gemma4AssistantForCausalLM`` built by transformers that fits ``save_tiny_gemma4``'s target:
    its backbone width (64), and per layer type the KV heads and widths of the target's last KV-computing
    layer of that type (sliding: 2 x 16, full: 1 x 32). ``use_ordered_embeddings``: logits over the top
    two of eight centroids, with a random token ordering."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    text = Gemma4TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        sliding_window=SLIDING_WINDOW, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        attention_k_eq_v=True,
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64,
                                   use_ordered_embeddings=use_ordered_embeddings, num_centroids=8,
                                   centroid_intermediate_top_k=2)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).float().eval()
    _redraw(model, seed)
    if use_ordered_embeddings:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB_SIZE,
                                                                       generator=torch.Generator().manual_seed(seed)))
    model.generation_config.num_assistant_tokens = 4
    directory = Path(directory)
    model.save_pretrained(str(directory))
    return directory


def fit_tiny_gemma4_assistant(target_dir: Path, assistant_dir: Path, prompts: list[list[int]], steps: int = 30,
                              max_new_tokens: int = 24) -> float:
    """Train the saved assistant a little to predict its target's greedy next token (saved back with
    ``save_pretrained``), so that speculative decoding with it accepts drafts: a random assistant's drafts
    are all rejected, which leaves the acceptance path untested. Trained through ifb's assistant module
    (the same weights and key names as transformers') on the target's greedy continuations of ``prompts``;
    its reference equality is tested on its own. Returns the share of training positions it then predicts."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from ifb_plugins.common.layers.attention import build_attn_metadata
    from ifb_plugins.common.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantModel, target_kv_layers
    from ifb_plugins.text.families import build_family_model

    hf_target = Gemma4ForCausalLM.from_pretrained(str(target_dir)).eval()
    target, _ = build_family_model(Path(target_dir))
    caches = target.allocate_kv_caches(8 * len(prompts), 16, torch.float32, "cpu")
    seats, inputs = [], []
    with torch.no_grad():
        for n, ids in enumerate(prompts):
            seq = hf_target.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
            blocks = list(range(8 * n, 8 * n + 8))
            hidden = target(torch.tensor(seq), torch.arange(len(seq)),
                            build_attn_metadata([(0, len(seq), blocks)], 16), caches)
            for p in range(len(ids), len(seq) - 1):
                seats.append((p - 1, 1, blocks))
                inputs.append((seq[p], hidden[p - 1], p, seq[p + 1]))
    hf_assistant = Gemma4AssistantForCausalLM.from_pretrained(str(assistant_dir)).eval()
    import json

    model = Gemma4AssistantModel(Gemma4AssistantConfig.from_hf_config(json.loads((Path(assistant_dir) / "config.json")
                                                                                  .read_text())))
    model.load_state_dict({k: v for k, v in hf_assistant.state_dict().items() if k != "lm_head.weight"}, strict=True)
    attn = build_attn_metadata(seats, 16)
    kv = {kind: caches[i] for kind, i in target_kv_layers(target.config).items()}
    scale = torch.tensor(target.config.hidden_size ** 0.5)
    with torch.no_grad():
        embeds = target.model.embed_tokens(torch.tensor([t for t, *_ in inputs])) * scale
    hidden = torch.stack([h for _, h, *_ in inputs])
    positions = torch.tensor([p for *_, p, _ in inputs])
    labels = torch.tensor([y for *_, y in inputs])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(steps):
        logits, _ = model(embeds, hidden, positions, attn, kv)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        hit_rate = (model(embeds, hidden, positions, attn, kv)[0].argmax(-1) == labels).float().mean().item()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf_assistant.load_state_dict(state, strict=False)
    hf_assistant.save_pretrained(str(assistant_dir))
    return hit_rate
