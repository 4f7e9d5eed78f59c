"""Qwen3-TTS end to end: the request's text, voice, instruction and language -> codec frames -> samples.

``load_tts(path)`` reads a checkpoint directory (see ``tts_config``); only
``talker.*`` of ``model.safetensors`` and ``decoder.*`` of the speech
tokenizer are read. ``TtsSpeaker.frames`` yields codec frames as the talker
makes them; ``decode`` turns frames into samples (whole, or a span at a time
while streaming).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import attrs
import numpy as np
import torch

from ifb.params import InvalidRequest
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.speech.codec_decoder import CodecDecoder
from ifb_plugins.speech.text_tokenizer import load_text_tokenizer
from ifb_plugins.speech.tts_config import TtsConfig, read_tts_config
from ifb_plugins.speech.tts_model import Sampling, TtsModel
from ifb_plugins.speech.weights import adopt, load_prefixed


@attrs.frozen
class Utterance:
    """What one request asks to be said, validated against the model."""

    text: str
    speaker: str | None  # lower case, one of the model's speakers (CustomVoice); None for VoiceDesign
    instructions: str | None
    language: str  # "auto" or one of the model's languages, lower case


def assistant_text(text: str) -> str:
    """The reference's template for the text to speak."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instructions: str) -> str:
    return f"<|im_start|>user\n{instructions}<|im_end|>\n"


class TtsSpeaker:
    """A loaded Qwen3-TTS model: talker + code predictor, the 12 Hz codec decoder, the text tokenizer."""

    def __init__(self, config: TtsConfig, model: TtsModel, codec: CodecDecoder, tokenizer: TextTokenizer):
        self.config = config
        self.model = model
        self.codec = codec
        self.tokenizer = tokenizer

    @property
    def sample_rate(self) -> int:
        return self.config.codec.sample_rate

    def utterance(self, text: str, voice: str | None, instructions: str | None, language: str | None) -> Utterance:
        """Check a request's inputs; InvalidRequest names what is wrong."""
        cfg = self.config
        if not text or not text.strip():
            raise InvalidRequest("the text to speak is empty")
        speakers = cfg.speakers
        if cfg.model_type == "custom_voice":
            speaker = (voice or speakers[0]).lower()
            if speaker not in speakers:
                raise InvalidRequest(f"unknown voice {voice!r}; this model's voices: {', '.join(speakers)}")
        else:
            if voice:
                raise InvalidRequest("this is a VoiceDesign model: it has no named voices; describe the voice "
                                     "in instructions instead")
            speaker = None
            if not instructions:
                raise InvalidRequest("this is a VoiceDesign model: describe the voice in instructions")
        if instructions and not cfg.takes_instructions:
            raise InvalidRequest("this model (0.6B CustomVoice) does not take instructions")
        lang = (language or "auto").lower()
        if lang not in cfg.talker.languages:
            raise InvalidRequest(f"unknown language {language!r}; this model's languages: "
                                 f"{', '.join(cfg.talker.languages)}")
        return Utterance(text, speaker, instructions or None, lang)

    def token_ids(self, utt: Utterance) -> tuple[list[int], list[int] | None]:
        text_ids = self.tokenizer.encode(assistant_text(utt.text))
        instruct_ids = self.tokenizer.encode(instruct_text(utt.instructions)) if utt.instructions else None
        return text_ids, instruct_ids

    def frames(self, utt: Utterance, *, seed: int | None = None, greedy: bool = False,
               max_new_tokens: int | None = None) -> Iterator[torch.Tensor]:
        """Codec frames ``[G]`` as the talker makes them (the checkpoint's sampling defaults unless ``greedy``)."""
        g = self.config.generate
        text_ids, instruct_ids = self.token_ids(utt)
        prompt = self.model.prompt(text_ids, instruct_ids, utt.speaker, utt.language)
        sampling = Sampling(g.do_sample and not greedy, g.top_k, g.top_p, g.temperature)
        sub = Sampling(g.subtalker_dosample and not greedy, g.subtalker_top_k, g.subtalker_top_p,
                       g.subtalker_temperature)
        yield from self.model.generate(prompt, max_new_tokens=max_new_tokens or g.max_new_tokens, sampling=sampling,
                                       sub_sampling=sub, repetition_penalty=g.repetition_penalty, seed=seed)

    def decode(self, frames: Sequence[torch.Tensor], speed: float = 1.0) -> np.ndarray:
        """All samples of ``frames`` (float32 in [-1, 1]), decoded as the reference decodes."""
        if not frames:
            return np.zeros(0, dtype=np.float32)
        codes = torch.stack(list(frames)).T[None]  # [1, G, T]
        wav = self.codec.chunked_decode(codes, speed=speed)[0, 0]
        if speed == 1.0:  # the reference keeps exactly decode_upsample_rate samples a frame
            wav = wav[:len(frames) * self.config.samples_per_frame]
        return wav.float().numpy()

    def decode_range(self, frames: Sequence[torch.Tensor], start: int, speed: float = 1.0) -> np.ndarray:
        """The samples of ``frames[start:]``, the same as ``decode(frames)`` has them (streaming)."""
        codes = torch.stack(list(frames)).T[None]
        return self.codec.decode_range(codes, start, codes.shape[-1], speed=speed)[0, 0].float().numpy()


def load_tts(path: str | Path) -> TtsSpeaker:
    """Load a Qwen3-TTS CustomVoice or VoiceDesign checkpoint directory (float32, CPU)."""
    path = Path(path)
    config = read_tts_config(path)
    tokenizer = load_text_tokenizer(path)
    talker = {f"talker.{name}": t for name, t in load_prefixed(path, "talker.").items()}
    model = adopt(lambda: TtsModel(config), talker, "talker")
    codec = adopt(lambda: CodecDecoder(config.codec), load_prefixed(path / "speech_tokenizer", "decoder."),
                  "speech_tokenizer decoder")
    return TtsSpeaker(config, model, codec, tokenizer)
