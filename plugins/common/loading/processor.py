"""A checkpoint's processor settings, read from its directory as transformers reads them.

transformers 5's ``ProcessorMixin.save_pretrained`` writes one ``processor_config.json`` with each
sub-processor's settings nested under its attribute (``image_processor``, ``feature_extractor``,
``video_processor``) beside the processor's own (a chat template, ``image_seq_len``, dataset
statistics). Older checkpoints, and a sub-processor saved on its own, keep them in
``preprocessor_config.json`` at the top level; Qwen's published Omni checkpoints put the image
processor's and the feature extractor's keys in that one file.

``ImageProcessingMixin.get_image_processor_dict`` and
``FeatureExtractionMixin.get_feature_extractor_dict`` take the nested entry when
``processor_config.json`` has one, and the whole of ``preprocessor_config.json`` otherwise; so does
``ProcessorFiles.read``. Every plugin reads its processor through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

#: transformers' ``PROCESSOR_NAME`` and ``IMAGE_PROCESSOR_NAME`` / ``FEATURE_EXTRACTOR_NAME``
PROCESSOR_FILE = "processor_config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
#: the keys under which ``processor_config.json`` nests an audio front end (the older and newer name)
_AUDIO_KEYS = ("feature_extractor", "audio_processor")


def _read(file: Path) -> dict[str, Any] | None:
    if not file.exists():
        return None
    raw = json.loads(file.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


@attrs.frozen
class ProcessorFiles:
    """A checkpoint's saved processor settings: the processor's own and each sub-processor's.

    ``image_source`` and ``audio_source`` say where the settings were found (a file, and the nested
    key where there is one), for error messages; ``None`` when the directory has none.
    """

    processor: dict[str, Any]
    image_processor: dict[str, Any]
    feature_extractor: dict[str, Any]
    image_source: str | None = None
    audio_source: str | None = None

    @classmethod
    def read(cls, path: str | Path) -> ProcessorFiles:
        """The settings in ``path`` (a checkpoint directory); missing files read as empty settings."""
        path = Path(path)
        processor = _read(path / PROCESSOR_FILE) or {}
        legacy = _read(path / PREPROCESSOR_FILE)
        image, image_source = processor.get("image_processor"), f"{path / PROCESSOR_FILE} (image_processor)"
        if image is None and legacy is not None:
            image, image_source = legacy, str(path / PREPROCESSOR_FILE)
        key = next((k for k in _AUDIO_KEYS if k in processor), None)
        audio, audio_source = (processor[key], f"{path / PROCESSOR_FILE} ({key})") if key else (None, None)
        if audio is None and legacy is not None:
            audio, audio_source = legacy, str(path / PREPROCESSOR_FILE)
        return cls(processor, dict(image or {}), dict(audio or {}),
                   image_source if image is not None else None, audio_source if audio is not None else None)
