"""A tiny random-weight multimodal checkpoint, written once per test session and loaded through the real loader."""

from __future__ import annotations

import pytest

from ifb_plugins.vlm.testing import save_tiny_vlm_checkpoint


@pytest.fixture(scope="session")
def vlm_checkpoint(tmp_path_factory):
    return save_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), seed=3)
