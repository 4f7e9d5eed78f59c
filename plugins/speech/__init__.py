"""The speech plugin: Qwen3-Omni (``omni``) and the standalone Qwen3-TTS model (``tts``).

- ``tts`` (title "Speech output, standalone TTS model"): Qwen3-TTS as Qwen's
  ``qwen-tts`` package defines it (talker + code predictor + the 12 Hz speech
  tokenizer's decoder). No request engine exists for it, so
  ``--enable-in-flight-batching`` is refused at start-up; on the default path
  it serves ``/v1/audio/speech``.
- ``omni`` (title "Speech output, Omni bundle"): declared as the spec has it
  (text-only under the flag: the Thinker served, speech refused per request).
  The Thinker (its text decoder, audio and vision encoders: text, audio and
  image input) is served by the engine; on the default path the Talker and
  Code2Wav speak.

Python: ``generate_audio(llm, text, voice=None, ...) -> bytes`` (the audio file).
See docs/plugins/speech.md.
"""

from __future__ import annotations

from typing import Any

from ifb import hookimpl
from ifb.capabilities import (
    DeployConfig, DeploymentCaps, DeploymentKind, EndpointSupport, MatrixVariant, OptionSupport, Support,
)
from ifb.options import BLOCKING
from ifb.params import RequestSpec, SamplingParams
from ifb_plugins.common.runtime.caps import (
    MAX_BUILT_BATCH, TEXT_ENDPOINTS, TEXT_RUNTIME_SETTINGS, text_options,
)
from ifb_plugins.speech.options import ifb_request_options  # noqa: F401 - its hook

OMNI_TITLE = "Speech output, Omni bundle"
TTS_TITLE = "Speech output, standalone TTS model"

#: the Omni bundle's endpoints: speech is served on the blocking path and refused per request under the flag
OMNI_ENDPOINTS = {**TEXT_ENDPOINTS, "audio.speech": EndpointSupport.REFUSED_UNDER_IFB,
                  "audio.transcriptions": EndpointSupport.SERVED}
TTS_ENDPOINTS = {"audio.speech": EndpointSupport.SERVED}

TTS_NOTE = ("no request engine exists for a TTS-only runtime: the Talker and code-to-waveform decoder speak "
            "a whole utterance per request")


def omni_options(config: DeployConfig | None = None) -> dict[str, OptionSupport]:
    """The Thinker's text options, with speech output rejected under in-flight batching."""
    # n > 1, adapters on the Thinker's decoder and the capture are the text runtime's, proven on the bundle by
    # tests/plugins/speech
    options = text_options(context_reuse=config is not None and config.enable_context_reuse)
    options["media_under_pruner"] = OptionSupport(
        Support.SERVED, reason="No visual-token pruner is built for Qwen3-Omni: its audio and vision encoders "
                               "run at admission and media requests join the running batch.")
    options["generate_audio"] = OptionSupport(
        Support.REJECTED,
        reason="Speech is assembled after the text is complete by the Talker and code-to-waveform engines, "
               "which the stepped loop does not drive and which are not loaded under in-flight batching.",
        alternative=BLOCKING)
    return options


def tts_options() -> dict[str, OptionSupport]:
    """What a standalone TTS model does with each request option (on its only path, the blocking one)."""
    absent = "A TTS model speaks its input; it does not generate text."
    return {
        "generate_audio": OptionSupport(Support.SERVED, reason="Every request is spoken."),
        "n_sequences": OptionSupport(Support.NOT_APPLICABLE, reason="One utterance per request."),
        "lora": OptionSupport(Support.NOT_APPLICABLE, reason="No LoRA adapters are built for TTS models."),
        "save_system_prompt_kv_cache": OptionSupport(Support.NOT_APPLICABLE, reason=absent),
        "guided_decoding": OptionSupport(Support.NOT_APPLICABLE, reason=absent),
        "media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only."),
        "past_trajectory": OptionSupport(Support.NOT_APPLICABLE, reason=absent),
    }


def declare_omni(config: DeployConfig) -> DeploymentCaps:
    # The Thinker is the text plugin's runtime: its batch invariance is the text plugin's, proven by its tests
    # (and re-checked on the bundle by tests/plugins/speech).
    return DeploymentCaps(
        tensor_parallel_note="the Thinker's audio encoder and the Talker pipeline run on one rank; they are not sharded",
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks, batch_invariant_verified=True, options=omni_options(config),
        endpoints=dict(OMNI_ENDPOINTS))


