"""Tiny random-weight hybrid models built and saved by transformers, written once per session."""

from __future__ import annotations

import pytest

from tests.models.hybrid import SAVERS, save_tiny_nemotron_h


@pytest.fixture(scope="session")
def hybrid_dir(tmp_path_factory):
    return save_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron_h"), seed=0)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, hybrid_dir):
    """One tiny checkpoint per supported family (Nemotron-H, Bamba, Granite 4.0 hybrid)."""
    dirs = {"nemotron_h": hybrid_dir}
    for family, save in SAVERS.items():
        if family not in dirs:
            dirs[family] = save(tmp_path_factory.mktemp(family), seed=1)
    return dirs


@pytest.fixture(scope="module")
def one_thread():
    """Single-threaded torch for a module: on a small shared machine OpenMP's spinning barriers make these
    tiny models' small ops (transformers' conv1d above all) many times slower with several threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
