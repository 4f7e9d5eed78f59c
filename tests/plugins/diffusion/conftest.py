"""One tiny DiffusionGemma checkpoint, written by transformers, for all the diffusion tests."""

from __future__ import annotations

import pytest

from . import reference


@pytest.fixture(scope="session")
def diffusion_reference(tmp_path_factory):
    """``(checkpoint directory, transformers' DiffusionGemmaForBlockDiffusion on the same weights)``."""
    path = tmp_path_factory.mktemp("diffusion-gemma")
    return path, reference.build(path, seed=0)
