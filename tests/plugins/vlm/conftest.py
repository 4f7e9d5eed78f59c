"""A tiny LLaVA checkpoint built and saved by transformers, shared by the runtime tests."""

from __future__ import annotations

import pytest

from tests.plugins.vlm import tiny


@pytest.fixture(scope="session")
def vlm_checkpoint(tmp_path_factory):
    return tiny.llava(tmp_path_factory.mktemp("llava"), tower="siglip", feature_layer=-1, strategy="full", seed=3)
