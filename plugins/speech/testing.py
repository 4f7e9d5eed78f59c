"""Test helpers: tiny random-weight speech checkpoints in the layout the loader reads.

``save_tiny_omni_checkpoint`` writes an Omni bundle (or, without the Thinker,
a standalone TTS model): config.json with ``thinker_config`` /
``talker_config`` / ``code2wav_config``, one safetensors file whose names are
prefixed ``thinker.`` / ``talker.`` / ``code2wav.``, and the tokenizer files.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ifb_plugins.speech.code2wav import Code2Wav
from ifb_plugins.speech.config import Code2WavConfig, TalkerConfig
from ifb_plugins.speech.talker import Talker
from ifb_plugins.common.testing import save_tiny_checkpoint

TINY_TALKER = {
    "codebook_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "min_codes_per_token": 2,
    "max_codes_per_token": 4,
    "temperature": 0.9,
    "top_k": 20,
}
#: hop 8 * 5 * 4 * 3 = 480 samples per code: 50 codes a second at 24 kHz
TINY_CODE2WAV = {"codebook_size": 64, "channels": [32, 16, 8, 8, 4], "upsample_rates": [8, 5, 4, 3],
                 "sample_rate": 24000}


def _random_state(module_factory, seed: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return {k: v.detach().clone().contiguous() for k, v in module_factory().state_dict().items()}


def save_tiny_omni_checkpoint(directory: str | Path, seed: int = 0, with_thinker: bool = True,
                              talker_overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random-weight speech checkpoint into ``directory``; returns it.

    The Thinker and tokenizer come from the text plugin's tiny Llama
    checkpoint. With ``with_thinker=False`` it is a standalone TTS model: no
    ``thinker_config`` and no ``thinker.*`` weights, the tokenizer kept.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        text_dir = save_tiny_checkpoint(Path(scratch) / "thinker", "llama", seed=seed)
        thinker_cfg = json.loads((text_dir / "config.json").read_text())
        thinker_state = load_file(str(text_dir / "model.safetensors"))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_text((text_dir / name).read_text())

    talker_raw = {**TINY_TALKER, "text_vocab_size": thinker_cfg["vocab_size"], **(talker_overrides or {})}
    if with_thinker:
        talker_raw["thinker_hidden_size"] = thinker_cfg["hidden_size"]
    talker_cfg = TalkerConfig.from_dict(talker_raw)
    code2wav_cfg = Code2WavConfig.from_dict(TINY_CODE2WAV)

    weights: dict[str, torch.Tensor] = {}
    if with_thinker:
        weights.update({f"thinker.{k}": v for k, v in thinker_state.items()})
    weights.update({f"talker.{k}": v for k, v in _random_state(lambda: Talker(talker_cfg), seed + 1).items()})
    weights.update({f"code2wav.{k}": v for k, v in _random_state(lambda: Code2Wav(code2wav_cfg), seed + 2).items()})
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})

    config: dict[str, Any] = {
        "architectures": ["OmniSpeechModel" if with_thinker else "TextToSpeechModel"],
        "model_type": "ifb_omni" if with_thinker else "ifb_tts",
        "talker_config": talker_raw,
        "code2wav_config": TINY_CODE2WAV,
    }
    if with_thinker:
        config["thinker_config"] = thinker_cfg
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
