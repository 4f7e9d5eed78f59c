"""The standalone Qwen3-TTS runtime: one utterance per ``handle_request`` (the blocking path).

Request side (``RequestSpec``): ``prompt`` is the text to speak; ``extras["audio"]``
holds ``voice`` (a speaker of a CustomVoice model), ``instructions``,
``language``, ``format`` (wav, pcm, mp3, flac, opus), ``speed`` and ``stream``;
``params.seed`` seeds the sampling (``params.temperature == 0``: greedy).

Response side: with ``stream`` every decoded span arrives as a non-final
``RequestOutput`` with ``audio_chunk`` (bytes of the container, in order); the
final output carries ``audio`` (an ``ifb.outputs.AudioOutput``, see
docs/plugins/speech.md), whose ``data`` is the whole file when not streaming
and empty when it was streamed.
"""

from __future__ import annotations

from typing import Any, Iterator

import attrs

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.outputs import AudioOutput, RequestOutput
from ifb.params import InvalidRequest, RequestSpec
from ifb.request import Request
from ifb.runtime import Prepared
from ifb_plugins.speech import audio
from ifb_plugins.speech.tts import TtsSpeaker, Utterance

#: the longest text (in tokens) a request may ask to speak
MAX_INPUT_TOKENS = 4096
#: while streaming, frames decoded per piece (12 frames: about one second at 12 Hz)
STREAM_FRAMES = 12
KV_BLOCK_SIZE = 16


@attrs.frozen
class SpeechRequest:
    """A request's validated speech settings."""

    utterance: Utterance
    format: str
    speed: float
    stream: bool
    greedy: bool
    seed: int | None


class TtsRuntime:
    """A Qwen3-TTS model on the blocking path: there is no stepped execution (no ``execute``)."""

    kv_block_size = KV_BLOCK_SIZE
    #: frames decoded per streamed piece
    stream_frames = STREAM_FRAMES

    def __init__(self, *, speaker: TtsSpeaker, caps: DeploymentCaps, config: DeployConfig, model_name: str):
        self.speaker = speaker
        self.tokenizer = speaker.tokenizer
        self.caps = caps
        self.model_name = model_name
        # only bounds the input length the engine accepts
        self.max_model_len = MAX_INPUT_TOKENS + 1
        self.num_kv_blocks = -(-self.max_model_len // KV_BLOCK_SIZE)

    @property
    def voices(self) -> tuple[str, ...]:
        return self.speaker.config.speakers

    def num_parameters(self) -> dict[str, int]:
        return {"talker": sum(p.numel() for p in self.speaker.model.parameters()),
                "codec": sum(p.numel() for p in self.speaker.codec.parameters())}

    def speech_request(self, spec: RequestSpec) -> SpeechRequest:
        if spec.prompt is None:
            raise InvalidRequest("speech is made from text: send the text to speak as the prompt (input)")
        if spec.params.n != 1:
            raise InvalidRequest("one utterance per request: n must be 1")
        raw = spec.extras.get("audio") or {}
        if not isinstance(raw, dict):
            raise InvalidRequest("audio must be an object (voice, instructions, language, format, speed, stream)")
        utt = self.speaker.utterance(spec.prompt, raw.get("voice"), raw.get("instructions"), raw.get("language"))
        return SpeechRequest(utt, audio.check_format(raw.get("format") or "wav"), audio.check_speed(raw.get("speed")),
                             bool(raw.get("stream")), spec.params.temperature == 0, spec.params.seed)

    def prepare(self, spec: RequestSpec) -> Prepared:
        req = self.speech_request(spec)
        ids = self.tokenizer.encode(req.utterance.text, add_special_tokens=False)
        if len(ids) > MAX_INPUT_TOKENS:
            raise InvalidRequest(f"the text is {len(ids)} tokens; at most {MAX_INPUT_TOKENS} are spoken at once")
        return Prepared(tuple(ids) or (0,))

    def release(self, request_id: str, seat: int) -> None:
        pass

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[Any]:
        req = self.speech_request(spec)
        rate = self.speaker.sample_rate
        frames = []
        encoder = audio.StreamEncoder(req.format, rate) if req.stream else None
        sent = 0  # frames whose samples were streamed
        num_samples = 0

        def chunk(data: bytes) -> RequestOutput:
            return RequestOutput(request_id=request.request_id, text="", token_ids=(), audio_chunk=data)

        for frame in self.speaker.frames(req.utterance, seed=req.seed, greedy=req.greedy):
            if request.handle.cancelled.is_set():
                yield RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                                    finish_reason="cancelled")
                return
            frames.append(frame)
            if encoder is not None and len(frames) - sent >= self.stream_frames:
                samples = self.speaker.decode_range(frames, sent, req.speed)
                sent, num_samples = len(frames), num_samples + samples.shape[0]
                yield chunk(encoder.feed(samples))
        if encoder is not None:
            tail = b""
            if len(frames) > sent:
                samples = self.speaker.decode_range(frames, sent, req.speed)
                num_samples += samples.shape[0]
                tail = encoder.feed(samples)
            yield chunk(tail + encoder.finish())
            data = b""
        else:
            samples = self.speaker.decode(frames, req.speed)
            num_samples = samples.shape[0]
            data = audio.encode(samples, req.format, rate)
        speech = AudioOutput(format=req.format, data=data, sample_rate=rate, voice=req.utterance.speaker,
                        num_frames=len(frames), num_samples=num_samples, is_streamed=req.stream)
        yield RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                            finish_reason="stop", num_prompt_tokens=len(request.prompt_token_ids),
                            num_output_tokens=len(frames), audio=speech)
