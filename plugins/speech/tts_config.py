"""A Qwen3-TTS checkpoint's description (``config.json`` model_type ``qwen3_tts``), as frozen data.

The layout of the published checkpoints (and of what Qwen's ``qwen-tts``
package reads): ``config.json`` (the model: a talker with its code predictor),
``generation_config.json`` (sampling defaults), ``model.safetensors``
(``talker.*``), the text tokenizer, and ``speech_tokenizer/`` (the 12 Hz codec:
``config.json``, ``model.safetensors`` whose ``decoder.*`` turns codes into
24 kHz audio).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import attrs

from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.speech.codec_decoder import CodecDecoderConfig

MODEL_TYPE = "qwen3_tts"
SPEECH_TOKENIZER_TYPE = "qwen3_tts_tokenizer_12hz"
#: model types this plugin speaks with: a named speaker (custom_voice) or a described voice (voice_design)
SERVED_MODEL_TYPES = ("custom_voice", "voice_design")
#: the reference's fallbacks for what generation_config.json does not set
HARD_DEFAULTS = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
                 "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                 "subtalker_temperature": 0.9, "max_new_tokens": 2048}


class TtsConfigError(ValueError):
    """The directory is not a Qwen3-TTS checkpoint this plugin serves."""


def _decoder(raw: Mapping[str, Any], where: str) -> TextModelConfig:
    if raw.get("use_sliding_window"):
        raise TtsConfigError(f"config.json: {where} uses sliding-window attention, which is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise TtsConfigError(f"config.json: {where}.hidden_act {raw['hidden_act']!r} is not supported (silu)")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return TextModelConfig(
        arch="qwen3", vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), attention_bias=bool(raw.get("attention_bias", False)),
        attention_out_bias=bool(raw.get("attention_bias", False)), qk_norm=True,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)))


@attrs.frozen
class TalkerConfig:
    """The talker (first codebook) and code predictor (the other ``num_code_groups - 1``) and their ids."""

    decoder: TextModelConfig  # over the codec vocabulary
    predictor: TextModelConfig  # over one codebook
    num_code_groups: int
    text_vocab_size: int
    text_hidden_size: int
    codec_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    #: speaker name (lower case) -> its codec id, in the config's order
    speaker_ids: Mapping[str, int]
    #: speaker name -> the dialect (a language key) it speaks, for those that do
    speaker_dialects: Mapping[str, str]
    #: language name (lower case) -> its codec id
    language_ids: Mapping[str, int]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TalkerConfig:
        predictor = raw.get("code_predictor_config") or {}
        groups = int(raw.get("num_code_groups", 32))
        if int(predictor.get("num_code_groups", groups)) != groups:
            raise TtsConfigError("config.json: talker and code predictor disagree on num_code_groups")
        dialects = {k.lower(): v for k, v in (raw.get("spk_is_dialect") or {}).items() if v}
        return cls(
            decoder=_decoder(raw, "talker_config"), predictor=_decoder(predictor, "code_predictor_config"),
            num_code_groups=groups, text_vocab_size=int(raw["text_vocab_size"]),
            text_hidden_size=int(raw["text_hidden_size"]), codec_eos_id=int(raw["codec_eos_token_id"]),
            codec_pad_id=int(raw["codec_pad_id"]), codec_bos_id=int(raw["codec_bos_id"]),
            codec_think_id=int(raw["codec_think_id"]), codec_nothink_id=int(raw["codec_nothink_id"]),
            codec_think_bos_id=int(raw["codec_think_bos_id"]), codec_think_eos_id=int(raw["codec_think_eos_id"]),
            speaker_ids={k.lower(): int(v) for k, v in (raw.get("spk_id") or {}).items()},
            speaker_dialects=dialects,
            language_ids={k.lower(): int(v) for k, v in (raw.get("codec_language_id") or {}).items()})

    @property
    def languages(self) -> tuple[str, ...]:
        """What a request may name: ``auto`` and the config's languages (dialects are chosen by speaker)."""
        return ("auto", *(k for k in self.language_ids if "dialect" not in k))


