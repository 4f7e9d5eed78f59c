"""The text tokenizer of a Qwen3-TTS checkpoint: ``tokenizer.json``, or Qwen2's ``vocab.json`` + ``merges.txt``.

Checkpoints that ship only the BPE files are read as transformers'
``Qwen2Tokenizer`` builds them: byte-level BPE after NFC and Qwen2's split
pattern, with the added tokens of ``tokenizer_config.json`` at their ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from ifb_plugins.common.chat.tokenizer import TextTokenizer

#: transformers' Qwen2Tokenizer PRETOKENIZE_REGEX
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_bpe(path: Path) -> Tokenizer:
    """A ``tokenizers`` tokenizer from ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json``."""
    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    lines = (path / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    added = sorted((int(i), t) for i, t in (cfg.get("added_tokens_decoder") or {}).items())
    for token_id, spec in added:
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                           lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                           normalized=spec.get("normalized", not spec.get("special", False)),
                           special=spec.get("special", False))
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])
        if tok.token_to_id(spec["content"]) != token_id:
            raise ValueError(f"{cfg_file}: added token {spec['content']!r} should have id {token_id}, "
                             f"but the vocabulary gives it {tok.token_to_id(spec['content'])}")
    return tok


def load_text_tokenizer(path: str | Path) -> TextTokenizer:
    path = Path(path)
    if (path / "tokenizer.json").exists():
        return TextTokenizer.from_hf_dir(path)
    if (path / "vocab.json").exists() and (path / "merges.txt").exists():
        tok = qwen2_bpe(path)
        im_end = tok.token_to_id("<|im_end|>")
        return TextTokenizer(tok, chat_template=None, eos_token_ids=[] if im_end is None else [im_end])
    raise FileNotFoundError(f"{path} has no text tokenizer (tokenizer.json, or vocab.json with merges.txt)")
