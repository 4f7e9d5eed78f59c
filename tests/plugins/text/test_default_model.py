"""The text plugin's default model: names, paths and a cached file that fails verification."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ifb_plugins.text.default_model import ModelResolutionError, resolve_model


def test_resolve_model_paths_names_and_bad_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ModelResolutionError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")
    # A corrupted cached file is refused and deleted (no download happens here).
    monkeypatch.setenv("IFB_MODEL_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.parent.mkdir()
    bad.write_bytes(np.zeros(16, np.uint8).tobytes())
    with pytest.raises(ModelResolutionError, match="failed verification"):
        resolve_model(None)
    assert not bad.exists()