@attrs.frozen
class GenerateDefaults:
    """Sampling of the first codebook (talker) and of the others (``subtalker_*``, the code predictor)."""

    do_sample: bool
    top_k: int
    top_p: float
    temperature: float
    repetition_penalty: float
    subtalker_dosample: bool
    subtalker_top_k: int
    subtalker_top_p: float
    subtalker_temperature: float
    max_new_tokens: int

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GenerateDefaults:
        merged = {**HARD_DEFAULTS, **{k: v for k, v in raw.items() if k in HARD_DEFAULTS}}
        return cls(**merged)


@attrs.frozen
class TtsConfig:
    model_type: str  # custom_voice, voice_design
    model_size: str
    talker: TalkerConfig
    codec: CodecDecoderConfig
    #: samples per codec frame, as the speech tokenizer states it (decode_upsample_rate)
    samples_per_frame: int
    generate: GenerateDefaults
    tts_bos_id: int
    tts_eos_id: int
    tts_pad_id: int

    @property
    def speakers(self) -> tuple[str, ...]:
        return tuple(self.talker.speaker_ids)

    @property
    def takes_instructions(self) -> bool:
        # The reference drops the instruction of its 0.6B CustomVoice model; here such a request is refused.
        return not (self.model_type == "custom_voice" and self.model_size in "0b6")


def read_tts_config(path: str | Path) -> TtsConfig:
    """Read a Qwen3-TTS checkpoint directory's configs (no weights); TtsConfigError says what does not fit."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (config.json is missing)")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise TtsConfigError(f"{path}: model_type {raw.get('model_type')!r} is not a Qwen3-TTS checkpoint "
                             f"({MODEL_TYPE!r})")
    model_type = raw.get("tts_model_type")
    if model_type == "base":
        raise TtsConfigError(f"{path} is a Qwen3-TTS Base model, which speaks by cloning a reference recording; "
                             "this deployment takes text only (serve a CustomVoice or VoiceDesign model)")
    if model_type not in SERVED_MODEL_TYPES:
        raise TtsConfigError(f"{path}: tts_model_type {model_type!r} is not one of {', '.join(SERVED_MODEL_TYPES)}")
    if raw.get("tokenizer_type", SPEECH_TOKENIZER_TYPE) != SPEECH_TOKENIZER_TYPE:
        raise TtsConfigError(f"{path}: speech tokenizer {raw.get('tokenizer_type')!r} is not supported "
                             f"({SPEECH_TOKENIZER_TYPE})")
    st_file = path / "speech_tokenizer" / "config.json"
    if not st_file.exists():
        raise FileNotFoundError(f"{path} has no speech_tokenizer/config.json (the 12 Hz codec that makes the audio)")
    st = json.loads(st_file.read_text())
    if st.get("model_type", SPEECH_TOKENIZER_TYPE) != SPEECH_TOKENIZER_TYPE:
        raise TtsConfigError(f"{st_file}: model_type {st.get('model_type')!r} is not {SPEECH_TOKENIZER_TYPE}")
    codec = CodecDecoderConfig.from_dict(st.get("decoder_config") or {}, "tts12hz",
                                         sample_rate=int(st.get("output_sample_rate", 24000)))
    talker = TalkerConfig.from_dict(raw["talker_config"])
    if codec.num_quantizers != talker.num_code_groups:
        raise TtsConfigError(f"the talker makes {talker.num_code_groups} codes a frame but the speech tokenizer "
                             f"decodes {codec.num_quantizers}")
    gen_file = path / "generation_config.json"
    generate = GenerateDefaults.from_dict(json.loads(gen_file.read_text()) if gen_file.exists() else {})
    return TtsConfig(
        model_type=model_type, model_size=str(raw.get("tts_model_size") or ""), talker=talker, codec=codec,
        samples_per_frame=int(st.get("decode_upsample_rate", codec.samples_per_frame)), generate=generate,
        tts_bos_id=int(raw["tts_bos_token_id"]), tts_eos_id=int(raw["tts_eos_token_id"]),
        tts_pad_id=int(raw["tts_pad_token_id"]))
