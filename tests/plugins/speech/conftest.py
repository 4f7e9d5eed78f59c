"""One tiny Qwen3-TTS checkpoint, written from Qwen's reference model, for all the speech tests."""

from __future__ import annotations

import pytest

from . import omni_reference, tts_reference


@pytest.fixture(scope="session")
def tts_reference_model(tmp_path_factory):
    """``(checkpoint directory, the reference's Qwen3TTSModel on the same weights)``."""
    path = tmp_path_factory.mktemp("qwen3-tts")
    return path, tts_reference.build(path, seed=0)


@pytest.fixture(scope="session")
def omni_reference_model(tmp_path_factory):
    """``(checkpoint directory, transformers' Qwen3OmniMoeForConditionalGeneration on the same weights)``."""
    path = tmp_path_factory.mktemp("qwen3-omni")
    return path, omni_reference.save_tiny_omni(path, seed=1)
