"""Speech runtimes: the Omni bundle (Thinker + Talker + decoder) and the standalone TTS model.

``OmniRuntime`` is a text runtime (the Thinker) that the engine serves under
in-flight batching like any other; on the blocking path its
``handle_request`` also speaks. ``TtsRuntime`` has no Thinker and no stepped
execution: each request is one utterance, start to finish.

Speech reaches the caller on the final ``RequestOutput`` as
``extras["audio"]`` (OpenAI's ``message.audio``: id, base64 data, expires_at,
transcript) and ``extras["speech"]`` (the raw container bytes and how to read
them); docs/plugins/speech.md is the contract.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import attrs
import torch

from ifb.blocking import drive_alone
from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.outputs import RequestOutput
from ifb.params import InvalidRequest, RequestSpec
from ifb.request import Request
from ifb.runtime import Prepared
from ifb_plugins.speech import SPEAK_PROMPT, audio
from ifb_plugins.speech.audio import AudioSettings
from ifb_plugins.speech.code2wav import Code2Wav
from ifb_plugins.speech.config import SpeechConfig
from ifb_plugins.speech.talker import Talker
from ifb_plugins.common.attention import build_attn_metadata
from ifb_plugins.common.runtime import KV_BLOCK_SIZE, TextRuntime
from ifb_plugins.common.tokenizer import TextTokenizer

#: the longest text (in tokens) a TTS request may ask to speak; long text is spoken in segments
MAX_TTS_INPUT_TOKENS = 4096


@attrs.frozen
class Speech:
    """One utterance: the codec tokens it came from and its encoded container."""

    codes: tuple[int, ...]
    data: bytes
    format: str
    sample_rate: int
    voice: str
    num_samples: int

    def extras(self, transcript: str) -> dict[str, Any]:
        """What the final ``RequestOutput`` carries (see docs/plugins/speech.md)."""
        return {
            "audio": audio.chat_audio(self.data, transcript),
            "speech": {"format": self.format, "data": self.data, "sample_rate": self.sample_rate,
                       "voice": self.voice, "num_codes": len(self.codes), "num_samples": self.num_samples},
        }


class Speaker:
    """The Talker and the code-to-waveform decoder: text tokens in, an encoded waveform out."""

    def __init__(self, talker: Talker, code2wav: Code2Wav, config: SpeechConfig):
        self.talker = talker
        self.code2wav = code2wav
        self.config = config

    @property
    def voices(self) -> tuple[str, ...]:
        return self.config.talker.voices

    def speak(self, text_ids: Sequence[int], settings: AudioSettings, *,
              thinker_hidden: torch.Tensor | None = None, seed: int = 0) -> Speech:
        voice = self.voices.index(settings.voice)
        codes = self.talker.generate_codes(text_ids, voice, thinker_hidden=thinker_hidden, seed=seed)
        codes = audio.change_speed(codes, settings.speed)
        waveform = self.code2wav(torch.tensor(codes, dtype=torch.long))
        rate = self.config.code2wav.sample_rate
        return Speech(codes=tuple(codes), data=audio.encode(waveform, settings.format, rate), format=settings.format,
                      sample_rate=rate, voice=settings.voice, num_samples=int(waveform.shape[0]))


def count_parameters(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _speech_ids(tokenizer: TextTokenizer, spec: RequestSpec) -> tuple[int, ...]:
    if spec.prompt is None:
        raise InvalidRequest("speech is made from text: send the text to speak as the prompt (input)")
    ids = tokenizer.encode(spec.prompt, add_special_tokens=False)
    if not ids:
        raise InvalidRequest("the text to speak is empty")
    return tuple(ids)


def _check_single(spec: RequestSpec) -> None:
    if spec.params.n != 1:
        raise InvalidRequest("audio output is made for one sequence per request: n must be 1")


def _seed(spec: RequestSpec) -> int:
    return spec.params.seed if spec.params.seed is not None else 0


class OmniRuntime(TextRuntime):
    """The Thinker as a text runtime, plus the ``Speaker`` (None under in-flight batching)."""

    def __init__(self, *, speech_config: SpeechConfig, speaker: Speaker | None, **text_runtime: Any):
        super().__init__(**text_runtime)
        self.speech_config = speech_config
        self.speaker = speaker

    @property
    def talker(self) -> Talker | None:
        return None if self.speaker is None else self.speaker.talker

    @property
    def code2wav(self) -> Code2Wav | None:
        return None if self.speaker is None else self.speaker.code2wav

    def num_parameters(self) -> dict[str, int]:
        return {"thinker": count_parameters(self.model), "talker": count_parameters(self.talker),
                "code2wav": count_parameters(self.code2wav)}

    def prepare(self, spec: RequestSpec) -> Prepared:
        if not spec.extras.get("generate_audio"):
            if spec.extras.get(SPEAK_PROMPT):
                raise InvalidRequest(f"{SPEAK_PROMPT} needs generate_audio")
            return super().prepare(spec)
        if self.speaker is None:
            # The engine rejects generate_audio under the flag before this; reaching here is a bug.
            raise InvalidRequest("the speech engines are not loaded (--enable-in-flight-batching)")
        AudioSettings.from_extras(spec.extras, self.speaker.voices)
        _check_single(spec)
        if spec.extras.get(SPEAK_PROMPT):
            return Prepared(_speech_ids(self.tokenizer, spec))
        return super().prepare(spec)

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[Any]:
        if not spec.extras.get("generate_audio"):
            yield from super().handle_request(spec, request)
            return
        assert self.speaker is not None  # prepare() refused the request otherwise
        settings = AudioSettings.from_extras(spec.extras, self.speaker.voices)
        if spec.extras.get(SPEAK_PROMPT):
            ids = list(request.prompt_token_ids)
            speech = self.speaker.speak(ids, settings, thinker_hidden=self.thinker_hidden(ids), seed=_seed(spec))
            yield RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                                finish_reason="stop", num_prompt_tokens=len(ids),
                                extras=speech.extras(spec.prompt or ""))
            return
        if spec.extras.get("save_system_prompt_kv_cache"):
            self.system_prompts.capture(spec, request.prompt_token_ids)
        texts: list[str] = []
        with self.lora.active(spec.extras.get("lora")):
            for out in drive_alone(self, request, blocks=self._blocking_blocks, prefix=self.system_prompts):
                texts.append(out.text)
                if out.finished and out.finish_reason in ("stop", "length"):
                    out = attrs.evolve(out, extras={**out.extras, **self._speak_reply(
                        request.prompt_token_ids, "".join(texts), settings, _seed(spec))})
                yield out

    def _speak_reply(self, prompt_ids: Sequence[int], transcript: str, settings: AudioSettings,
                     seed: int) -> dict[str, Any]:
        """Speak the reply, conditioned on its tokens and the Thinker's hidden states in context."""
        assert self.speaker is not None
        ids = self.tokenizer.encode(transcript, add_special_tokens=False)
        # Re-tokenizing the reply may not give back exactly the generated ids: keep the context within
        # the KV cache by dropping the oldest prompt tokens if it would not fit.
        room = max(0, self.num_kv_blocks * self.kv_block_size - len(ids))
        context = list(prompt_ids)[max(0, len(prompt_ids) - room):]
        hidden = self.thinker_hidden([*context, *ids])[len(context):] if ids else None
        return self.speaker.speak(ids, settings, thinker_hidden=hidden, seed=seed).extras(transcript)

    @torch.inference_mode()
    def thinker_hidden(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The Thinker's final hidden states ``[len(token_ids), H]`` for ``token_ids`` as one context.

        Runs on the blocking path's own KV blocks, which are free between requests.
        """
        blocks = self._blocking_blocks
        block_ids = blocks.allocate(blocks.blocks_for(len(token_ids)))
        try:
            rows = []
            for start in range(0, len(token_ids), 512):
                chunk = list(token_ids[start:start + 512])
                attn = build_attn_metadata([(start, len(chunk), block_ids)], KV_BLOCK_SIZE, self.device)
                ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
                pos = torch.arange(start, start + len(chunk), device=self.device)
                rows.append(self.model(ids, pos, attn, self.kv_caches))
            return torch.cat(rows)
        finally:
            blocks.free(block_ids)


class TtsRuntime:
    """A standalone TTS model: each request's prompt is spoken in one ``handle_request`` call.

    There is no stepped execution (no ``execute``); the KV fields only bound the
    input length the engine accepts.
    """

    kv_block_size = KV_BLOCK_SIZE

    def __init__(self, *, speaker: Speaker, tokenizer: TextTokenizer, caps: DeploymentCaps,
                 config: DeployConfig, model_name: str):
        self.speaker = speaker
        self.tokenizer = tokenizer
        self.caps = caps
        self.model_name = model_name
        self.max_model_len = MAX_TTS_INPUT_TOKENS + 1
        self.num_kv_blocks = -(-self.max_model_len // KV_BLOCK_SIZE)

    @property
    def speech_config(self) -> SpeechConfig:
        return self.speaker.config

    @property
    def talker(self) -> Talker:
        return self.speaker.talker

    @property
    def code2wav(self) -> Code2Wav:
        return self.speaker.code2wav

    def num_parameters(self) -> dict[str, int]:
        return {"thinker": 0, "talker": count_parameters(self.talker), "code2wav": count_parameters(self.code2wav)}

    def prepare(self, spec: RequestSpec) -> Prepared:
        AudioSettings.from_extras(spec.extras, self.speaker.voices)
        _check_single(spec)
        return Prepared(_speech_ids(self.tokenizer, spec))

    def release(self, request_id: str, seat: int) -> None:
        pass

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[Any]:
        settings = AudioSettings.from_extras(spec.extras, self.speaker.voices)
        ids = list(request.prompt_token_ids)
        speech = self.speaker.speak(ids, settings, seed=_seed(spec))
        yield RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                            finish_reason="stop", num_prompt_tokens=len(ids), extras=speech.extras(spec.prompt or ""))
