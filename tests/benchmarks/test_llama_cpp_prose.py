"""The llama.cpp comparison's table and ranges, in both READMEs, are what ``benchmarks/vs_llama_cpp.py``
renders from the committed summary (``benchmarks/vs_llama_cpp.json``); a cell inside the run-to-run
spread is a tie."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vs_llama_cpp():
    spec = importlib.util.spec_from_file_location("vs_llama_cpp", ROOT / "benchmarks" / "vs_llama_cpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def summary(vs_llama_cpp):
    return json.loads(vs_llama_cpp.SUMMARY.read_text())


def test_the_committed_readmes_are_what_the_summary_renders(vs_llama_cpp, summary):
    for path, text in vs_llama_cpp.published_texts(summary).items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs from what vs_llama_cpp.py renders from vs_llama_cpp.json: "
            "run `python benchmarks/vs_llama_cpp.py --table-only benchmarks/vs_llama_cpp.json --publish`")


def runs(*rates: float) -> list[dict]:
    return [{"output_tokens_per_s": r} for r in rates]


def test_a_ratio_inside_either_servers_spread_is_a_tie(vs_llama_cpp):
    # the 3B file's batch 1: ifb's two runs differ by 3.6 %, the ratio is 1.03
    assert vs_llama_cpp.is_tie({"ifb": runs(15.75, 16.32), "llama.cpp": runs(15.63, 15.56)})
    assert not vs_llama_cpp.is_tie({"ifb": runs(35.9, 33.3), "llama.cpp": runs(26.5, 30.0)})
    assert vs_llama_cpp.is_tie({"ifb": runs(10.0, 10.0), "llama.cpp": runs(10.0, 10.0)})


def test_ties_are_not_counted_as_wins_in_the_table_or_the_ranges(vs_llama_cpp, summary):
    table, prose = vs_llama_cpp.render(summary), vs_llama_cpp.render_prose(summary)
    assert "(1.03x, tie)" in table and "**1.03x**" not in table
    assert "1.03" not in prose.split("(a tie")[0]  # the range of wins starts above it
    changed = copy.deepcopy(summary)  # widen llama.cpp's spread on a winning cell until it is a tie
    model = next(m for m in changed["models"] if m["model"] == "default")
    model["workloads"]["batch1"]["llama.cpp"][0]["output_tokens_per_s"] = 400.0
    assert "SmolLM2-135M-Instruct (Q4_1, real weights), batch1" in vs_llama_cpp.render_prose(changed)
