"""API keys, plugin routes through ``ifb_http_routes``, and the ``ifb serve`` command."""

from __future__ import annotations

import httpx
import openai
import pytest
from click.testing import CliRunner
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ifb import hookimpl
from ifb.cli import main
from ifb.engine import EngineFull
from ifb.params import RequestSpec, SamplingParams
from ifb.plugins import PluginHost
from ifb.server.guard import GuardConfig

from tests.core.server.conftest import make_deployment, served

KEY = "sekrit"


def test_api_key_guards_every_route_but_health():
    with served(api_key=KEY) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            response = httpx.request(method, f"{url}{path}", json={"prompt": "x"})
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model="fake", prompt="x", max_tokens=2).usage.completion_tokens == 2


class EchoRoutes:
    """A plugin adding a route that uses the app state's helpers."""

    @hookimpl
    def ifb_http_routes(self, app_state):
        async def echo(request: Request):
            body = await request.json()
            if "prompt" not in body:
                return app_state.error_response(400, "prompt is required", param="prompt")
            handle = await app_state.submit(
                RequestSpec(prompt=body["prompt"], params=SamplingParams(max_tokens=3, temperature=0)))
            text = "".join([out.text async for out in handle])
            return JSONResponse({"model": app_state.model_name, "text": text})

        return [Route("/v1/echo", echo, methods=["POST"])]


def test_plugins_add_routes_behind_the_same_key():
    host = PluginHost(extra_plugins=(EchoRoutes(),))
    with served(api_key=KEY, host=host) as (url, deployment):
        assert httpx.post(f"{url}/v1/echo", json={"prompt": "abc"}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        response = httpx.post(f"{url}/v1/echo", json={"prompt": "abc"}, headers=auth)
        assert response.status_code == 200 and len(response.json()["text"]) == 3
        missing = httpx.post(f"{url}/v1/echo", json={}, headers=auth)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    assert deployment.engine.counters.snapshot()["completed"] == 1


def invoke(*args: str):
    return CliRunner().invoke(main, ["serve", *args])


def test_unknown_plugin_exits_with_the_reason():
    result = invoke("--plugin", "no-such-plugin")
    assert result.exit_code == 1
    assert "no deployment kind 'no-such-plugin'" in result.output
    assert "Traceback" not in result.output


def test_refused_flag_exits_with_the_gate_reason():
    result = invoke("--enable-in-flight-batching", "--max-batch-size", "100000")
    assert result.exit_code == 1
    assert "cannot enable in-flight batching" in result.output and "max_batch_size" in result.output
    assert "Traceback" not in result.output


def test_unknown_model_exits_with_the_reason(tmp_path):
    result = invoke(str(tmp_path / "missing-model"))
    assert result.exit_code == 1 and "unknown model" in result.output


@pytest.mark.parametrize("value", ["noequals", "=dir", "name=/definitely/not/here"])
def test_bad_lora_values_are_usage_errors(value):
    result = invoke("--lora", value)
    assert result.exit_code == 2 and "--lora" in result.output


def fake_server(monkeypatch, seen: dict) -> None:
    """``ifb serve``'s uvicorn server records its app and address in ``seen`` instead of serving."""

    def run(server):
        config = server.config
        seen["app"], seen["run"] = config.app, {"host": config.host, "port": config.port}

    monkeypatch.setattr("uvicorn.Server.run", run)


def test_serve_builds_the_config_and_runs_uvicorn(monkeypatch, tmp_path):
    seen = {}
    deployment = make_deployment()

    def fake_load(config, **kwargs):
        seen["config"], seen["load"] = config, kwargs
        return deployment

    monkeypatch.setattr("ifb.deploy.load_deployment", fake_load)
    fake_server(monkeypatch, seen)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    result = invoke("my-model", "--plugin", "text", "--max-batch-size", "3", "--enable-in-flight-batching",
                    "--max-queued-requests", "5", "--queue-timeout", "7", "--max-num-batched-tokens", "64",
                    "--enable-context-reuse", "--max-kv-cache-capacity", "4096", "--lora", f"tuned={adapter}",
                    "--served-model-name", "public-name", "--host", "127.0.0.2", "--port", "9001",
                    "--api-key", KEY, "--log-level", "warning")
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.model, config.plugin, config.max_batch_size, config.enable_in_flight_batching) == (
        "my-model", "text", 3, True)
    assert (config.max_queued_requests, config.queue_timeout, config.max_num_batched_tokens) == (5, 7.0, 64)
    assert config.enable_context_reuse and config.max_kv_cache_capacity == 4096
    assert config.options == {"lora_adapters": {"tuned": str(adapter)}, "served_model_name": "public-name"}
    assert seen["run"]["host"] == "127.0.0.2" and seen["run"]["port"] == 9001
    state = seen["app"].state.ifb
    assert state.model_name == "public-name" and state.api_key == KEY
    assert "served by in-flight batching" in result.output  # describe() is shown at start-up
    assert "listening on http://127.0.0.2:9001/v1" in result.output
    with pytest.raises(EngineFull):  # the deployment was shut down when the server stopped
        deployment.engine.submit(RequestSpec(prompt="x"))


def test_serve_defaults(monkeypatch):
    seen = {}
    monkeypatch.setattr("ifb.deploy.load_deployment", lambda config, **kwargs: seen.setdefault("config", config)
                        and make_deployment())
    fake_server(monkeypatch, seen)
    result = invoke("--log-level", "error")
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert config.model is None and config.plugin == "text" and config.max_batch_size == 4
    assert not config.enable_in_flight_batching and config.max_queued_requests == 64
    assert config.queue_timeout == 60.0 and config.max_num_batched_tokens == 256
    assert seen["run"]["host"] == "127.0.0.1" and seen["run"]["port"] == 8000


@pytest.mark.parametrize("args,expected", [
    ((), GuardConfig()),
    (("--host", "0.0.0.0"), GuardConfig(check_host=False)),
    (("--host", "0.0.0.0", "--allowed-hosts", "api.example", "--allowed-hosts", "*.corp.example",
      "--allowed-origins", "https://app.example", "--max-request-body-bytes", "1000"),
     GuardConfig(allowed_hosts=("api.example", "*.corp.example"), allowed_origins=("https://app.example",),
                 max_request_body_bytes=1000)),
])
def test_serve_guard_flags(monkeypatch, args, expected):
    seen = {}
    monkeypatch.setattr("ifb.deploy.load_deployment", lambda config, **kwargs: make_deployment())
    fake_server(monkeypatch, seen)
    result = invoke("--log-level", "error", *args)
    assert result.exit_code == 0, result.output
    assert seen["app"].state.guard == expected
