"""A Qwen3-Omni checkpoint as transformers 5 saves it: the processor's settings live only in
``processor_config.json`` (nested per sub-processor), and the Omni loader reads them as transformers does.

Before the shared reader, the loader read only ``preprocessor_config.json``, fell back to 14-pixel
patches and 128 mel bins, and refused this checkpoint (4-pixel patches, 16 mel bins). The image and
audio tests (``test_omni_image.py``, ``test_omni_audio.py``) compare the loaded model with transformers
on the same directory; this one pins what the loader reads against what transformers reads.
"""

from __future__ import annotations

import json

import transformers

from ifb_plugins.speech.omni_audio import FeatureConfig
from ifb_plugins.speech.omni_vision import image_processing
from ifb_plugins.common.media.qwen3_vl_vision import Qwen3VisionConfig


def test_the_checkpoint_has_only_the_transformers_5_processor_file(omni_reference_model):
    path, _ = omni_reference_model
    assert (path / "processor_config.json").exists()
    assert not (path / "preprocessor_config.json").exists()


def test_image_and_audio_settings_equal_what_transformers_reads(omni_reference_model):
    path, _ = omni_reference_model
    raw = json.loads((path / "config.json").read_text())
    image_ref = transformers.AutoImageProcessor.from_pretrained(path)
    audio_ref = transformers.AutoFeatureExtractor.from_pretrained(path)
    vision = Qwen3VisionConfig.from_hf(raw["thinker_config"]["vision_config"])
    ours = image_processing(path, vision)
    assert (ours.patch_size, ours.merge_size, ours.temporal_patch_size) == (
        image_ref.patch_size, image_ref.merge_size, image_ref.temporal_patch_size) == (4, 2, 2)
    assert (ours.min_pixels, ours.max_pixels) == (image_ref.size["shortest_edge"], image_ref.size["longest_edge"])
    features = FeatureConfig.read(path, raw["thinker_config"]["audio_config"]["num_mel_bins"])
    assert (features.num_mels, features.n_fft, features.hop_length, features.sampling_rate) == (
        audio_ref.feature_size, audio_ref.n_fft, audio_ref.hop_length, audio_ref.sampling_rate)
    assert features.num_mels == 16
