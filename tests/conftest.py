"""Hooks every test directory shares."""

from __future__ import annotations

import pytest

from tests.native import require_native_kernels


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``native_kernels`` (``tests.native.needs_kernels``) fails, naming the compiler's
    error, where the native kernels do not build or load; one marked ``gpu`` is skipped, with that
    reason, where torch sees no CUDA device."""
    if item.get_closest_marker("native_kernels") is not None:
        require_native_kernels()
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def llama_cpp_families(tmp_path_factory: pytest.TempPathFactory):
    """Every family's tiny transformers checkpoint and its GGUF files from llama.cpp's converter,
    made once per session (``tests/models/converted.py``)."""
    from tests.models.converted import convert_families

    return convert_families(tmp_path_factory.mktemp("llama-cpp"))
