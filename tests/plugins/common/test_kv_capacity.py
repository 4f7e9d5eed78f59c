"""The KV pool's default size: sized from memory, bounded by the seats' full contexts."""

from __future__ import annotations

import torch

from ifb.capabilities import DeployConfig
from ifb_plugins.common.runtime import text as runtime
def test_the_flag_wins_and_a_runtime_without_a_size_keeps_two_k_per_seat():
    assert runtime.kv_capacity_tokens(DeployConfig(max_kv_cache_capacity=123), 8192, 1000) == 123
    assert runtime.kv_capacity_tokens(DeployConfig(max_batch_size=8), 8192) == 8 * 2048


def test_the_default_is_a_tenth_of_free_host_memory_within_one_and_all_seats_contexts(monkeypatch):
    config = DeployConfig(max_batch_size=8)
    per_token = 23040  # the default model's float16 KV: 2 x 30 layers x 3 heads x 64
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 100 * 2**30)
    assert runtime.kv_capacity_tokens(config, 8192, per_token) == 8 * 8192  # 10 GiB holds more: every seat full
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 4 * 2**30)
    assert runtime.kv_capacity_tokens(config, 8192, per_token) == int(4 * 2**30 * 0.1) // per_token  # 18,641
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 2**20)
    assert runtime.kv_capacity_tokens(config, 8192, per_token) == 8192  # never below one full context


def test_free_host_memory_is_read_from_the_system():
    free = runtime.free_memory_bytes(torch.device("cpu"))
    assert 0 < free
