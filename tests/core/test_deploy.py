"""Loading a deployment: settings a kind does not read are refused before any weights load."""

from __future__ import annotations

import pytest

from ifb import LLM, hookimpl
from ifb.capabilities import DeployConfig, DeploymentKind
from ifb.deploy import load_deployment
from ifb.gate import UnsupportedDeployment
from ifb.plugins import PluginHost

from tests.core.fakes import FakeRuntime, text_caps


class _FakePlugin:
    def __init__(self, settings: frozenset[str] | None) -> None:
        self.loaded: list[DeployConfig] = []
        self.runtime = FakeRuntime(caps=text_caps())

        def load(config: DeployConfig) -> FakeRuntime:
            self.loaded.append(config)
            return self.runtime

        self.kind = DeploymentKind(name="fake", plugin="fake", title="Fake runtime",
                                   declare=lambda c: self.runtime.caps, load=load, settings=settings)

    @hookimpl
    def ifb_deployment_kinds(self):
        return [self.kind]


def test_a_setting_the_kind_does_not_read_is_refused_before_loading() -> None:
    plugin = _FakePlugin(frozenset({"served_model_name"}))
    host = PluginHost(extra_plugins=(plugin,))
    config = DeployConfig(model="m", plugin="fake", options={"kv_cache_dtype": "float16", "served_model_name": "x"})
    with pytest.raises(UnsupportedDeployment,
                       match=r"the fake deployment does not read kv_cache_dtype \(--kv-cache-dtype\); it would "
                             r"have no effect \(its settings: served_model_name\)"):
        load_deployment(config, host)
    assert plugin.loaded == []
    # the settings it declares, and the core's own, load
    deployment = load_deployment(DeployConfig(model="m", plugin="fake", options={"served_model_name": "x",
                                                                                "warmup_prompt": ""}), host)
    assert plugin.loaded and deployment.runtime is plugin.runtime
    deployment.shutdown()


def test_a_kind_without_declared_settings_gets_every_setting() -> None:
    plugin = _FakePlugin(None)
    deployment = load_deployment(DeployConfig(model="m", plugin="fake", options={"anything": 1}),
                                 PluginHost(extra_plugins=(plugin,)))
    assert plugin.loaded[0].options == {"anything": 1}
    deployment.shutdown()


def test_built_in_kinds_refuse_what_they_would_ignore() -> None:
    kinds = {kind.name: kind for kind in PluginHost().deployment_kinds()}
    assert all(kinds[name].settings is not None for name in ("text", "vlm", "mamba", "omni", "tts"))
    # what `ifb serve` passes for the text plugin is all read by it
    assert {"quantization", "kv_cache_dtype", "lora_adapters", "served_model_name"} <= kinds["text"].settings
    assert {"visual_token_pruner", "allowed_local_media_path"} <= kinds["vlm"].settings
    # the text plugin's kernels and cache settings do not reach the other loaders: refused, not ignored
    with pytest.raises(UnsupportedDeployment, match="the mamba deployment does not read kv_cache_dtype"):
        LLM("no-such-checkpoint", plugin="mamba", kv_cache_dtype="float16")
    with pytest.raises(UnsupportedDeployment, match="the vlm deployment does not read quantization"):
        LLM("no-such-checkpoint", plugin="vlm", quantization="int8")
    with pytest.raises(UnsupportedDeployment, match="the text deployment does not read max_batch"):
        LLM(max_batch=8)  # a misspelt keyword, not a silent default
