"""``--dtype`` for Hugging Face checkpoints (``runtime.placement.weights_dtype``): the weights and
the KV cache in bfloat16 on the CPU, whose greedy tokens agree with float32's, and float32 the
reference; loaders built in float32 only refuse any other explicit dtype."""

from __future__ import annotations

import pytest
import torch

from ifb.capabilities import DeployConfig
from ifb.llm import LLM
from ifb.params import SamplingParams
from ifb_plugins.common.runtime.placement import float32_only, weights_dtype
from tests.models.converted import save_tiny_dense

PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4", "ifb serves models"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
#: of the greedy tokens bfloat16 decodes, the share that equals float32's (position by position; a
#: tiny random model's logits lie close together, so one flip late in a sequence is allowed for)
AGREEMENT = 0.75


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return save_tiny_dense(tmp_path_factory.mktemp("dtype") / "qwen2", "qwen2", seed=4)


def greedy(path, **settings) -> tuple[list[list[int]], torch.dtype, torch.dtype]:
    with LLM(str(path), device="cpu", **settings) as llm:
        runtime = llm.deployment.runtime
        outputs = llm.generate(PROMPTS, GREEDY)
        return ([list(o.token_ids) for o in outputs], next(runtime.model.parameters()).dtype,
                runtime.kv_caches[0][0].dtype)


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_cuda() -> None:
    assert weights_dtype(DeployConfig(device="cpu")) == torch.float32
    assert weights_dtype(DeployConfig(device="cpu", dtype="float16")) == torch.float16
    assert float32_only(DeployConfig(device="cpu"), "x") == torch.float32
    with pytest.raises(ValueError, match="--dtype bfloat16: the mamba deployment builds its weights in float32 only"):
        float32_only(DeployConfig(device="cpu", dtype="bfloat16"), "the mamba deployment")


def test_bfloat16_weights_and_kv_agree_with_float32(qwen2) -> None:
    reference, weights, kv = greedy(qwen2)
    assert weights == kv == torch.float32
    explicit, _, _ = greedy(qwen2, dtype="float32")
    assert explicit == reference
    tokens, weights, kv = greedy(qwen2, dtype="bfloat16")
    assert weights == kv == torch.bfloat16
    assert all(t[0] == r[0] for t, r in zip(tokens, reference)), (tokens, reference)
    same = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r))
    assert same / sum(map(len, reference)) >= AGREEMENT, (tokens, reference)


def test_float32_only_deployments_refuse_bfloat16(tmp_path) -> None:
    from tests.models.hybrid import save_tiny_nemotron_h

    path = save_tiny_nemotron_h(tmp_path / "nemotron_h")
    with pytest.raises(ValueError, match="--dtype bfloat16: the hybrid Mamba deployment builds its weights in float32"):
        LLM(str(path), plugin="mamba", device="cpu", dtype="bfloat16")
