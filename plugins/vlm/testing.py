"""Test helpers: a tiny random-weight multimodal checkpoint, and media encoded as clients send it."""

from __future__ import annotations

import base64
import io
import json
import math
import tempfile
import wave
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from ifb_plugins.common.config import TextModelConfig
from ifb_plugins.common.testing import save_tiny_checkpoint
from ifb_plugins.vlm.config import AudioConfig, VisionConfig, VlmConfig
from ifb_plugins.vlm.encoders import MediaModel

IMAGE_TOKEN, AUDIO_TOKEN = "<image>", "<audio>"

TINY_VISION = {
    "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "num_channels": 3, "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}
TINY_AUDIO = {
    "model_type": "whisper", "d_model": 32, "encoder_ffn_dim": 64, "encoder_layers": 2,
    "encoder_attention_heads": 4, "num_mel_bins": 80, "max_source_positions": 1500,
    "activation_function": "gelu",
}


def _random_media_weights(config: VlmConfig, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):  # only the names and shapes are needed
        model = MediaModel(config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("bias"):
            value = torch.randn(tensor.shape, generator=gen) * 0.02
        elif tensor.ndim == 1:  # layer norms: near one, but not exactly, so a dropped weight shows
            value = 1.0 + torch.randn(tensor.shape, generator=gen) * 0.1
        else:
            # Fan-in scaling keeps activations O(1); position tables get the same treatment per row.
            fan_in = tensor[0].numel() if "embed" not in name else tensor.shape[-1]
            value = torch.randn(tensor.shape, generator=gen) / math.sqrt(fan_in)
            if name.endswith("projector.linear_2.weight"):
                value = value * 0.2  # media embeddings about as large as the token embeddings
        out[name] = value.contiguous()
    return out


def save_tiny_vlm_checkpoint(directory: str | Path, seed: int = 0, *, with_audio: bool = True) -> Path:
    """Write a tiny random-weight LLaVA-style checkpoint (vision, audio, Llama text model); returns the dir.

    The text part and its tokenizer come from ``ifb_plugins.common.testing``;
    ``<image>`` and ``<audio>`` are added as special tokens. A 32x32 image
    becomes 16 visual tokens; audio gives one token per 20 ms.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        text_dir = save_tiny_checkpoint(tmp, "llama", seed=seed)
        text_cfg = json.loads((text_dir / "config.json").read_text())
        text_weights = load_file(str(text_dir / "model.safetensors"))
        tokenizer = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
        tok_cfg = json.loads((text_dir / "tokenizer_config.json").read_text())
    tokenizer.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False),
                                  AddedToken(AUDIO_TOKEN, special=True, normalized=False)])
    image_id, audio_id = tokenizer.token_to_id(IMAGE_TOKEN), tokenizer.token_to_id(AUDIO_TOKEN)
    if max(image_id, audio_id) >= text_cfg["vocab_size"]:
        raise ValueError("the tiny text model's vocabulary has no room for the placeholder tokens")
    cfg = {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": text_cfg, "vision_config": TINY_VISION, "image_token_id": image_id,
        "projector_hidden_act": "gelu", "torch_dtype": "float32",
    }
    if with_audio:
        cfg.update(audio_config=TINY_AUDIO, audio_token_id=audio_id)
    config = VlmConfig(
        text=TextModelConfig.from_hf_config(text_cfg), vision=VisionConfig.from_hf(TINY_VISION),
        audio=AudioConfig.from_hf(TINY_AUDIO) if with_audio else None,
        image_token_id=image_id, audio_token_id=audio_id if with_audio else None)
    weights = {f"language_model.{k}": v for k, v in text_weights.items()}
    weights.update(_random_media_weights(config, seed))
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "sampling_rate": 16000,
        "n_fft": 400, "hop_length": 160}, indent=2))
    return directory


def png_bytes(seed: int, width: int = 24, height: int = 20, mode: str = "RGB") -> bytes:
    """A random-noise image encoded as PNG."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").convert(mode).save(buf, format="PNG")
    return buf.getvalue()


def image_part(data: bytes, mime: str = "image/png") -> dict:
    """An OpenAI ``image_url`` content part carrying ``data`` inline."""
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def wav_bytes(seed: int, seconds: float = 0.3, rate: int = 16000, sample_width: int = 2, channels: int = 1) -> bytes:
    """A random tone-plus-noise clip encoded as PCM WAV."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.5 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.1 * rng.standard_normal(t.size)
    signal = np.clip(np.repeat(signal[:, None], channels, axis=1), -1, 1)
    if sample_width == 1:
        raw = ((signal + 1) * 127.5).astype(np.uint8).tobytes()
    else:
        raw = (signal * 32767).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(1 if sample_width == 1 else 2)
        wav.setframerate(rate)
        wav.writeframes(raw)
    return buf.getvalue()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    """An OpenAI ``input_audio`` content part."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
