"""The hybrid runtime's default KV pool: sized from memory by its attention layers' KV, as the text runtime's."""

from __future__ import annotations

import pytest

from ifb.capabilities import DeployConfig
from ifb_plugins.common.runtime import text as common_runtime
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from ifb_plugins.mamba.runtime import HybridRuntime, kv_bytes_per_token


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    loaded = load_hybrid_dir(hybrid_dir)
    return loaded, build_hybrid_model(loaded)


def build(hybrid, **config) -> HybridRuntime:
    loaded, model = hybrid
    return HybridRuntime(model=model, tokenizer=loaded.tokenizer, caps=None, config=DeployConfig(**config),
                         model_name="tiny")


def test_the_per_token_size_is_what_the_cache_allocates(hybrid):
    rt = build(hybrid, max_batch_size=2, max_kv_cache_capacity=64)
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in rt.cache.kv)
    assert rt.model.config.num_attention_layers == 1
    assert kv_bytes == rt.num_kv_blocks * rt.kv_block_size * kv_bytes_per_token(rt.model.config) == 4 * 256 * 16


def test_the_default_pool_is_a_tenth_of_free_host_memory_within_one_and_all_seats_contexts(hybrid, monkeypatch):
    per_token = kv_bytes_per_token(hybrid[1].config)  # 256: one attention layer, 2 KV heads of 16, float32
    monkeypatch.setattr(common_runtime, "free_memory_bytes", lambda device: 100 * 2**30)
    rt = build(hybrid, max_batch_size=16)
    assert rt.max_model_len == 2048 and rt.num_kv_blocks == 16 * 2048 // 16  # every seat's full context
    monkeypatch.setattr(common_runtime, "free_memory_bytes", lambda device: 40 * 2**20)
    rt = build(hybrid, max_batch_size=16)
    assert rt.num_kv_blocks == int(40 * 2**20 * 0.1) // per_token // 16 == 1024  # 16,384 tokens
    assert rt.cache.kv[0][0].shape[0] == 1024
    monkeypatch.setattr(common_runtime, "free_memory_bytes", lambda device: 2**20)
    assert build(hybrid, max_batch_size=16).num_kv_blocks == 2048 // 16  # never below one full context
    assert build(hybrid, max_batch_size=16, max_kv_cache_capacity=100).num_kv_blocks == 7  # the flag wins


def test_a_model_without_attention_layers_takes_every_seats_context():
    assert common_runtime.kv_capacity_tokens(DeployConfig(max_batch_size=3), 2048, 0) == 3 * 2048
