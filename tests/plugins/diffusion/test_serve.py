"""The diffusion deployment as users meet it: its declaration, the gate, the matrix and the server."""

from __future__ import annotations

import json

import attrs
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from ifb.capabilities import DeployConfig
from ifb.cli import main
from ifb.deploy import load_deployment
from ifb.gate import UnsupportedDeployment
from ifb.server.app import build_app

from . import reference

SETTINGS = {"diffusion_t_min": 0.0, "diffusion_t_max": 1e-6}


def test_in_flight_batching_starts_and_context_reuse_is_refused_with_the_reason(diffusion_reference):
    config = DeployConfig(model=str(diffusion_reference[0]), plugin="diffusion", enable_in_flight_batching=True)
    deployment = load_deployment(config)
    try:
        assert deployment.engine.is_in_flight and deployment.blocking_reason is None
    finally:
        deployment.shutdown()
    with pytest.raises(UnsupportedDeployment, match="prompt KV is encoded for it alone"):
        load_deployment(attrs.evolve(config, enable_context_reuse=True))


def test_the_matrix_shows_it_served():
    data = json.loads(CliRunner().invoke(main, ["matrix", "--format", "json"]).output)
    rows = {r["deployment"]: r for r in data["deployments"] if r["plugin"] == "diffusion"}
    assert rows["Diffusion backbone"]["status"] == "served"
    assert rows["Diffusion backbone + context cache (prefix reuse)"]["status"] == "rejected"
    options = {r["option"]: r["status"] for r in data["requests"] if r["deployment"] == "Diffusion backbone"}
    assert options["Plain text generation, streaming, logprobs, stop strings"] == "served"
    assert options["Sampling parameters that differ from the resident batch"] == "served"
    assert options["Guided decoding (grammar / JSON)"] == "n/a"


@pytest.fixture(scope="module")
def deployment(diffusion_reference):
    deployment = load_deployment(DeployConfig(model=str(diffusion_reference[0]), plugin="diffusion",
                                              enable_in_flight_batching=True, options=dict(SETTINGS)))
    yield deployment
    deployment.shutdown()


@pytest.fixture(scope="module")
def client(deployment):
    with TestClient(build_app(deployment, model_name="tiny-diffusion"), base_url="http://localhost") as client:
        yield client


def test_completion_is_the_references_answer(diffusion_reference, client):
    ids = reference.tokenizer().encode("Hello there")
    expected = reference.generate(diffusion_reference[1], ids, seed=4, max_new_tokens=12, **reference.NEAR_ZERO)
    response = client.post("/v1/completions", json={"model": "tiny-diffusion", "prompt": "Hello there",
                                                    "max_tokens": 12, "seed": 4, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == reference.tokenizer().decode(expected, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"


def test_chat_streams_one_chunk_per_finished_block(diffusion_reference, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = reference.tokenizer()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = reference.generate(diffusion_reference[1], list(ids), seed=6, max_new_tokens=24,
                                  **reference.NEAR_ZERO)
    body = {"model": "tiny-diffusion", "messages": messages, "max_tokens": 24, "seed": 6, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    texts = [t for t in texts if t]
    assert 1 < len(texts) <= 3  # three blocks of eight tokens, at most one chunk each
    assert "".join(texts) == tok.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("extra, message", [
    ({"top_p": 0.5}, "top_p"), ({"logprobs": 1}, "logprobs"), ({"n": 2}, "One sequence per request"),
    ({"response_format": {"type": "json_object"}}, "no grammar matcher"),
])
def test_what_the_sampler_cannot_do_is_a_400(client, extra, message):
    response = client.post("/v1/completions", json={"model": "tiny-diffusion", "prompt": "Hi", "max_tokens": 4,
                                                    **extra})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
