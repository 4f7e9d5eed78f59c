"""``ifb serve`` with the real default model, driven by the official ``openai`` client.

Two servers start once for the module: one under in-flight batching (batch 4 +
queue 4) and one on the default path behind an API key.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

KEY = "e2e-key"
BATCH, QUEUE = 4, 4
STARTUP_TIMEOUT = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``python -m ifb serve ...`` in a subprocess on a loopback port."""

    def __init__(self, log_path: Path, *args: str, api_key: str | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        command = [sys.executable, "-m", "ifb", "serve", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            command += ["--api-key", api_key]
        self._log = log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the server exited ({self.process.returncode}):\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"the server did not start in time:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=120, **kwargs)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from ifb_plugins.text.default_model import resolve_model

    resolve_model(None)  # fetch once, before two servers would race for it
    logs = tmp_path_factory.mktemp("servers")
    started = [
        Server(logs / "in_flight.log", "--enable-in-flight-batching", "--max-batch-size", str(BATCH),
               "--max-queued-requests", str(QUEUE)),
        Server(logs / "default.log", "--max-queued-requests", "2", api_key=KEY),
    ]
    try:
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def ifb(servers):
    """The in-flight server; after each test its counters settle and add up."""
    server = servers[0]
    yield server
    deadline = time.monotonic() + 60
    while True:
        snap = server.health()["scheduling"]
        if snap["queued"] == 0 and snap["resident"] == 0:
            break
        assert time.monotonic() < deadline, snap
        time.sleep(0.1)
    ended = snap["completed"] + snap["cancelled"] + snap["failed"] + snap["refused"]
    assert snap["submitted"] == ended + snap["queued"] + snap["resident"], snap


@pytest.fixture
def default(servers):
    return servers[1]


def model_id(server: Server) -> str:
    return server.client().models.list().data[0].id


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_health_and_models(ifb, default):
    health = ifb.health()
    assert health["status"] == "ok" and health["in_flight_batching"] is True
    assert health["max_num_seqs"] == BATCH and "scheduling" in health
    assert default.health()["max_num_seqs"] == 1
    model = httpx.get(f"{ifb.url}/v1/models").json()["data"][0]
    assert model["id"] == health["model"] and "SmolLM2" in model["id"]
    assert model["capabilities"]["in_flight_batching"] is True
    assert set(model["capabilities"]["endpoints"]) >= {"completions", "chat.completions"}


def test_streaming_chat_and_completions(ifb):
    client, model = ifb.client(), model_id(ifb)
    whole = client.chat.completions.create(model=model, messages=chat("What is the capital of France?"),
                                           max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=chat("What is the capital of France?"),
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and "Paris" in streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pieces = list(client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                                            temperature=0, stream=True))
    assert len(pieces) >= 2 and "".join(p.choices[0].text for p in pieces).strip()
    assert pieces[-1].choices[0].finish_reason in ("length", "stop")


def test_logprobs(ifb):
    result = ifb.client().chat.completions.create(model=model_id(ifb), messages=chat("Hi"), max_tokens=4,
                                                  temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def _stream_timed(client: openai.OpenAI, model: str, index: int, start_at: float) -> tuple[float, float]:
    time.sleep(max(0.0, start_at - time.monotonic()))
    first = None
    stream = client.completions.create(model=model, prompt=f"Count from {index} upwards:", max_tokens=128,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic()
    return first, time.monotonic()


def test_eight_clients_late_arrivals_join_mid_flight(ifb):
    client, model = ifb.client(), model_id(ifb)
    before = ifb.health()["scheduling"]["admitted_mid_flight"]
    start = time.monotonic() + 0.2
    with ThreadPoolExecutor(8) as pool:
        # arrivals well inside one answer's time (128 tokens at a few ms each, even alone)
        futures = [pool.submit(_stream_timed, client, model, i, start + 0.1 * i) for i in range(8)]
        times = [f.result() for f in futures]
    assert all(first is not None for first, _ in times)
    # someone who arrived later saw its first token while an earlier request was still generating
    assert any(times[j][0] < times[i][1] for j in range(1, 8) for i in range(j))
    assert ifb.health()["scheduling"]["admitted_mid_flight"] > before


def _wait_health(server: Server, predicate, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = server.health()["scheduling"]
        if predicate(snap):
            return snap
        assert time.monotonic() < deadline, snap
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_seat(ifb):
    client, model = ifb.client(), model_id(ifb)
    before = ifb.health()["scheduling"]["cancelled"]
    stream = client.chat.completions.create(model=model, messages=chat("Tell me a long story."), max_tokens=400,
                                            stream=True, extra_body={"ignore_eos": True})
    received = [chunk for _, chunk in zip(range(4), stream)]
    assert len(received) == 4
    assert ifb.health()["scheduling"]["resident"] == 1
    stream.close()
    snap = _wait_health(ifb, lambda s: s["cancelled"] == before + 1 and s["resident"] == 0)
    assert snap["resident"] == 0


def test_full_engine_answers_429(ifb):
    client, model = ifb.client(), model_id(ifb)
    holders = [client.completions.create(model=model, prompt="Write an essay:", max_tokens=300, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(BATCH)]
    try:
        for stream in holders:  # each holder has its seat once it streams
            next(iter(stream))
        _wait_health(ifb, lambda s: s["resident"] == BATCH)

        def fire(_):
            response = httpx.post(f"{ifb.url}/v1/completions", timeout=120,
                                  json={"model": model, "prompt": "Hi", "max_tokens": 2})
            return response.status_code

        with ThreadPoolExecutor(QUEUE + 2) as pool:
            pending = [pool.submit(fire, i) for i in range(QUEUE + 2)]
            _wait_health(ifb, lambda s: s["queued"] == QUEUE)
            time.sleep(0.5)
            for stream in holders:
                stream.close()
            statuses = sorted(f.result() for f in pending)
    finally:
        for stream in holders:
            stream.close()
    assert statuses == [200] * QUEUE + [429] * 2


def test_n_above_one_is_served_on_both_paths_and_bounded_by_the_batch(ifb, default):
    texts = {0: "", 1: ""}
    for chunk in ifb.client().completions.create(model=model_id(ifb), prompt="Hi", max_tokens=4, n=2, seed=7,
                                                 stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    result = default.client().completions.create(model=model_id(default), prompt="Hi", max_tokens=4, n=2,
                                                 seed=7)
    assert sorted(c.index for c in result.choices) == [0, 1]
    # the same seeded streams, batched in flight or one after another
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [texts[0], texts[1]]
    with pytest.raises(openai.BadRequestError) as info:
        ifb.client().completions.create(model=model_id(ifb), prompt="Hi", max_tokens=2, n=BATCH + 1)
    assert "more than the batch size" in info.value.body["message"] and info.value.body["param"] == "n"


@pytest.mark.parametrize("body,param", [
    (b'{"messages": [', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "frobnicate": true}', None),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "temperature"),
])
def test_bad_requests_are_400(ifb, body, param):
    response = httpx.post(f"{ifb.url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_too_long_prompt_is_400(ifb):
    with pytest.raises(openai.BadRequestError, match="context"):
        ifb.client().completions.create(model=model_id(ifb), prompt="word " * 9000, max_tokens=2)


def test_api_key(default):
    assert httpx.get(f"{default.url}/health").status_code == 200
    assert httpx.get(f"{default.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{default.url}/v1", api_key="wrong", max_retries=0).models.list()
    chunks = list(default.client().chat.completions.create(model=model_id(default), messages=chat("Hi"),
                                                           max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"


def test_metrics_parse(ifb, default):
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{ifb.url}/metrics").text)}
    for name in ("ifb_requests_running", "ifb_requests_waiting", "ifb_time_to_first_token_seconds",
                 "ifb_inter_token_latency_seconds", "ifb_e2e_request_latency_seconds", "ifb_prompt_tokens",
                 "ifb_generation_tokens", "ifb_scheduling_submitted", "ifb_scheduling_admitted_mid_flight",
                 "ifb_scheduling_stalls_no_capacity"):
        assert name in families, name
    submitted = families["ifb_scheduling_submitted"].samples[0].value
    assert submitted == ifb.health()["scheduling"]["submitted"]
    text = httpx.get(f"{default.url}/metrics", headers=default.headers()).text
    assert any(f.name == "ifb_generation_tokens" for f in text_string_to_metric_families(text))


# ---- OpenAI conformance, tool calling, hostile input ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                   "required": ["zone"], "additionalProperties": False}}}


def test_models_retrieve(ifb):
    client = ifb.client()
    model = client.models.retrieve(model_id(ifb))
    assert model.id == model_id(ifb) and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("question", ["What is the weather like in Paris?", "Tell me a joke.", "What time is it?"])
def test_required_tool_choice_always_parses(ifb, question):
    import json

    result = ifb.client().chat.completions.create(
        model=model_id(ifb), messages=chat(question), tools=[WEATHER, CLOCK], tool_choice="required",
        max_tokens=80, temperature=0)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    else:
        assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET", "PST")
    assert result.created >= int(time.time()) - 60 and result.system_fingerprint


def test_named_tool_choice_streams_deltas(ifb):
    import json

    stream = ifb.client().chat.completions.create(
        model=model_id(ifb), messages=chat("Is it raining in Oslo?"), tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0,
        stream=True)
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or ())]
    assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id
    assert set(json.loads("".join(d.function.arguments or "" for d in deltas))) == {"city"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_answers(ifb):
    result = ifb.client().chat.completions.create(
        model=model_id(ifb), messages=chat("What is the weather like in Paris?"), tools=[WEATHER], max_tokens=40,
        temperature=0)
    message = result.choices[0].message
    assert message.content or message.tool_calls  # a small model may answer either way; both parse


def test_logprobs_with_stop(ifb):
    client, model = ifb.client(), model_id(ifb)
    prompt = "The days of the week are Monday, Tuesday,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
    tokens = free.choices[0].logprobs.tokens
    stop = "".join(tokens[3:5])  # a stop string that starts at a token boundary
    assert free.choices[0].text.index(stop) == len("".join(tokens[:3]))
    result = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=2,
                                       stop=[stop])
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and choice.text == "".join(tokens[:3])
    assert choice.logprobs.tokens == tokens[:3] and result.usage.completion_tokens == 3


@pytest.mark.parametrize("path,body,headers,status", [
    ("/v1/completions", b'{"prompt": "\\ud800"}', {}, 400),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": null}]}', {}, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                             b'"image_url": {"url": "data:image/png;base64,AA"}}]}]}', {}, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", '
                             b'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}',
     {}, 400),
    ("/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 415),
    ("/v1/completions", b'{"prompt": "x"}', {"host": "rebound.example"}, 403),
    ("/v1/completions", b'{"prompt": "x"}', {"origin": "https://evil.example"}, 403),
])
def test_hostile_requests_get_clean_errors(ifb, path, body, headers, status):
    response = httpx.post(f"{ifb.url}{path}", content=body,
                          headers={"content-type": "application/json", **headers}, timeout=30)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing_it(ifb):
    with pytest.raises(openai.BadRequestError, match="context"):
        ifb.client().completions.create(model=model_id(ifb), prompt="word " * 2_000_000, max_tokens=2)
    assert ifb.health()["status"] == "ok"
