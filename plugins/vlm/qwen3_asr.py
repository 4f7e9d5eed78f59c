"""Qwen3-ASR (``Qwen3ASRForConditionalGeneration``): the Qwen3 audio encoder, a projector, a Qwen3 decoder.

What the processor does to one clip (``Qwen3ASRFeatureExtractor``): the clip
zero-padded to ``min_length`` samples, Whisper's log-mel features of it
(``hop_length`` samples a frame, none padded to a chunk), the frames
zero-padded to a whole number of encoder chunks (``2 * n_window`` frames), and
``<|audio_pad|>`` expanded into one token per encoder output.

What the model does: the shared layer's Qwen3 audio encoder
(``ifb_plugins.common.media.qwen3_audio``; every chunk convolved at its full
length), whose last two layers the checkpoint names
``multi_modal_projector.linear_1`` / ``linear_2``, into a Qwen3 decoder.

How it transcribes (``Qwen3ASRProcessor.apply_transcription_request``): the
system turn holds the context (the transcription request's ``prompt``), the
user turn the clip alone, and a forced language is prefilled in the assistant
turn as ``language <Name><asr_text>``. Without one the model writes that header
itself; ``read_transcript`` returns the text after it, and the language named.
The original library's clean-up of runaway repetitions is not applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np
import torch

from ifb.params import InvalidRequest
from ifb.transcription import Transcript, Transcription
from ifb_plugins.common.media.mel import log_mel_features
from ifb_plugins.common.media.parts import MediaItem
from ifb_plugins.common.media.qwen3_audio import AudioEncoder, AudioEncoderConfig
from ifb_plugins.vlm.checkpoint import (
    ProcessorFiles, load_module, load_state, load_text_model, load_tokenizer, read_json, special_token_id,
    split_state,
)
from ifb_plugins.vlm.interface import EncodedMedia, Family, LoadedVlm

#: what ends the header the model writes before the transcript (an added token, not a special one)
ASR_TEXT = "<asr_text>"
#: the languages the model was trained to be told, by ISO-639 code, with the names its prompt spells
LANGUAGES = {
    "ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish", "nl": "Dutch",
    "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French", "de": "German", "el": "Greek",
    "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "mk": "Macedonian", "ms": "Malay", "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese",
}


@attrs.frozen
class FeatureExtraction:
    """``Qwen3ASRFeatureExtractor`` settings."""

    num_mel_bins: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    n_window: int = 50
    min_length: int = 8000

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> FeatureExtraction:
        kind = cfg.get("feature_extractor_type", "Qwen3ASRFeatureExtractor")
        if kind != "Qwen3ASRFeatureExtractor":
            raise ValueError(f"feature extractor {kind!r} is not supported (Qwen3ASRFeatureExtractor)")
        if float(cfg.get("dither", 0.0)) != 0.0:
            raise ValueError("dithered features are not supported (deterministic features only)")
        base = cls()
        return cls(num_mel_bins=int(cfg.get("feature_size", base.num_mel_bins)),
                   sampling_rate=int(cfg.get("sampling_rate", base.sampling_rate)),
                   hop_length=int(cfg.get("hop_length", base.hop_length)), n_fft=int(cfg.get("n_fft", base.n_fft)),
                   n_window=int(cfg.get("n_window", base.n_window)),
                   min_length=int(cfg.get("min_length", base.min_length)))

    def features(self, audio: np.ndarray) -> np.ndarray:
        """Log-mel frames ``[M, F]`` of one clip, ``F = max(len, min_length) // hop_length``."""
        # the reference pads short clips and counts the padding as audio (its frames are not masked)
        num_samples = max(audio.size, self.min_length, self.hop_length)
        return log_mel_features(audio, self.num_mel_bins, num_samples=num_samples, n_fft=self.n_fft,
                                hop_length=self.hop_length, sampling_rate=self.sampling_rate)


@attrs.define
class Qwen3AsrEncoder:
    model: AudioEncoder
    features: FeatureExtraction
    placeholder_id: int
    device: torch.device

    @property
    def sampling_rate(self) -> int:
        return self.features.sampling_rate

    @torch.inference_mode()
    def encode(self, item: MediaItem) -> EncodedMedia:
        mel = torch.from_numpy(self.features.features(item.data)).to(self.device)
        embeds = self.model(mel)
        return EncodedMedia(token_ids=(self.placeholder_id,) * embeds.shape[0], embed_token_id=self.placeholder_id,
                            embeds=embeds)


