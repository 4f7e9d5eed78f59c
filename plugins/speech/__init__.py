"""The speech plugin: an Omni-style bundle (Thinker + Talker + code-to-waveform) and a standalone TTS model.

- ``omni`` (title "Speech output, Omni bundle"): the Thinker is a text runtime
  that the engine serves under in-flight batching. Under the flag the bundle
  starts text-only: the Talker and decoder are not loaded, and
  ``/v1/audio/speech`` and audio output on chat are refused per request,
  naming the flag. On the default (blocking) path it speaks.
- ``tts`` (title "Speech output, standalone TTS model"): Talker + decoder, no
  Thinker. No request engine exists for it, so the flag is refused at
  start-up; on the default path it serves ``/v1/audio/speech``.

Python: ``generate_audio(llm, text, voice=None) -> bytes`` (a WAV file).
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
from ifb_plugins.common.caps import MAX_BUILT_BATCH, TEXT_ENDPOINTS, TEXT_RUNTIME_SETTINGS, text_options
from ifb_plugins.speech.options import ifb_request_options  # noqa: F401 - its hook

#: extras key: speak the prompt as given instead of answering it (what /v1/audio/speech asks)
SPEAK_PROMPT = "speak_prompt"

OMNI_TITLE = "Speech output, Omni bundle"
TTS_TITLE = "Speech output, standalone TTS model"

#: the Omni bundle's endpoints: speech is served on the blocking path and refused per request under the flag
OMNI_ENDPOINTS = {**TEXT_ENDPOINTS, "audio.speech": EndpointSupport.REFUSED_UNDER_IFB}
TTS_ENDPOINTS = {"audio.speech": EndpointSupport.SERVED}

TTS_NOTE = ("no request engine exists for a TTS-only runtime: the Talker and code-to-waveform decoder speak "
            "a whole utterance per request")


def omni_options() -> dict[str, OptionSupport]:
    """The Thinker's text options, with speech output rejected under in-flight batching."""
    options = text_options()
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
        stepped_execution=True, seated_admission=True, max_batch_size=MAX_BUILT_BATCH,
        num_ranks=config.num_ranks, batch_invariant_verified=True, options=omni_options(),
        endpoints=dict(OMNI_ENDPOINTS))


def declare_tts(config: DeployConfig) -> DeploymentCaps:
    return DeploymentCaps(
        stepped_execution=False, seated_admission=False, max_batch_size=1, num_ranks=config.num_ranks,
        options=tts_options(), endpoints=dict(TTS_ENDPOINTS), notes=TTS_NOTE,
        supports_prefix_reuse=False, prefix_reuse_note="a TTS model keeps no KV prefix to reuse")


def load_omni(config: DeployConfig):
    from ifb_plugins.speech.build import load_omni_runtime

    return load_omni_runtime(config, declare_omni(config))


def load_tts(config: DeployConfig):
    from ifb_plugins.speech.build import load_tts_runtime

    return load_tts_runtime(config, declare_tts(config))


OMNI_KIND = DeploymentKind(
    name="omni", plugin="speech", title=OMNI_TITLE, declare=declare_omni, load=load_omni,
    settings=TEXT_RUNTIME_SETTINGS,
    variants=(MatrixVariant(OMNI_TITLE, DeployConfig(plugin="omni", enable_in_flight_batching=True),
                            note="The Talker and code-to-waveform decoder are not loaded under the flag."),),
    description="Thinker (Llama-family text model) + Talker (audio codec tokens) + code-to-waveform decoder "
                "at 24 kHz, from a safetensors directory")
TTS_KIND = DeploymentKind(
    name="tts", plugin="speech", title=TTS_TITLE, declare=declare_tts, load=load_tts,
    settings=frozenset({"served_model_name"}),
    description="Talker + code-to-waveform decoder at 24 kHz (no Thinker), from a safetensors directory")


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
                   speed: float = 1.0, seed: int | None = None) -> bytes:
    """Speak ``text`` with a speech deployment; returns the audio file (WAV, 24 kHz mono 16-bit, by default).

    ``llm`` is an ``ifb.LLM`` (or an ``ifb.deploy.Deployment``) loaded with
    ``plugin="omni"`` or ``plugin="tts"``. ``format`` is wav, pcm or mp3 (mp3
    when an encoder is installed). Speech runs on the blocking path only: under
    in-flight batching this raises ``ifb.engine.RequestRejected`` naming it.
    Bad text, voice, format or speed raise ``ifb.params.InvalidRequest``.
    """
    deployment = getattr(llm, "deployment", llm)
    spec = RequestSpec(
        prompt=text, params=SamplingParams(max_tokens=1, seed=seed),
        extras={"generate_audio": True, SPEAK_PROMPT: True, "audio": {"voice": voice, "format": format,
                                                                       "speed": speed}})
    final = deployment.engine.submit(spec, wait=True).result()
    return final.extras["speech"]["data"]
