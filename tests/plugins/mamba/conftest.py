"""A tiny random-weight Nemotron-H checkpoint, written once per session and loaded by the real loader."""

from __future__ import annotations

import pytest

from ifb_plugins.mamba.testing import save_tiny_hybrid_checkpoint


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory):
    return save_tiny_hybrid_checkpoint(tmp_path_factory.mktemp("nemotron_h"), seed=0)
