"""``benchmarks/gpu.py`` on the CPU with a tiny shape: its model saver, its ifb worker's measurement
and its table (the GPU run itself is the benchmark's, never a test's)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_are_qwen2_5s(bench) -> None:
    assert bench.SHAPES["1.5b"]["hidden_size"] == 1536 and bench.SHAPES["7b"]["num_key_value_heads"] == 4
    assert bench.run_order(["ifb", "vllm"]) == ["ifb", "vllm", "vllm", "ifb"]
    assert bench.run_order(["ifb"]) == ["ifb", "ifb"]


def test_tiny_smoke_run_on_the_cpu(bench, tmp_path) -> None:
    import torch
    import transformers

    model = bench.save_model("tiny", tmp_path)
    assert transformers.AutoConfig.from_pretrained(model).dtype == torch.bfloat16
    args = argparse.Namespace(device="cpu", dtype="auto", seats=[1, 3], prompt_len=6, decode_tokens=3)
    result = bench.run_ifb(model, args)
    assert result["device"] == "cpu" and set(result["rows"]) == {"1", "3"}
    for row in result["rows"].values():
        # numbers, not speeds: a tiny model's run times on a loaded CPU say nothing (benchmarks measure)
        assert row["prefill_tok_s"] > 0 and row["first_s"] > 0 and isinstance(row["decode_tok_s"], float)
    text = bench.table({"tiny": {"ifb": [result, json.loads(json.dumps(result))]}})
    assert text.count("| tiny |") == 2
