"""A tiny Qwen3 reasoning model, built with transformers' own classes and Qwen3's published chat template.

Its weights are random except where they make it think: every layer's output
projections are zero, so the residual stream at a position is that token's
embedding, and the (untied) output head maps chosen tokens to chosen next
tokens. Greedy decoding then walks a fixed chain: after the generation prompt
(``<|im_start|>assistant\\n``) it writes ``<think>`` + ``THOUGHT`` + ``</think>``
``\\n\\n`` + ``ANSWER``, then ``<|im_end|>``; after Qwen3's thinking-off prompt
(which ends in ``</think>\\n\\n``) it writes only ``ANSWER``. The template and
the tokenizer's added tokens (``<think>`` and ``</think>`` not special) are
Qwen3's.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEMPLATE = Path(__file__).parents[1] / "core" / "server" / "templates" / "qwen3.jinja"
THOUGHT_WORDS = ("hmm", " maybe", " yes")
ANSWER_WORDS = ("Hello", " there", " friend")
THOUGHT = "".join(THOUGHT_WORDS)
ANSWER = "".join(ANSWER_WORDS)
_CORPUS = ["hmm maybe yes", "Hello there friend", "the quick brown fox jumps over the lazy dog",
           "user assistant system tool call arguments name weather city Paris", "0123456789 {} [] : , \""]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 8 + ["\n", "\n\n"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=TEMPLATE.read_text())
    # as in Qwen3's tokenizer: the thinking and tool-call tags are added tokens, not special ones
    fast.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"], special_tokens=False)
    return fast


def save_reasoning_model(directory: str | Path, seed: int = 0) -> Path:
    """Save the model and its tokenizer with ``save_pretrained``; returns the directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(config).eval()
    ids = tokenizer.convert_tokens_to_ids
    words = [tokenizer.encode(w, add_special_tokens=False) for w in (*THOUGHT_WORDS, *ANSWER_WORDS)]
    assert all(len(w) == 1 for w in words), words  # each word one token, so the chain is one step a word
    thought, answer = [w[0] for w in words[:3]], [w[0] for w in words[3:]]
    newline, blank = (tokenizer.encode(t, add_special_tokens=False) for t in ("\n", "\n\n"))
    assert len(newline) == 1 and len(blank) == 1
    chain = [newline[0], ids("<think>"), *thought, ids("</think>"), blank[0], *answer, ids("<|im_end|>")]
    assert len(set(chain)) == len(chain)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for current, following in zip(chain, chain[1:]):
            head[following] += 4.0 * embed[current] / embed[current].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
