"""Qwen3-Omni's Code2Wav, loaded from what transformers saves, against ``Qwen3OmniMoeCode2Wav`` itself."""

from __future__ import annotations

import pytest
import torch

from ifb_plugins.speech.omni import load_code2wav



@pytest.fixture(scope="module")
def omni(omni_reference_model):
    return omni_reference_model


def _codes(num_frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (1, 4, num_frames), generator=torch.Generator().manual_seed(seed))


def test_code2wav_waveform_equals_the_reference(omni):
    path, reference = omni
    ours = load_code2wav(path)
    codes = _codes(13, 0)  # longer than the 4-frame attention window
    with torch.no_grad():
        expected, got = reference.code2wav(codes), ours(codes)
    assert got.shape == expected.shape
    assert expected.abs().max() < 1.0  # not saturated: the comparison sees the whole network
    assert (got - expected).abs().max().item() <= 1e-4


def test_chunked_decode_equals_the_reference(omni):
    path, reference = omni
    ours = load_code2wav(path)
    codes = _codes(17, 1)
    with torch.no_grad():
        expected = reference.code2wav.chunked_decode(codes, chunk_size=6, left_context_size=3)
    got = ours.chunked_decode(codes, 6, 3)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4
    # decoding by the reference's chunks, a range at a time, gives the same samples
    pieces = [ours.decode_range(codes, start, min(start + 6, 17), 6, 3) for start in (0, 6, 12)]
    assert torch.equal(torch.cat(pieces, dim=-1), got)


def test_code2wav_rejects_a_wrong_number_of_codebooks(omni):
    ours = load_code2wav(omni[0])
    with pytest.raises(ValueError, match="expected 4 codebooks"):
        ours(torch.zeros(1, 3, 5, dtype=torch.long))

