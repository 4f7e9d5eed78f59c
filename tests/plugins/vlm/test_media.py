"""Media decoding, the audio front end and the encoders, against Pillow/wave inputs and the transformers reference."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from ifb.params import InvalidRequest
from ifb_plugins.common.media.parts import decode_image, decode_wav, fetch_image_bytes, parse_messages
from ifb_plugins.vlm.pruning import num_kept
from ifb_plugins.common.media.mel import log_mel_features, mel_filterbank, resample_linear
from tests.models.media import audio_part, image_part, png_bytes, wav_bytes

PARSE = dict(modalities={"image", "audio"}, sampling_rate=16000)


def test_parts_become_template_parts_in_order():
    parsed = parse_messages((
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(png_bytes(1)),
                                     audio_part(wav_bytes(2)), image_part(png_bytes(3, mode="RGBA"))]},
    ), **PARSE)
    assert parsed.messages[0] == {"role": "system", "content": "Be brief."}
    assert parsed.messages[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"},
                                             {"type": "audio"}, {"type": "image"}]
    assert [m.kind for m in parsed.media] == ["image", "audio", "image"]
    assert parsed.media[0].data.size == (24, 20) and parsed.media[2].data.mode == "RGBA"
    assert parsed.media[1].data.shape == (4800,)
    assert len({m.digest for m in parsed.media}) == 3


def test_a_modality_the_model_lacks_is_refused():
    with pytest.raises(InvalidRequest, match="takes no audio input"):
        parse_messages(({"role": "user", "content": [audio_part(wav_bytes(0))]},),
                       **{**PARSE, "modalities": {"image"}})


def test_a_truncated_image_is_refused():
    data = png_bytes(0, width=64, height=64)
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        decode_image(data[: len(data) // 2], "img")


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


def test_a_local_file_refusal_names_how_to_allow_it_only_where_the_deployment_can():
    with pytest.raises(InvalidRequest) as refused:
        fetch_image_bytes("file:///srv/cat.png", "img")
    assert "not allowed" in str(refused.value) and "--" not in str(refused.value)
    with pytest.raises(InvalidRequest, match="start the server with --allowed-local-media-path DIR"):
        fetch_image_bytes("/srv/cat.png", "img", allow_hint="start the server with --allowed-local-media-path DIR")


def test_wav_is_mixed_to_mono_and_resampled():
    stereo = wav_bytes(0, seconds=0.5, rate=8000, sample_width=1, channels=2)
    samples = decode_wav(stereo, "wav", 16000)
    assert samples.shape == (8000,) and samples.dtype == np.float32 and np.abs(samples).max() <= 1.0
    pcm16 = wav_bytes(1, seconds=0.25, rate=16000)
    with wave.open(io.BytesIO(pcm16)) as w:
        expected = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2") / 32768.0
    assert np.allclose(decode_wav(pcm16, "wav", 16000), expected, atol=1e-7)


def test_resample_interpolates_linearly():
    up = resample_linear(np.array([0.0, 1.0, 2.0, 3.0], dtype=np.float32), 2, 4)
    assert up.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]
    down = resample_linear(np.arange(8.0, dtype=np.float32), 4, 2)
    assert down.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_num_kept():
    assert [num_kept(16, r) for r in (None, 1.0, 0.5, 0.25, 0.3, 0.01)] == [16, 16, 8, 4, 5, 1]
    assert num_kept(10, 0.3) == 3  # float noise in 0.3 * 10 does not add a token


# ---- against the transformers implementations ----

def test_mel_front_end_matches_whisper_feature_extractor():
    from transformers import audio_utils
    from transformers import WhisperFeatureExtractor

    reference = audio_utils.mel_filter_bank(num_frequency_bins=201, num_mel_filters=80, min_frequency=0.0,
                                            max_frequency=8000.0, sampling_rate=16000, norm="slaney",
                                            mel_scale="slaney")
    assert np.allclose(mel_filterbank(80, 400, 16000), reference.T, atol=1e-7)
    audio = np.random.default_rng(0).standard_normal(12345).astype(np.float32) * 0.1
    expected = WhisperFeatureExtractor(feature_size=80)(
        audio, sampling_rate=16000, return_tensors="np", padding="max_length")["input_features"][0]
    ours = log_mel_features(audio, 80, num_samples=480000)
    assert ours.shape == expected.shape == (80, 3000)
    assert np.abs(ours - expected).max() < 1e-5
    # the first frames alone are the same numbers (the rest of the chunk is padding)
    assert np.array_equal(log_mel_features(audio, 80, num_samples=480000, num_frames=80), ours[:, :80])


def test_pruning_keeps_wrapper_tokens_and_cuts_positions_alike():
    import torch

    from ifb_plugins.vlm.interface import EncodedMedia
    from ifb_plugins.vlm.pruning import prune

    image, wrap = 9, 7
    ids = (wrap, image, image, image, image, wrap, image, image, wrap)
    embeds = torch.arange(6.0)[:, None].repeat(1, 3)  # row r holds r
    importance = torch.tensor([0.1, 0.9, 0.3, 0.8, 0.2, 0.7])
    positions = torch.arange(len(ids))[None].repeat(3, 1)
    encoded = EncodedMedia(ids, image, embeds, importance, positions)
    kept = prune(encoded, 0.5)
    assert kept.token_ids == (wrap, image, image, wrap, image, wrap)
    assert kept.embeds[:, 0].tolist() == [1.0, 3.0, 5.0]  # the three most important rows, in order
    assert kept.position_ids[0].tolist() == [0, 2, 4, 5, 7, 8]
    assert prune(encoded, 1.0) is encoded
