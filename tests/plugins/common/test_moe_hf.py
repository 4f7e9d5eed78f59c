"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) built and saved by transformers, loaded
through our HF loader: logits and greedy tokens against transformers on the same weights, the
per-expert dispatch against each row alone, and batched == alone under the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model, load_checkpoint
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.layers.moe import SparseMoE, exp_sigmoid, route
from tests.models.text import greedy_generate, greedy_generate_batch
from tests.models.moe import save_tiny_moe
from tests.helpers import submit_staggered
from tests.plugins.common.test_loaders import prefill_logits

#: name -> (arch, sizes): the three architectures with every layer sparse, and dense layers mixed in
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe-mlp_only_layers": ("qwen2_moe", {"num_layers": 3, "mlp_only_layers": [1]}),
    "qwen3_moe-sparse_step_2": ("qwen3_moe", {"decoder_sparse_step": 2}),
}
PROMPTS = [[5, 17, 33, 90, 4, 200, 11, 7, 61], [3, 4, 5], list(range(10, 40)), [250, 12]]
NEW_TOKENS = 32
TOL = 1e-4



@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Single-threaded torch: on a small shared machine OpenMP's spinning barriers make these tiny
    models' small ops several times slower with two threads than with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, LoadedCheckpoint, TextModel, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    arch, sizes = VARIANTS[request.param]
    path = save_tiny_moe(tmp_path_factory.mktemp(request.param), arch, seed=1, **sizes)
    loaded = load_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # 32 tokens every time, as ours
    return request.param, loaded, build_model(loaded), hf


def test_sparse_and_dense_layers_follow_transformers(variant) -> None:
    _, loaded, ours, hf = variant
    c = loaded.config
    assert c.num_experts == hf.config.num_experts and c.num_experts_per_tok == hf.config.num_experts_per_tok
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers] == theirs
    assert (ours.model.layers[-1].mlp.shared_expert is not None) == (c.arch == "qwen2_moe")


def test_first_step_logits_match_transformers(variant) -> None:
    _, _, ours, hf = variant
    worst = 0.0
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (prefill_logits(ours, ids) - ref).abs().max().item())
    assert worst <= TOL


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe", "mixtral"], indirect=True)
def test_greedy_tokens_match_transformers_generate(variant) -> None:
    _, _, ours, hf = variant
    with torch.no_grad():
        refs = [hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in PROMPTS]
    assert greedy_generate_batch(ours, PROMPTS, NEW_TOKENS) == refs  # ours: all four in one ragged batch
    assert [greedy_generate(ours, ids, NEW_TOKENS) for ids in PROMPTS] == refs
    assert len({t for r in refs for t in r}) > 8  # not one token forever


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_fused_layout_loads_the_same_weights(arch: str, tmp_path: Path) -> None:
    per_expert = load_checkpoint(save_tiny_moe(tmp_path / "a", arch, seed=4)).state_dict
    fused = load_checkpoint(save_tiny_moe(tmp_path / "b", arch, seed=4, fused=True)).state_dict
    assert sorted(per_expert) == sorted(fused)
    assert all(torch.equal(per_expert[k], fused[k]) for k in fused)


def test_the_dispatch_computes_each_row_as_the_reference() -> None:
    # float32 on torch: a row's last bits may follow the row count (torch's CPU matmul picks its
    # kernel by it, as for dense layers); the native path's rows are exact (test_moe_gguf)
    config = TextModelConfig(arch="qwen2_moe", vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=2, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
                             moe_intermediate_size=16, shared_expert_intermediate_size=24)
    torch.manual_seed(0)
    moe = SparseMoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(40, 32)
    with torch.no_grad():
        batched = moe(x)
        weights, ids = route(moe.gate(x), 3, normalize=False)
        assert len(set(ids.flatten().tolist())) == 8  # every expert got rows
        for i in range(x.shape[0]):
            alone = moe(x[i:i + 1])
            assert torch.allclose(alone[0], batched[i], atol=1e-6)
            # the reference: each picked expert on the row, weighted, summed in ascending expert order
            ref = sum(w * moe.experts(x[i:i + 1], int(e))[0] for w, e in zip(weights[i], ids[i]))
            ref = ref + torch.sigmoid(moe.shared_expert_gate(x[i])) * moe.shared_expert(x[i:i + 1])[0]
            assert torch.allclose(alone[0], ref, atol=1e-5)


def test_routers() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 2.9, -2.0]])
    weights, ids = route(logits, 2, normalize=False)
    assert ids.tolist() == [[1, 3], [0, 2]]  # ascending expert order
    assert torch.allclose(weights, torch.softmax(logits, -1).gather(-1, ids))
    normed, _ = route(logits, 2, normalize=True)
    assert torch.allclose(normed.sum(-1), torch.ones(2))
    top_first, ids2 = route(logits, 2, normalize=False, router="topk_softmax")
    assert ids2.tolist() == ids.tolist() and torch.allclose(top_first, normed)  # the same for softmax routers
    with pytest.raises(ValueError, match="router"):
        TextModelConfig(arch="x", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                        num_kv_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                        router="sigmoid")


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE_PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 40, 9, 23, 2, 31])]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_engine_batched_greedy_equals_each_prompt_alone(arch: str, tmp_path: Path) -> None:
    path = save_tiny_moe(tmp_path / arch, arch, seed=2)
    llm = LLM(str(path), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    try:
        specs = [RequestSpec(prompt_token_ids=tuple(ids), params=GREEDY) for ids in ENGINE_PROMPTS]
        alone = [list(llm.engine.submit(s, wait=True).result().token_ids) for s in specs]
        before = llm.health()["scheduling"]["admitted_mid_flight"]
        batched = submit_staggered(llm.engine, specs, gap_steps=2)
        assert [list(r.token_ids) for r in batched] == alone
        assert llm.health()["scheduling"]["admitted_mid_flight"] > before
        assert llm.deployment.caps.batch_invariant_verified
    finally:
        llm.close()


def test_shared_expert_gate_of_a_token_does_not_depend_on_its_step_mates() -> None:
    # torch.sigmoid's scalar tail differs in the last bit on some CPUs; the gate must not
    gates = torch.randn(1000, 1, generator=torch.Generator().manual_seed(3)) * 4
    for count in (1, 7, 48, 1000):
        column = exp_sigmoid(gates[:count])
        assert torch.equal(column, torch.cat([exp_sigmoid(gates[i:i + 1]) for i in range(count)]))
    assert torch.allclose(exp_sigmoid(gates), torch.sigmoid(gates), rtol=1e-6, atol=0)
