"""The Qwen3-Omni runtime: the Thinker served by the engine, and on the blocking path the Talker and Code2Wav.

The Thinker's text decoder (``thinker.model.*``, ``thinker.lm_head``) is the
shared ``TextModel`` with ``moe.SparseMoE`` layers and DeepStack
(``common.deepstack``), over M-RoPE positions (sequential for text and audio,
where M-RoPE is RoPE; an image's from its grid). Its audio encoder
(``omni_audio``) and vision encoder (``omni_vision``) run at admission
(``omni_media``), so a media request joins a running batch. Under in-flight
batching the Talker and Code2Wav are not loaded (their weights never read):
the deployment is text-only.

On the blocking path a request with ``generate_audio`` is spoken: the Thinker
answers (chat) or is given the text to say as its reply (``speak_input``, what
``/v1/audio/speech`` asks), its embeddings and hidden states of the whole
conversation are taken in one pass, the Talker makes the codec frames and
Code2Wav the waveform (decoded whole: its transposed convolutions look a frame
ahead, so it is not streamed by pieces).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.options import has_media
from ifb.outputs import AudioOutput, RequestOutput
from ifb.params import InvalidRequest, RequestSpec
from ifb.request import Request
from ifb.runtime import Prepared, ScheduledStep, Seat
from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.models.deepstack import build_text_model
from ifb_plugins.common.runtime.lora import lora_set, prefixed_names
from ifb_plugins.common.media.prompt import media_step_positions, splice_embeddings
from ifb_plugins.common.models.decoder import rope_table
from ifb_plugins.common.layers.moe import fuse_expert_state
from ifb_plugins.common.models.decoder import allocate_kv_cache
from ifb_plugins.common.runtime.text import KV_BLOCK_SIZE, TextRequestState, TextRuntime
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.speech import audio
from ifb_plugins.speech.omni import load_code2wav, read_omni_config
from ifb_plugins.common.media.qwen3_audio import AudioEncoder
from ifb_plugins.speech.omni_audio import FeatureConfig, load_audio_encoder
from ifb_plugins.speech.omni_media import prepare_media
from ifb_plugins.speech.omni_vision import OmniImageEncoder, load_image_encoder
from ifb_plugins.speech.omni_talker import OmniTalker, ThinkerStates, load_talker
from ifb_plugins.speech.tts_model import Sampling
from ifb_plugins.speech.weights import load_prefixed

#: the reference's talker and code-predictor sampling (Qwen3OmniMoeForConditionalGeneration.generate)
TALKER_SAMPLING = Sampling(True, top_k=50, top_p=1.0, temperature=0.9)
PREDICTOR_SAMPLING = Sampling(True, top_k=50, top_p=0.8, temperature=1.0)
REPETITION_PENALTY = 1.05
MAX_FRAMES = 4096
#: how a PEFT adapter names the Thinker's decoder: made on the bundle or on the Thinker, by transformers 5
#: (``language_model``) or as the checkpoint nests it
ADAPTER_PREFIXES = (("thinker.model.language_model.", "model."), ("model.language_model.", "model."),
                    ("thinker.model.layers.", "model.layers."), ("model.layers.", "model.layers."))


@attrs.frozen
class OmniSpeech:
    speaker: str
    format: str
    speed: float
    speak_input: bool
    greedy: bool
    max_frames: int


@attrs.frozen
class OmniRequestState(TextRequestState):
    """A Thinker request's prepared state; ``speech`` when it asked for its answer spoken."""

    speech: OmniSpeech | None = None


def thinker_config(raw: dict[str, Any]) -> TextModelConfig:
    text = dict(raw["thinker_config"]["text_config"])
    text["model_type"] = "qwen3_moe"  # the Thinker's text decoder is a Qwen3-MoE decoder
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    config = TextModelConfig.from_hf_config(text)
    section = rope.get("mrope_section")
    # its rotary interleaves the three position rows over the frequencies (Qwen3-VL's), whatever the flag says
    return attrs.evolve(config, mrope_section=tuple(int(n) for n in section), mrope_interleaved=True) \
        if section else config


def load_thinker(path: Path, raw: dict[str, Any], num_deepstack: int):
    """The text decoder, adding ``num_deepstack`` DeepStack features after its first layers."""
    state = {k: v for k, v in load_prefixed(path, "thinker.").items() if k.startswith(("model.", "lm_head."))}
    return build_text_model(thinker_config(raw), num_deepstack, fuse_expert_state(state), torch.device("cpu"))