def declare_tts(config: DeployConfig) -> DeploymentCaps:
    return DeploymentCaps(
        tensor_parallel_note="the TTS pipeline runs on one rank; it is not sharded",
        stepped_execution=False, seated_admission=False, max_batch_size=1, num_ranks=config.num_ranks,
        options=tts_options(), endpoints=dict(TTS_ENDPOINTS), notes=TTS_NOTE,
        supports_prefix_reuse=False, prefix_reuse_note="a TTS model keeps no KV prefix to reuse")


#: the speech models are built (and tested) on the CPU only
CPU_ONLY = frozenset({"cpu"})


def load_omni(config: DeployConfig):
    from ifb_plugins.speech.omni_runtime import load_omni_runtime

    if not config.model:
        raise FileNotFoundError("the omni deployment has no default model: give a Qwen3-Omni checkpoint directory")
    from ifb_plugins.common.runtime.placement import float32_only

    float32_only(config, "the omni deployment")
    return load_omni_runtime(config, declare_omni(config))


def load_tts(config: DeployConfig):
    from pathlib import Path

    from ifb_plugins.speech.runtime import TtsRuntime
    from ifb_plugins.speech.tts import load_tts as load_speaker

    if not config.model:
        raise FileNotFoundError("the tts deployment has no default model: give a Qwen3-TTS checkpoint directory")
    from ifb_plugins.common.runtime.placement import float32_only

    float32_only(config, "the tts deployment")
    path = Path(config.model)
    name = config.options.get("served_model_name") or path.name
    return TtsRuntime(speaker=load_speaker(path), caps=declare_tts(config), config=config, model_name=name)


OMNI_KIND = DeploymentKind(
    name="omni", plugin="speech", title=OMNI_TITLE, declare=declare_omni, load=load_omni,
    settings=TEXT_RUNTIME_SETTINGS | {"max_audio_frames"}, device_types=CPU_ONLY,
    variants=(MatrixVariant(OMNI_TITLE, DeployConfig(plugin="omni", enable_in_flight_batching=True),
                            note="The Talker and code-to-waveform decoder are not loaded under the flag."),),
    description="Qwen3-Omni (Thinker with audio and image input + Talker + Code2Wav)")
TTS_KIND = DeploymentKind(
    name="tts", plugin="speech", title=TTS_TITLE, declare=declare_tts, load=load_tts,
    settings=frozenset({"served_model_name"}), device_types=CPU_ONLY,
    description="Qwen3-TTS CustomVoice / VoiceDesign (talker, code predictor, 12 Hz codec decoder) at 24 kHz")


@hookimpl
def ifb_deployment_kinds():
    return [OMNI_KIND, TTS_KIND]


@hookimpl
def ifb_http_routes(app_state: Any):
    deployment = getattr(app_state, "deployment", None)
    if deployment is None or deployment.kind.plugin != "speech":
        return []
    from ifb_plugins.speech.routes import speech_routes

    return speech_routes()


def generate_audio(llm: Any, text: str, voice: str | None = None, *, format: str = "wav",  # noqa: A002
                   speed: float = 1.0, instructions: str | None = None, language: str | None = None,
                   seed: int | None = None, greedy: bool = False) -> bytes:
    """Speak ``text`` with a speech deployment; returns the whole audio file (WAV, 24 kHz mono 16-bit, by default).

    ``llm`` is an ``ifb.LLM`` (or an ``ifb.deploy.Deployment``) loaded with
    ``plugin="tts"`` or ``plugin="omni"`` (Qwen3-Omni says the text as its reply). ``voice`` is one of a CustomVoice model's speakers,
    ``instructions`` describes the delivery (or, on a VoiceDesign model, the
    voice), ``language`` is ``auto`` or one the model names; ``format`` is wav,
    pcm, mp3, flac or opus. Sampling follows the checkpoint's
    generation_config, seeded by ``seed``; ``greedy`` picks the likeliest codes.
    Under in-flight batching this raises ``ifb.engine.RequestRejected``; bad
    text, voice, instructions, language, format or speed raise ``ifb.params.InvalidRequest``.
    """
    deployment = getattr(llm, "deployment", llm)
    spec = RequestSpec(
        prompt=text, params=SamplingParams(max_tokens=1, seed=seed, temperature=0.0 if greedy else 1.0),
        extras={"generate_audio": True, "speak_input": True,
                "audio": {"voice": voice, "format": format, "speed": speed, "instructions": instructions,
                          "language": language}})
    final = deployment.engine.submit(spec, wait=True).result()
    return final.audio.data
