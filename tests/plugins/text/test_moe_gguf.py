"""Mixture-of-experts GGUF files written as llama.cpp's converter writes them, from the tiny transformers
checkpoints of test_moe_hf: the float32 path against the HF copy, the native block path against
the float32 one, and batched == alone on the native path under the engine."""

from __future__ import annotations

from pathlib import Path

import attrs
import gguf
import pytest
import torch

from ifb_plugins.common.loader import build_model, load_checkpoint
from ifb_plugins.common.testing import greedy_generate_batch
from ifb_plugins.common.testing_moe import save_tiny_moe, write_moe_gguf

Q = gguf.GGMLQuantizationType
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
PROMPTS = [[5, 17, 33, 90, 4, 200, 11, 7, 61], [3, 4, 5], list(range(10, 40)), [250, 12]]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: save_tiny_moe(tmp_path_factory.mktemp(arch), arch, seed=5) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_gguf_gives_the_hf_copys_greedy_tokens(arch: str, hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_moe_gguf(hf_dirs[arch], tmp_path / f"{arch}.gguf")
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
            "blk.0.ffn_down_exps.weight"} <= names
    assert ("blk.0.ffn_gate_inp_shexp.weight" in names) == (arch == "qwen2_moe")
    hf, ours = load_checkpoint(hf_dirs[arch]), load_checkpoint(path)
    # the only difference: the norm epsilon, stored as a float32 in GGUF
    assert attrs.evolve(ours.config, rms_norm_eps=hf.config.rms_norm_eps) == hf.config
    assert sorted(ours.state_dict) == sorted(hf.state_dict)
    assert all(torch.equal(ours.state_dict[k], hf.state_dict[k]) for k in hf.state_dict)
    assert greedy_generate_batch(build_model(ours), PROMPTS, 32) == greedy_generate_batch(build_model(hf), PROMPTS, 32)