class OmniRuntime(TextRuntime):
    """The Thinker as a text runtime, plus the Talker and Code2Wav (None under in-flight batching)."""

    def __init__(self, *, raw_config: dict[str, Any], talker: OmniTalker | None, special_embeds: torch.Tensor | None,
                 code2wav: Any, audio_encoder: AudioEncoder, audio_features: FeatureConfig,
                 image_encoder: OmniImageEncoder, **text_runtime: Any):
        super().__init__(**text_runtime)
        self.raw_config = raw_config
        self.audio_encoder = audio_encoder.to(self.device)
        self.audio_features = audio_features
        self.image_encoder = image_encoder
        image_encoder.tower.to(self.device)
        self.audio_token_id = int(raw_config["thinker_config"]["audio_token_id"])
        self.image_token_id = int(raw_config["thinker_config"]["image_token_id"])
        self.talker = talker
        self.special_embeds = special_embeds
        self.code2wav = code2wav
        talker_cfg = raw_config["talker_config"]
        self.voices = tuple(k.lower() for k in (talker_cfg.get("speaker_id") or {}))
        self.accept_hidden_layer = int(talker_cfg["accept_hidden_layer"])
        self.im_end_id = int(raw_config["im_end_token_id"])
        #: the most codec frames one reply is spoken in (80 ms each); the reference's default is 4096
        self.max_audio_frames = int(text_runtime["config"].options.get("max_audio_frames") or MAX_FRAMES)

    def num_parameters(self) -> dict[str, int]:
        count = lambda m: 0 if m is None else sum(p.numel() for p in m.parameters())  # noqa: E731
        return {"thinker": count(self.model), "audio_encoder": count(self.audio_encoder),
                "vision_encoder": count(self.image_encoder.tower), "talker": count(self.talker),
                "code2wav": count(self.code2wav)}

    def speech_request(self, spec: RequestSpec) -> OmniSpeech:
        if self.talker is None:
            # the engine rejects generate_audio under the flag before this
            raise InvalidRequest("the Talker and Code2Wav are not loaded (--enable-in-flight-batching)")
        if spec.params.n != 1:
            raise InvalidRequest("audio output is made for one sequence per request: n must be 1")
        raw = spec.extras.get("audio") or {}
        voice = (raw.get("voice") or self.voices[0]).lower()
        if voice not in self.voices:
            raise InvalidRequest(f"unknown voice {raw.get('voice')!r}; this model's voices: {', '.join(self.voices)}")
        if raw.get("instructions") or raw.get("language"):
            raise InvalidRequest("Qwen3-Omni takes no instructions or language for its speech")
        return OmniSpeech(voice, audio.check_format(raw.get("format") or "wav"), audio.check_speed(raw.get("speed")),
                          bool(spec.extras.get("speak_input")), spec.params.temperature == 0,
                          min(int(raw.get("max_frames") or self.max_audio_frames), self.max_audio_frames))

    def prepare(self, spec: RequestSpec) -> Prepared:
        if has_media(spec):
            if spec.extras.get("generate_audio"):
                raise InvalidRequest("speech output for a prompt with audio or image input is not built (the "
                                     "Talker's positions for media prompts): ask for text output")
            return prepare_media(self, spec, super().prepare)
        if not spec.extras.get("generate_audio"):
            return super().prepare(spec)
        req = self.speech_request(spec)
        if req.speak_input:
            if not spec.prompt or not spec.prompt.strip():
                raise InvalidRequest("the text to speak is empty")
            ids = self.tokenizer.encode(f"<|im_start|>assistant\n{spec.prompt}<|im_end|>", add_special_tokens=False)
            # the Thinker has nothing to answer: the runtime speaks the given text itself (handle_request)
            return Prepared(tuple(ids), OmniRequestState(speech=req), is_served_whole=True)
        prepared = super().prepare(spec)
        return attrs.evolve(prepared, state=OmniRequestState(**attrs.asdict(prepared.state, recurse=False),
                                                             speech=req))

    def step_positions(self, step: ScheduledStep, seats: list[Seat]) -> torch.Tensor:
        """M-RoPE ids ``[3, T]``: an image prompt's from its grid, every other sequence's its token indices."""
        if self.model.config.mrope_section is None:
            return super().step_positions(step, seats)
        return media_step_positions(step, seats).to(self.device)

    def step_embeddings(self, step: ScheduledStep, seats: list[Seat], input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's token embeddings with its audio and image rows spliced in (None for text alone)."""
        return splice_embeddings(step, seats, input_ids, self.model.model.embed_tokens)

    # ---- speech (the blocking path) ----
    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[RequestOutput]:
        """``speak_input``: the given text spoken as the Thinker's reply (the conversation is that turn alone)."""
        prompt = list(request.prompt_token_ids)
        final = RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                              finish_reason="stop", num_prompt_tokens=len(prompt[:3]))
        yield from self.speak(request.state.speech, spec, final, prompt[:3], prompt, spec.prompt or "",
                              is_answer=False)

    def finish_output(self, request: Request, output: RequestOutput) -> list[RequestOutput]:
        """A chat request that asked for audio: its final output with the answer spoken."""
        speech = getattr(request.state, "speech", None)
        if speech is None:
            return [output]
        prompt = list(request.prompt_token_ids)
        text = self.tokenizer.decode(request.output_token_ids)
        return list(self.speak(speech, request.spec, output, prompt, prompt + request.output_token_ids, text,
                               is_answer=True))

    def speak(self, req: OmniSpeech, spec: RequestSpec, final: RequestOutput, prompt: list[int],
              sequence: list[int], text: str, *, is_answer: bool) -> Iterator[RequestOutput]:
        """``final`` with the speech of ``sequence`` (the conversation, its reply last) added; with a stream
        asked for, the audio goes before it in one chunk (Code2Wav is decoded whole)."""
        states = self.thinker_states(prompt, sequence)
        sampling = Sampling(False) if req.greedy else TALKER_SAMPLING
        sub = Sampling(False) if req.greedy else PREDICTOR_SAMPLING
        frames = list(self.talker.generate(states, req.speaker, max_new_tokens=req.max_frames, sampling=sampling,
                                           sub_sampling=sub, repetition_penalty=REPETITION_PENALTY,
                                           thinker_eos_ids=(self.im_end_id,), seed=spec.params.seed))
        wav = self.code2wav.chunked_decode(torch.stack(frames).T[None], speed=req.speed)[0, 0] if frames \
            else torch.zeros(0)
        data = audio.encode(wav.float().numpy(), req.format, 24000)
        speech = AudioOutput(format=req.format, data=data, sample_rate=24000, voice=req.speaker, num_frames=len(frames),
                        num_samples=int(wav.shape[0]), transcript=text)
        if not is_answer and (spec.extras.get("audio") or {}).get("stream"):
            yield RequestOutput(request_id=final.request_id, text="", token_ids=(), audio_chunk=data)
            speech = attrs.evolve(speech, data=b"", is_streamed=True)
        if is_answer:
            yield attrs.evolve(final, audio=speech)
        else:
            yield attrs.evolve(final, audio=speech, num_output_tokens=len(frames))

    @torch.inference_mode()
    def thinker_states(self, prompt_ids: Sequence[int], sequence_ids: Sequence[int]) -> ThinkerStates:
        """The Thinker's input embeddings and hidden states at the Talker's layer, for all but the last token."""
        ids = list(sequence_ids[:-1])
        cfg = self.model.config
        # a KV cache of its own for this one pass: the engine's blocks stay the engine's
        num_blocks = -(-len(ids) // KV_BLOCK_SIZE)
        scratch = allocate_kv_cache(cfg, num_blocks, KV_BLOCK_SIZE, dtype=self.kv_caches[0][0].dtype,
                                    device=self.device)
        attn = build_attn_metadata([(0, len(ids), list(range(num_blocks)))], KV_BLOCK_SIZE, self.device)
        cs = rope_table(cfg, self.model.inv_freq, len(ids))
        cos, sin = cs[:, 0:1], cs[:, 1:2]
        embeds = x = self.model.model.embed_tokens(torch.tensor(ids, dtype=torch.long))[:, :cfg.hidden_size]
        for layer, kv in zip(self.model.model.layers[:self.accept_hidden_layer], scratch):
            x = layer(x, cos, sin, attn, kv)
        return ThinkerStates(tuple(prompt_ids), tuple(sequence_ids), embeds, x, self.special_embeds)


def load_omni_runtime(config: DeployConfig, caps: DeploymentCaps) -> OmniRuntime:
    """The Thinker and its audio encoder always; the Talker and Code2Wav only on the blocking path (never read
    under the flag)."""
    path = Path(config.model)
    raw = read_omni_config(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    image_encoder = load_image_encoder(path, raw)
    thinker = load_thinker(path, raw, image_encoder.num_deepstack)
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=(int(raw["im_end_token_id"]),))
    audio_encoder, audio_features = load_audio_encoder(path, raw)
    talker = special = code2wav = None
    if not config.enable_in_flight_batching:
        talker, special = load_talker(path)
        code2wav = load_code2wav(path)
    return OmniRuntime(raw_config=raw, talker=talker, special_embeds=special, code2wav=code2wav,
                       audio_encoder=audio_encoder, audio_features=audio_features, image_encoder=image_encoder,
                       model=thinker,
                       tokenizer=tokenizer, caps=caps, config=config,
                       model_name=config.options.get("served_model_name") or path.name,
                       lora=lora_set(thinker, config, prefixed_names(ADAPTER_PREFIXES)))

