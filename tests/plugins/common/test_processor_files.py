"""The shared processor-settings reader reads what transformers' processors read, from either file.

Every directory here is written by transformers' own ``save_pretrained``: a processor (transformers 5:
``processor_config.json``, settings nested), a lone image processor or feature extractor
(``preprocessor_config.json``), or both, where the nested settings win, as in transformers.
"""

from __future__ import annotations

import json

import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ifb_plugins.common.loading.processor import ProcessorFiles
from tests.plugins.vlm.tiny import tiny_tokenizer


def agrees(ours: dict, theirs) -> None:
    """Every setting the reader found is the one transformers loaded (through JSON, as it saves them)."""
    reference = json.loads(theirs.to_json_string())
    assert ours, "the reader found no settings"
    for key, value in ours.items():
        if key in reference and key not in ("processor_class",):
            assert reference[key] == value, key


def qwen2_audio_processor(mels: int):
    features = transformers.WhisperFeatureExtractor(feature_size=mels)
    return transformers.Qwen2AudioProcessor(feature_extractor=features, tokenizer=tiny_tokenizer("<|AUDIO|>",
                                                                                                 role="audio_token"))


def test_a_saved_processor_is_read_from_its_nested_processor_config(tmp_path):
    processor = qwen2_audio_processor(16)
    processor.save_pretrained(tmp_path)
    assert (tmp_path / "processor_config.json").exists() and not (tmp_path / "preprocessor_config.json").exists()
    files = ProcessorFiles.read(tmp_path)
    assert files.feature_extractor["feature_size"] == 16
    assert files.audio_source.endswith("processor_config.json (feature_extractor)")
    agrees(files.feature_extractor, transformers.AutoFeatureExtractor.from_pretrained(tmp_path))


def test_a_lone_image_processor_is_read_from_preprocessor_config(tmp_path):
    Qwen2VLImageProcessorPil(patch_size=8, merge_size=2).save_pretrained(tmp_path)
    files = ProcessorFiles.read(tmp_path)
    assert files.image_processor["patch_size"] == 8 and files.image_source.endswith("preprocessor_config.json")
    reference = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    assert reference.patch_size == 8
    agrees(files.image_processor, reference)


def test_nested_settings_win_over_a_preprocessor_config_beside_them(tmp_path):
    # a lone feature extractor at 128 mels, then the processor at 16 over the same directory
    transformers.WhisperFeatureExtractor(feature_size=128).save_pretrained(tmp_path)
    qwen2_audio_processor(16).save_pretrained(tmp_path)
    assert (tmp_path / "preprocessor_config.json").exists()
    files = ProcessorFiles.read(tmp_path)
    reference = transformers.AutoFeatureExtractor.from_pretrained(tmp_path)
    assert files.feature_extractor["feature_size"] == reference.feature_size == 16


def test_a_directory_without_processor_files_reads_as_empty_settings(tmp_path):
    files = ProcessorFiles.read(tmp_path)
    assert (files.processor, files.image_processor, files.feature_extractor) == ({}, {}, {})
    assert files.image_source is None and files.audio_source is None
