"""``benchmarks/vs_llama_cpp_moe.py``: a model too large for both servers at once runs one server at a
time, still A-B-B-A."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("vs_llama_cpp_moe", ROOT / "benchmarks" / "vs_llama_cpp_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_servers_one_at_a_time_keep_the_a_b_b_a_order(moe):
    assert moe.phases(True) == [moe.base.ORDER]
    spans = moe.phases(False)
    assert [tuple(name for name, _ in span) for span in spans] == [("ifb",), ("llama.cpp", "llama.cpp"), ("ifb",)]
    assert [step for span in spans for step in span] == list(moe.base.ORDER)
