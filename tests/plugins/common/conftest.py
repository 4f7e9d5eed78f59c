"""Fixtures the shared layer's tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kquant_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny Qwen3-MoE: (checkpoint saved by transformers, its float32 GGUF by llama.cpp's converter,
    the same file rewritten in llama.cpp's Q4_K_M mix), made once per session
    (``tests/models/kquant_moe.py``)."""
    from tests.models.kquant_moe import convert_kquant_moe
    from tests.plugins.common.test_kquants import quantize_k

    return convert_kquant_moe(tmp_path_factory.mktemp("kquant-moe"), quantize_k)
