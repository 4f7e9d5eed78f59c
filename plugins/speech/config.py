"""The architecture of a speech checkpoint: Thinker, Talker and code-to-waveform sections.

A checkpoint's ``config.json`` holds three sections: ``thinker_config`` (a
Hugging Face Llama-family config, absent for a standalone TTS model),
``talker_config`` and ``code2wav_config``. Each section is reduced to frozen
data here; the modules are built only from it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

from ifb_plugins.common.config import TextModelConfig

#: every sample rate the decoder produces (the Qwen3-Omni / Qwen3-TTS rate)
SAMPLE_RATE = 24000

#: OpenAI's voice names, used when a checkpoint does not list its own
DEFAULT_VOICES = ("alloy", "echo", "fable", "onyx", "nova", "shimmer")


class SpeechConfigError(ValueError):
    """A checkpoint's config.json does not describe a speech model this plugin builds."""


def _need(section: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise SpeechConfigError(f"config.json: {where} has no {key!r}")
    return section[key]


@attrs.frozen
class TalkerConfig:
    """A decoder-only transformer over audio codec tokens, conditioned on text.

    Its token vocabulary is ``codebook_size`` codes plus two control tokens
    (``codec_bos_id``, ``codec_eos_id``). The text it speaks enters as a prefix
    of embeddings: one speaker row, then one row per text token
    (``text_embed``, plus a projection of the Thinker's hidden state when
    ``thinker_hidden_size`` is set), then the codec BOS.
    """

    codebook_size: int
    text_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    #: the Thinker's hidden size; None for a standalone TTS Talker (text tokens only)
    thinker_hidden_size: int | None = None
    voices: tuple[str, ...] = DEFAULT_VOICES
    #: codes spoken per text token are kept within [min, max]: EOS is masked before the minimum
    min_codes_per_token: int = 1
    max_codes_per_token: int = 8
    temperature: float = 0.9
    top_k: int = 50

    @property
    def codec_bos_id(self) -> int:
        return self.codebook_size

    @property
    def codec_eos_id(self) -> int:
        return self.codebook_size + 1

    @property
    def max_text_tokens_per_segment(self) -> int:
        """Text tokens one Talker context holds: speaker + text + BOS + the most codes they may need."""
        return max(1, (self.max_position_embeddings - 2) // (1 + self.max_codes_per_token))

    def decoder_config(self) -> TextModelConfig:
        """The Talker's transformer as a text-model config over the codec vocabulary."""
        return TextModelConfig(
            arch="llama", vocab_size=self.codebook_size + 2, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TalkerConfig:
        where = "talker_config"
        hidden = int(_need(raw, "hidden_size", where))
        heads = int(_need(raw, "num_attention_heads", where))
        voices = tuple(raw.get("voices") or DEFAULT_VOICES)
        if len(set(voices)) != len(voices) or not all(isinstance(v, str) and v for v in voices):
            raise SpeechConfigError("config.json: talker_config.voices must be distinct non-empty names")
        cfg = cls(
            codebook_size=int(_need(raw, "codebook_size", where)),
            text_vocab_size=int(_need(raw, "text_vocab_size", where)),
            hidden_size=hidden,
            intermediate_size=int(_need(raw, "intermediate_size", where)),
            num_layers=int(_need(raw, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            thinker_hidden_size=int(raw["thinker_hidden_size"]) if raw.get("thinker_hidden_size") else None,
            voices=voices,
            min_codes_per_token=int(raw.get("min_codes_per_token", 1)),
            max_codes_per_token=int(raw.get("max_codes_per_token", 8)),
            temperature=float(raw.get("temperature", 0.9)),
            top_k=int(raw.get("top_k", 50)),
        )
        if not 0 <= cfg.min_codes_per_token <= cfg.max_codes_per_token or cfg.max_codes_per_token < 1:
            raise SpeechConfigError("config.json: talker_config needs 0 <= min_codes_per_token <= "
                                    "max_codes_per_token, and max_codes_per_token >= 1")
        return cfg


@attrs.frozen
class Code2WavConfig:
    """Codec tokens -> waveform: embeddings, then transposed-convolution upsampling to samples.

    Each upsampling stage multiplies the length by its rate exactly, so one code
    becomes ``hop_length`` = product of ``upsample_rates`` samples.
    """

    codebook_size: int
    channels: tuple[int, ...]  # len(upsample_rates) + 1 widths, from the embedding to the last stage
    upsample_rates: tuple[int, ...]
    sample_rate: int = SAMPLE_RATE

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsample_rates)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Code2WavConfig:
        where = "code2wav_config"
        rates = tuple(int(r) for r in _need(raw, "upsample_rates", where))
        channels = tuple(int(c) for c in _need(raw, "channels", where))
        sample_rate = int(raw.get("sample_rate", SAMPLE_RATE))
        if not rates or any(r < 2 for r in rates):
            raise SpeechConfigError("config.json: code2wav_config.upsample_rates must be integers >= 2")
        if len(channels) != len(rates) + 1 or any(c < 1 for c in channels):
            raise SpeechConfigError("config.json: code2wav_config.channels needs one width more than "
                                    "upsample_rates")
        if sample_rate != SAMPLE_RATE:
            raise SpeechConfigError(f"config.json: code2wav_config.sample_rate must be {SAMPLE_RATE}")
        return cls(codebook_size=int(_need(raw, "codebook_size", where)), channels=channels,
                   upsample_rates=rates, sample_rate=sample_rate)


@attrs.frozen
class SpeechConfig:
    """A whole checkpoint: the Thinker (None for standalone TTS), the Talker and the decoder."""

    thinker: TextModelConfig | None
    talker: TalkerConfig
    code2wav: Code2WavConfig

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SpeechConfig:
        for key in ("talker_config", "code2wav_config"):
            if not isinstance(raw.get(key), Mapping):
                raise SpeechConfigError(f"config.json has no {key} section: this is not a speech checkpoint")
        thinker = None
        if raw.get("thinker_config") is not None:
            try:
                thinker = TextModelConfig.from_hf_config(raw["thinker_config"])
            except (KeyError, ValueError, NotImplementedError) as exc:
                raise SpeechConfigError(f"config.json: thinker_config: {exc}") from exc
        talker = TalkerConfig.from_dict(raw["talker_config"])
        code2wav = Code2WavConfig.from_dict(raw["code2wav_config"])
        if code2wav.codebook_size != talker.codebook_size:
            raise SpeechConfigError("config.json: talker_config and code2wav_config disagree on codebook_size")
        if thinker is not None:
            if talker.thinker_hidden_size not in (None, thinker.hidden_size):
                raise SpeechConfigError("config.json: talker_config.thinker_hidden_size differs from the "
                                        "Thinker's hidden_size")
            if talker.text_vocab_size != thinker.vocab_size:
                raise SpeechConfigError("config.json: talker_config.text_vocab_size differs from the "
                                        "Thinker's vocab_size")
        return cls(thinker=thinker, talker=talker, code2wav=code2wav)
