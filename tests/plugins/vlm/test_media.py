"""Media decoding, the audio front end and the encoders, against Pillow/wave inputs and the transformers reference."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch

from ifb.params import InvalidRequest
from ifb_plugins.vlm.config import AudioConfig, VisionConfig
from ifb_plugins.vlm.encoders import AudioTower, VisionTower, num_kept
from ifb_plugins.vlm.media import decode_image, decode_wav, fetch_image_bytes, parse_messages
from ifb_plugins.vlm.mel import log_mel_spectrogram, mel_filterbank, resample_linear
from ifb_plugins.vlm.testing import audio_part, image_part, png_bytes, wav_bytes

PARSE = dict(placeholders={"image": "<image>", "audio": "<audio>"}, image_size=32,
             image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), sampling_rate=16000)


def test_parts_become_placeholders_in_order():
    parsed = parse_messages((
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(png_bytes(1)),
                                     audio_part(wav_bytes(2)), image_part(png_bytes(3, mode="RGBA"))]},
    ), **PARSE)
    assert parsed.messages[0] == {"role": "system", "content": "Be brief."}
    assert parsed.messages[1]["content"] == "Compare\n<image>\n<audio>\n<image>"
    assert [m.kind for m in parsed.media] == ["image", "audio", "image"]
    assert parsed.media[0].data.shape == (3, 32, 32) and parsed.media[1].data.shape == (4800,)
    assert len({m.digest for m in parsed.media}) == 3


def test_a_modality_the_model_lacks_is_refused():
    with pytest.raises(InvalidRequest, match="takes no audio input"):
        parse_messages(({"role": "user", "content": [audio_part(wav_bytes(0))]},),
                       **{**PARSE, "placeholders": {"image": "<image>"}})


def test_image_is_resized_and_normalized():
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (7, 5), (255, 0, 128)).save(buf, format="PNG")
    pixels = decode_image(buf.getvalue(), "img", 4, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert pixels.shape == (3, 4, 4)
    assert torch.allclose(pixels[0], torch.ones(4, 4)) and torch.allclose(pixels[1], -torch.ones(4, 4))
    assert torch.allclose(pixels[2], torch.full((4, 4), 128 / 255 * 2 - 1), atol=1e-6)


@pytest.mark.parametrize("url, message", [
    ("data:image/png,rawbytes", "must be base64"),
    ("ftp://host/cat.png", "unsupported URL scheme"),
    ("http://host/cat.png", "remote URLs"),
    ("file://otherhost/cat.png", "local file"),
    ("", "non-empty url"),
])
def test_image_urls_that_cannot_be_fetched(url, message):
    with pytest.raises(InvalidRequest, match=message):
        fetch_image_bytes(url, "img")


def test_wav_is_mixed_to_mono_and_resampled():
    stereo = wav_bytes(0, seconds=0.5, rate=8000, sample_width=1, channels=2)
    samples = decode_wav(stereo, "wav", 16000)
    assert samples.shape == (8000,) and samples.abs().max() <= 1.0
    pcm16 = wav_bytes(1, seconds=0.25, rate=16000)
    with wave.open(io.BytesIO(pcm16)) as w:
        expected = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2") / 32768.0
    assert np.allclose(decode_wav(pcm16, "wav", 16000).numpy(), expected, atol=1e-7)


def test_resample_interpolates_linearly():
    up = resample_linear(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, 4)
    assert up.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]
    down = resample_linear(torch.arange(8.0), 4, 2)
    assert down.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_num_kept():
    assert [num_kept(16, r) for r in (None, 1.0, 0.5, 0.25, 0.3, 0.01)] == [16, 16, 8, 4, 5, 1]
    assert num_kept(10, 0.3) == 3  # float noise in 0.3 * 10 does not add a token


# ---- against the transformers implementations ----

def test_mel_front_end_matches_whisper_feature_extractor():
    audio_utils = pytest.importorskip("transformers.audio_utils")
    from transformers import WhisperFeatureExtractor

    reference = audio_utils.mel_filter_bank(num_frequency_bins=201, num_mel_filters=80, min_frequency=0.0,
                                            max_frequency=8000.0, sampling_rate=16000, norm="slaney",
                                            mel_scale="slaney")
    assert np.allclose(mel_filterbank(80, 400, 16000).numpy(), reference.T, atol=1e-7)
    audio = np.random.default_rng(0).standard_normal(12345).astype(np.float32) * 0.1
    expected = WhisperFeatureExtractor(feature_size=80)(
        audio, sampling_rate=16000, return_tensors="np", padding="longest")["input_features"][0]
    ours = log_mel_spectrogram(torch.from_numpy(audio), 80).numpy()
    assert ours.shape == expected.shape == (80, 12345 // 160)
    assert np.abs(ours - expected).max() < 1e-4


def test_vision_tower_matches_siglip():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, image_size=32, patch_size=8, vision_use_head=False)
    torch.manual_seed(0)
    reference = transformers.SiglipVisionModel(cfg).eval()
    ours = VisionTower(VisionConfig.from_hf(cfg.to_dict()))
    # checkpoints nest SigLIP under vision_model. (the v5 module flattens it)
    state = {k if k.startswith("vision_model.") else f"vision_model.{k}": v for k, v in reference.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    pixels = torch.randn(3, 32, 32)
    with torch.no_grad():
        expected = reference(pixel_values=pixels[None]).last_hidden_state[0]
        features, received = ours(pixels)
    assert torch.allclose(features, expected, atol=1e-5)
    assert received.shape == (16,) and torch.isclose(received.sum(), torch.tensor(1.0))


def test_audio_tower_matches_whisper_encoder():
    transformers = pytest.importorskip("transformers")
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = transformers.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                                     num_mel_bins=80, max_source_positions=16)
    torch.manual_seed(0)
    reference = WhisperEncoder(cfg).eval()
    ours = AudioTower(AudioConfig.from_hf(cfg.to_dict()))
    ours.load_state_dict(reference.state_dict(), strict=True)
    mel = torch.randn(80, 32)  # the reference insists on exactly 2 * max_source_positions frames
    with torch.no_grad():
        assert torch.allclose(ours(mel), reference(mel[None]).last_hidden_state[0], atol=1e-5)
    assert AudioTower.num_outputs(31) == 16 and ours(mel[:, :31]).shape == (16, 32)
