"""Qwen3-Omni checkpoints (``Qwen3OmniMoeForConditionalGeneration``, model_type ``qwen3_omni_moe``).

A checkpoint as transformers saves it: ``config.json`` with ``thinker_config``,
``talker_config`` and ``code2wav_config``, and weights prefixed ``thinker.``,
``talker.`` and ``code2wav.``. This module reads the config and builds the
Code2Wav codec decoder (``codec_decoder.CodecDecoder``, kind ``omni``); the
Talker is ``omni_talker``, the Thinker and the runtime ``omni_runtime``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ifb_plugins.speech.codec_decoder import CodecDecoder, CodecDecoderConfig
from ifb_plugins.speech.weights import adopt, load_prefixed

MODEL_TYPE = "qwen3_omni_moe"


def read_omni_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of a Qwen3-Omni checkpoint directory; a clear error for anything else."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (config.json is missing)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not a Qwen3-Omni checkpoint "
                         f"({MODEL_TYPE!r}); a Qwen3-TTS model is served with --plugin tts")
    return raw


def code2wav_config(raw: dict[str, Any]) -> CodecDecoderConfig:
    section = raw.get("code2wav_config")
    if not isinstance(section, dict):
        raise ValueError("config.json has no code2wav_config section")
    return CodecDecoderConfig.from_dict(section, "omni")


def load_code2wav(path: str | Path) -> CodecDecoder:
    """The checkpoint's Code2Wav (``code2wav.*`` weights alone are read)."""
    cfg = code2wav_config(read_omni_config(path))
    return adopt(lambda: CodecDecoder(cfg), load_prefixed(path, "code2wav."), "code2wav")

