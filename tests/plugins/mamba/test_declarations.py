"""What the mamba plugin declares, and how the gate, the engine and the matrix act on it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ifb import LLM
from ifb.capabilities import DeployConfig, Support
from ifb.cli import main
from ifb.engine import RequestRejected
from ifb.gate import UnsupportedDeployment, check_deployment
from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb_plugins.mamba import declare

IFB = DeployConfig(plugin="mamba", enable_in_flight_batching=True, max_batch_size=4)


def test_declaration_is_stepped_seated_per_sequence_and_verified_on_cpu():
    caps = declare(IFB)
    assert caps.stepped_execution and caps.seated_admission
    assert caps.batch_invariant_verified  # tests/plugins/mamba/test_batch_invariance.py holds it
    assert caps.options["differing_sampling"].support is Support.SERVED
    assert caps.options["n_sequences"].support is Support.REJECTED
    for name in ("lora", "save_system_prompt_kv_cache", "guided_decoding", "media_under_pruner",
                 "generate_audio", "past_trajectory"):
        assert caps.options[name].support is Support.NOT_APPLICABLE, name
    # Not proven on CUDA: the declaration says so rather than promise it.
    assert not declare(DeployConfig(plugin="mamba", device="cuda")).batch_invariant_verified


def test_context_reuse_is_declared_and_passes_the_gate():
    config = DeployConfig(plugin="mamba", enable_in_flight_batching=True, enable_context_reuse=True)
    caps = declare(config)
    assert caps.supports_prefix_reuse  # tests/plugins/context_cache/test_hybrid.py holds it
    assert check_deployment(caps, config) is None


def test_a_checkpoint_interval_without_reuse_is_refused_before_loading_weights(tmp_path):
    # tmp_path holds no checkpoint: the refusal must come first.
    with pytest.raises(UnsupportedDeployment, match="--hybrid-checkpoint-interval.*--enable-context-reuse"):
        LLM(model=str(tmp_path), plugin="mamba", enable_in_flight_batching=True, hybrid_checkpoint_interval=64)


def test_the_serve_flag_reaches_the_plugin(tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--plugin", "mamba", "--enable-in-flight-batching",
                                       "--hybrid-checkpoint-interval", "64"])
    assert result.exit_code == 1
    assert "--hybrid-checkpoint-interval sets how often prefix reuse keeps the recurrent state" in result.output


def test_a_bad_checkpoint_interval_or_capacity_is_refused(hybrid_dir):
    with pytest.raises(ValueError, match="multiple of the KV block size"):
        LLM(model=str(hybrid_dir), plugin="mamba", enable_in_flight_batching=True, enable_context_reuse=True,
            hybrid_checkpoint_interval=40)
    with pytest.raises(ValueError, match="cannot hold a recurrent-state checkpoint"):
        LLM(model=str(hybrid_dir), plugin="mamba", enable_in_flight_batching=True, enable_context_reuse=True,
            max_kv_cache_capacity=64)


def test_matrix_lists_the_deployment_and_its_prefix_reuse_as_served():
    data = json.loads(CliRunner().invoke(main, ["matrix", "--format", "json"]).output)
    rows = {r["deployment"]: r for r in data["deployments"] if r["plugin"] == "mamba"}
    title = "Hybrid Mamba (Nemotron-H, Bamba, Granite 4.0 hybrid)"
    assert rows[title]["status"] == "served"
    assert rows[f"{title} + context cache (prefix reuse)"]["status"] == "served"
    requests = {r["option"]: r["status"] for r in data["requests"] if r["plugin"] == "mamba"}
    assert requests["Sampling parameters that differ from the resident batch"] == "served"
    assert requests["Per-request LoRA"] == "n/a"


def test_requests_the_engine_refuses_name_the_reason(hybrid_dir):
    with LLM(model=str(hybrid_dir), plugin="mamba", enable_in_flight_batching=True, max_batch_size=2) as llm:
        with pytest.raises(RequestRejected, match="not supported under in-flight batching.*blocking path"):
            llm.engine.submit(RequestSpec(prompt="hi", params=SamplingParams(n=2)))
        with pytest.raises(RequestRejected, match="not supported by this deployment.*No LoRA"):
            llm.engine.submit(RequestSpec(prompt="hi", extras={"lora": "x"}))
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            llm.engine.submit(RequestSpec(prompt_token_ids=(1, 5000)))
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert out.num_output_tokens == 4 and out.finish_reason == "length"


def test_blocking_path_serves_n_sequences_one_after_another(hybrid_dir):
    """The blocking path has one seat: an n > 1 request's sequences take it in turn (more than the state's
    seats too), each seeded seed + i, and the request ends with the last of them."""
    with LLM(model=str(hybrid_dir), plugin="mamba", max_batch_size=2) as llm:
        outputs = list(llm.engine.submit(RequestSpec(prompt="The quick brown fox", params=SamplingParams(
            n=3, seed=5, max_tokens=3, ignore_eos=True))))
        assert {o.index for o in outputs} == {0, 1, 2} and outputs[-1].finished
        assert [o.finished for o in outputs].count(True) == 1
        alone = [llm.engine.submit(RequestSpec(prompt="The quick brown fox", params=SamplingParams(
            seed=5 + i, max_tokens=3, ignore_eos=True))).result().token_ids for i in range(3)]
        assert [tuple(t for o in outputs if o.index == i for t in o.token_ids) for i in range(3)] == alone
        assert llm.health() == {"in_flight_batching": False, "max_num_seqs": 1}
