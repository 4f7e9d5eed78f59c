"""The worked example of docs/plugins.md: a third-party plugin on the shared layer, end to end.

The example is the fixture package's ``ifb_echo/persona.py`` (installed with pip by
tests/core/test_plugins_and_matrix.py), shown verbatim in the docs. Here it is registered in a plugin
host, its setting given as an ``LLM`` keyword would be, and its deployment served under in-flight
batching: a chat without a system message gets the persona, exactly as if the user had sent it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.params import RequestSpec, SamplingParams
from ifb.plugins import PluginHost
from tests.models.text import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests" / "fixtures" / "ifb_echo_plugin" / "ifb_echo" / "persona.py"
PERSONA = "You answer in one sentence."
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def persona_plugin():
    spec = importlib.util.spec_from_file_location("ifb_echo_persona", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("persona") / "hf", "llama", seed=5)


def test_the_docs_show_the_example_verbatim() -> None:
    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in docs


def _chat(deployment, messages) -> list[int]:
    spec = RequestSpec(messages=tuple(messages), params=GREEDY)
    return list(deployment.engine.submit(spec, wait=True).result().token_ids)


def test_the_example_serves_a_chat_with_its_persona(persona_plugin, checkpoint: Path) -> None:
    host = PluginHost(extra_plugins=(persona_plugin,))
    assert [s.name for s in host.deploy_settings() if s.name == "persona"] == ["persona"]
    options = host.setting_options({"persona": PERSONA})
    config = dict(model=str(checkpoint), enable_in_flight_batching=True, max_batch_size=4)
    persona = load_deployment(DeployConfig(plugin="persona", options=options, **config), host)
    text = load_deployment(DeployConfig(plugin="text", **config), host)
    try:
        assert type(persona.runtime).__name__ == "PersonaRuntime" and persona.engine.is_in_flight
        user = {"role": "user", "content": "Where is the lighthouse?"}
        system = {"role": "system", "content": PERSONA}
        other = {"role": "system", "content": "You speak French."}
        assert _chat(persona, [user]) == _chat(text, [system, user])
        assert _chat(persona, [other, user]) == _chat(text, [other, user])  # a chat's own system message stays
        alone = RequestSpec(messages=(user,), params=GREEDY)  # the persona is really in the prompt
        assert persona.runtime.prepare(alone).prompt_token_ids == text.runtime.prepare(
            RequestSpec(messages=(system, user), params=GREEDY)).prompt_token_ids
        assert len(persona.runtime.prepare(alone).prompt_token_ids) > len(text.runtime.prepare(alone).prompt_token_ids)
    finally:
        persona.shutdown()
        text.shutdown()


def test_the_example_needs_a_model(persona_plugin) -> None:
    host = PluginHost(extra_plugins=(persona_plugin,))
    with pytest.raises(ValueError, match="no default model"):
        load_deployment(DeployConfig(plugin="persona"), host)
