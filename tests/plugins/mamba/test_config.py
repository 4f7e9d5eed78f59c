"""config.json in every spelling: what transformers 5.24 writes, the hub's, legacy keys, absent fields, bad ones."""

from __future__ import annotations

import json
import math

import pytest
import transformers

from ifb_plugins.mamba.config import ConfigError, HybridConfig
from ifb_plugins.mamba.loader import load_hybrid_dir


@pytest.fixture(scope="module")
def written(hybrid_dir) -> dict:
    """The config.json transformers wrote for the tiny NemotronHForCausalLM."""
    return json.loads((hybrid_dir / "config.json").read_text())


def test_the_config_transformers_writes_loads(written, hybrid_dir):
    # What transformers 5.24 writes: the list spelling and its JSON encoding of infinity.
    assert "hybrid_override_pattern" not in written and written["layers_block_type"][0] == "linear_attention"
    assert written["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    c = load_hybrid_dir(hybrid_dir).config
    assert (c.pattern, c.time_step_limit, c.n_groups, c.head_dim) == ("M-M*-M-", (0.0, math.inf), 2, 16)


def _hub_spelling(written: dict) -> dict:
    hub = {k: v for k, v in written.items() if k != "layers_block_type"}
    hub["hybrid_override_pattern"] = "M-M*-M-"
    hub["time_step_limit"] = [0.0, math.inf]
    return hub


@pytest.mark.parametrize("limit", [
    [0.0, {"__float__": "Infinity"}], [0.0, "Infinity"], ["0", "inf"], [0, 1e309], None,
])
def test_infinity_however_json_encodes_it(written, limit):
    expected = HybridConfig.from_hf_config(written)
    text = json.dumps({**_hub_spelling(written), "time_step_limit": limit})
    assert HybridConfig.from_hf_config(json.loads(text)) == expected


def test_the_hub_spelling_and_legacy_keys_read_the_same(written):
    expected = HybridConfig.from_hf_config(written)
    hub_text = json.dumps(_hub_spelling(written))
    assert "Infinity" in hub_text  # the bare JSON token the hub's files carry
    assert HybridConfig.from_hf_config(json.loads(hub_text)) == expected
    legacy = {k: v for k, v in written.items() if k not in ("n_groups", "conv_kernel", "chunk_size", "time_step_limit")}
    legacy.update(mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_dt_limit=[0.0, "Infinity"])
    assert HybridConfig.from_hf_config(legacy) == expected
    both = {**written, "hybrid_override_pattern": "M-M*-M-"}
    assert HybridConfig.from_hf_config(both) == expected
    with pytest.raises(ConfigError, match="disagree"):
        HybridConfig.from_hf_config({**written, "hybrid_override_pattern": "MMM*-M-"})


_MINIMAL = {
    "nemotron_h": ({"hybrid_override_pattern": "M*-"}, transformers.NemotronHConfig,
                   dict(n_groups="n_groups", conv_kernel="conv_kernel", chunk_size="chunk_size",
                        head_dim="head_dim", num_kv_heads="num_key_value_heads", mamba_head_dim="mamba_head_dim",
                        ssm_state_size="ssm_state_size", intermediate_size="intermediate_size")),
    "bamba": ({"attn_layer_indices": [1], "num_hidden_layers": 2}, transformers.BambaConfig,
              dict(n_groups="mamba_n_groups", conv_kernel="mamba_d_conv", chunk_size="mamba_chunk_size",
                   num_kv_heads="num_key_value_heads", mamba_head_dim="mamba_d_head",
                   ssm_state_size="mamba_d_state", layer_norm_epsilon="rms_norm_eps")),
    "granitemoehybrid": ({"num_hidden_layers": 2}, transformers.GraniteMoeHybridConfig,
                         dict(n_groups="mamba_n_groups", num_kv_heads="num_key_value_heads",
                              mamba_head_dim="mamba_d_head", num_experts="num_local_experts",
                              shared_intermediate_size="shared_intermediate_size",
                              layer_norm_epsilon="rms_norm_eps", residual_multiplier="residual_multiplier")),
}


@pytest.mark.parametrize("model_type", list(_MINIMAL))
def test_absent_optional_fields_take_transformers_defaults(model_type):
    extra, hf_class, fields = _MINIMAL[model_type]
    cfg = {"model_type": model_type, "vocab_size": 100, "hidden_size": 256, **extra}
    ours, theirs = HybridConfig.from_hf_config(cfg), hf_class(**extra, vocab_size=100, hidden_size=256)
    for our_name, their_name in fields.items():
        assert getattr(ours, our_name) == getattr(theirs, their_name), our_name
    assert ours.time_step_limit == tuple(theirs.time_step_limit) == (0.0, math.inf)


@pytest.mark.parametrize("change,field", [
    ({"hidden_size": "abc"}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_attention_heads": 2.5}, "num_attention_heads"),
    ({"time_step_limit": [0.0, {"x": 1}]}, r"time_step_limit\[1\]"),
    ({"time_step_limit": 3.0}, "time_step_limit"),
    ({"time_step_limit": [1.0, 0.5]}, "time_step_limit"),
    ({"layers_block_type": ["mamba", 3]}, "layers_block_type"),
    ({"layers_block_type": ["mamba", "conv"]}, "layers_block_type"),
    ({"layers_block_type": "M*"}, "layers_block_type"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"layers_block_type": None}, "hybrid_override_pattern"),
])
def test_a_bad_field_is_named_never_a_type_error(written, change, field):
    with pytest.raises(ConfigError, match=field):
        HybridConfig.from_hf_config({**written, **change})


def test_bad_fields_of_the_other_families_are_named():
    base = {"model_type": "granitemoehybrid", "vocab_size": 100, "hidden_size": 256, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match="position_embedding_type"):
        HybridConfig.from_hf_config({**base, "position_embedding_type": "alibi"})
    with pytest.raises(ConfigError, match="rope_type"):
        HybridConfig.from_hf_config({**base, "position_embedding_type": "rope",
                                     "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="mamba_d_head"):
        HybridConfig.from_hf_config({**base, "mamba_d_head": 7})
    bamba = {"model_type": "bamba", "vocab_size": 100, "hidden_size": 256, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match="attn_layer_indices"):
        HybridConfig.from_hf_config({**bamba, "attn_layer_indices": [5]})
    with pytest.raises(ConfigError, match="JSON object"):
        HybridConfig.from_hf_config(["not", "a", "dict"])
