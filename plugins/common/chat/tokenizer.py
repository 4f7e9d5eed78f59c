"""Text tokenizer: a ``tokenizers.Tokenizer`` plus the checkpoint's jinja2 chat template.

Built from a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``)
or, for GGUF files, from the ``tokenizer.ggml.*`` metadata.
"""

from __future__ import annotations

import json
import warnings
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Pre-tokenizer regexes named by GGUF's ``tokenizer.ggml.pre`` (the ones we know).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

#: characters from which ``encode`` tokenizes without holding the GIL (it takes about a millisecond)
LONG_TEXT_CHARS = 4096

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {ch: b for b, ch in table.items()}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, which hub templates wrap around assistant turns
    (transformers uses it to find them); rendering only needs the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's tojson, which templates are written for: non-ASCII survives (unlike jinja2's
    # built-in filter) and the layout arguments pass through to json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class TextTokenizer:
    """Satisfies ``ifb.runtime.Tokenizer``: encode, decode, chat template, special ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        byte_level: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.byte_level = byte_level
        self._template: jinja2.Template | None = None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> TextTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (or ``chat_template.jinja``) from a directory."""
        path = Path(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        eos_ids: list[int] = []
        eos = _token_content(cfg.get("eos_token"))
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.append(tok.token_to_id(eos))
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            eos_ids.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        eos_ids.extend(extra_eos_ids)
        bos = _token_content(cfg.get("bos_token"))
        decoder = json.loads(tok.to_str()).get("decoder") or {}
        return cls(
            tok,
            chat_template=template,
            eos_token_ids=eos_ids,
            bos_token_id=tok.token_to_id(bos) if bos else None,
            byte_level="ByteLevel" in json.dumps(decoder),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], extra_eos_ids: Sequence[int] = ()) -> TextTokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata; ``extra_eos_ids`` also end
        a sequence."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise NotImplementedError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))

        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            # SmolLM's tokenizer splits every digit on its own before the GPT-2 regex.
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("llama-bpe", "llama3", "qwen2"):
            regex = _QWEN2_REGEX if pre == "qwen2" else _LLAMA3_REGEX
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            if pre not in ("gpt2", "default", None):
                warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 byte-level regex", stacklevel=2)
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        # Control tokens must match as whole strings before BPE and vanish on skip_special_tokens.
        typed = list(zip(tokens, types))
        control = [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == _TOKEN_CONTROL]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == _TOKEN_USER_DEFINED]
        tok.add_special_tokens(control)
        tok.add_tokens(user)

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
            bos = tokens[bos_id]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        eos_ids.extend(extra_eos_ids)  # the model's own ends of a turn (gpt-oss: the harmony markers)
        return cls(
            tok,
            chat_template=meta.get("tokenizer.chat_template"),
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            byte_level=True,
        )

    # -- the Tokenizer protocol ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS where the checkpoint asks for it."""
        if len(text) > LONG_TEXT_CHARS:  # the batch call releases the GIL: the engine's steps go on meanwhile
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level encoded, not decoded)."""
        return self.tokenizer.id_to_token(int(token_id))

    def token_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (for incremental detokenization and guided decoding)."""
        token = self.id_to_token(token_id)
        if token is None:
            return b""
        added = self.tokenizer.get_added_tokens_decoder().get(int(token_id))
        if added is not None:
            return added.content.encode("utf-8")
        if self.byte_level:
            table = _byte_decoder()
            return bytes(table[ch] for ch in token)
        # SentencePiece-style vocabularies: byte fallback tokens and the word-boundary marker.
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's jinja2 chat template (sandboxed)."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template; send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