def language_name(language: str) -> str:
    """The name the prompt spells for an ISO-639 code or a name (any case); InvalidRequest for others."""
    wanted = language.strip().lower()
    for code, name in LANGUAGES.items():
        if wanted in (code, name.lower()):
            return name
    raise InvalidRequest(f"this model does not take language {language!r}: give one of "
                         f"{', '.join(sorted(LANGUAGES))} (or its name)", param="language")


class Qwen3AsrTranscription:
    """The forced-language prefill and the ``language <Name><asr_text>`` header read back."""

    def prompt_suffix(self, task: Transcription) -> str:
        if task.translate:
            raise InvalidRequest("this model transcribes in the language spoken; it does not translate")
        return f"language {language_name(task.language)}{ASR_TEXT}" if task.language else ""

    def read(self, text: str, is_final: bool) -> Transcript:
        head, marker, rest = text.partition(ASR_TEXT)
        if marker:
            return Transcript(rest, _header_language(head))
        start = text.lstrip()
        if not is_final and (start.startswith("language ") or "language ".startswith(start)):
            return Transcript("")  # a header may still be coming
        return Transcript(text)


def _header_language(head: str) -> str | None:
    line = next((ln.strip() for ln in head.splitlines() if ln.strip()), "")
    name = line[len("language "):].strip() if line.lower().startswith("language ") else line
    return None if name.lower() in ("", "none") else name


def load(path: Path, device: torch.device) -> LoadedVlm:
    cfg = read_json(path, "config.json")
    if "text_config" not in cfg or "audio_config" not in cfg:
        raise ValueError(f"{path}/config.json needs audio_config and text_config")
    audio = AudioEncoderConfig.from_dict(cfg["audio_config"])
    files = ProcessorFiles.read(path)
    features = FeatureExtraction.from_hf(files.feature_extractor)
    if (features.num_mel_bins, features.n_window) != (audio.num_mel_bins, audio.n_window):
        raise ValueError(f"the feature extractor (feature_size {features.num_mel_bins}, n_window "
                         f"{features.n_window}) does not match the encoder ({audio.num_mel_bins}, {audio.n_window})")
    # the generation config stops at the outer config's end tokens as well as the decoder's
    eos = [e for key in ("text_config", None) for e in _ids((cfg[key] if key else cfg).get("eos_token_id"))]
    tokenizer = load_tokenizer(path, {**cfg["text_config"], "eos_token_id": eos}, files.processor)
    audio_token_id = special_token_id(tokenizer, int(cfg.get("audio_token_id", 151676)), "audio_token_id")
    parts = split_state(load_state(path), {"audio": ("model.audio_tower.", "audio_tower."),
                                           "projector": ("model.multi_modal_projector.", "multi_modal_projector.")},
                        str(path))
    text_model = load_text_model(cfg["text_config"], parts["text"], tokenizer, path, device,
                                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if audio.output_dim != text_model.config.hidden_size:
        raise ValueError(f"audio_config.output_dim {audio.output_dim} is not the decoder's hidden size "
                         f"{text_model.config.hidden_size}")
    projector = {"linear_1": "proj1", "linear_2": "proj2"}
    state = {**parts["audio"], **{projector.get(k.split(".")[0], k.split(".")[0]) + k[k.index("."):]: v
                                  for k, v in parts["projector"].items()}}
    with torch.device("meta"):
        encoder = AudioEncoder(audio, pad_to_whole_chunks=True)
    encoder = load_module(encoder, state, f"{path} (audio tower and projector)", device)
    return LoadedVlm("qwen3_asr", text_model, tokenizer,
                     {"audio": Qwen3AsrEncoder(encoder, features, audio_token_id, device)},
                     transcription=Qwen3AsrTranscription())


def _ids(value: Any) -> list[int]:
    return [int(v) for v in (value if isinstance(value, list) else [value] if value is not None else [])]


FAMILY = Family(name="qwen3_asr", architectures=("Qwen3ASRForConditionalGeneration",), load=load,
                model_types=("qwen3_asr",))
