"""Build speech runtimes from a deploy configuration."""

from __future__ import annotations

import logging
from pathlib import Path

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb_plugins.speech.loader import SpeechCheckpoint, build_code2wav, build_talker, build_thinker, read_checkpoint
from ifb_plugins.speech.runtime import OmniRuntime, Speaker, TtsRuntime
from ifb_plugins.common.lora import LoraSet

log = logging.getLogger("ifb.speech")


def _checkpoint(config: DeployConfig, kind: str) -> SpeechCheckpoint:
    if not config.model:
        raise FileNotFoundError(f"the {kind} deployment has no default model: give a checkpoint directory "
                                "(config.json with talker_config and code2wav_config, safetensors, tokenizer)")
    return read_checkpoint(Path(config.model))


def _name(config: DeployConfig, ckpt: SpeechCheckpoint) -> str:
    return config.options.get("served_model_name") or ckpt.path.name


def load_speaker(ckpt: SpeechCheckpoint) -> Speaker:
    return Speaker(build_talker(ckpt), build_code2wav(ckpt), ckpt.config)


def load_omni_runtime(config: DeployConfig, caps: DeploymentCaps) -> OmniRuntime:
    """The Thinker always; the Talker and decoder only on the blocking path.

    Under --enable-in-flight-batching their weights are never read: speech is
    refused per request there, so memory is not spent on it.
    """
    ckpt = _checkpoint(config, "omni")
    if not ckpt.has_thinker:
        raise ValueError(f"{ckpt.path} has no thinker_config: serve it with --plugin tts")
    thinker = build_thinker(ckpt)
    speaker = None if config.enable_in_flight_batching else load_speaker(ckpt)
    runtime = OmniRuntime(
        model=thinker, tokenizer=ckpt.tokenizer, caps=caps, config=config, model_name=_name(config, ckpt),
        lora=LoraSet(thinker, dict(config.options.get("lora_adapters") or {})),
        speech_config=ckpt.config, speaker=speaker)
    log.info("loaded %s: Thinker (%d layers)%s", runtime.model_name, ckpt.config.thinker.num_layers,
             "; Talker and code2wav not loaded (text-only under in-flight batching)" if speaker is None
             else f", Talker ({ckpt.config.talker.num_layers} layers) and code2wav "
                  f"(hop {ckpt.config.code2wav.hop_length})")
    return runtime


def load_tts_runtime(config: DeployConfig, caps: DeploymentCaps) -> TtsRuntime:
    ckpt = _checkpoint(config, "tts")
    if ckpt.config.talker.thinker_hidden_size:
        raise ValueError(f"{ckpt.path}: its Talker speaks from a Thinker's hidden states: serve it with --plugin omni")
    runtime = TtsRuntime(speaker=load_speaker(ckpt), tokenizer=ckpt.tokenizer, caps=caps, config=config,
                         model_name=_name(config, ckpt))
    log.info("loaded %s: Talker (%d layers) and code2wav (hop %d)", runtime.model_name,
             ckpt.config.talker.num_layers, ckpt.config.code2wav.hop_length)
    return runtime
