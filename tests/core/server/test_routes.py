"""The OpenAI routes, /health and /metrics on a fake runtime behind a real uvicorn."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ifb.capabilities import EndpointSupport, OptionSupport, Support

from tests.core.fakes import FakeRuntime, FakeTokenizer, next_token, text_caps
from tests.core.server.conftest import ENDPOINTS, served, settle

TOK = FakeTokenizer()


def expected_text(prompt: str, num_tokens: int) -> str:
    ids = TOK.encode(prompt)
    out = []
    for _ in range(num_tokens):
        out.append(next_token(tuple(ids + out)))
    return TOK.decode(out)


def oai(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10)


def test_health_in_flight(server, client):
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["model"] == "fake"
    assert body["in_flight_batching"] is True and body["max_num_seqs"] == 2
    assert set(body["scheduling"]) >= {"submitted", "completed", "cancelled", "failed", "refused",
                                        "admitted_mid_flight", "stalls_incompatible", "stalls_guided",
                                        "stalls_no_capacity", "queue_latency_avg_us", "queue_latency_max_us",
                                        "queued", "resident"}


def test_health_default_path():
    with served(in_flight=False) as (url, _):
        body = httpx.get(f"{url}/health").json()
    assert body["status"] == "ok" and body["max_num_seqs"] == 1 and body["in_flight_batching"] is False


def test_models_lists_capabilities_and_adapters():
    with served(options={"lora_adapters": {"tuned": "/nowhere"}}) as (url, _):
        models = oai(url).models.list().data
        raw = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m.id for m in models] == ["fake", "tuned"]
    caps = raw[0]["capabilities"]
    assert caps["in_flight_batching"] is True
    assert caps["endpoints"] == ["completions", "chat.completions"]
    assert caps["request_options"]["n_sequences"] == "rejected"
    assert caps["request_options"]["plain_text"] == "served"
    assert raw[1]["parent"] == "fake"


def test_models_on_the_default_path_serve_what_the_flag_rejects():
    with served(in_flight=False) as (url, _):
        caps = httpx.get(f"{url}/v1/models").json()["data"][0]["capabilities"]
    assert caps["in_flight_batching"] is False and caps["max_num_seqs"] == 1
    assert caps["request_options"]["n_sequences"] == "served"


def test_completion_defaults_to_16_tokens(server):
    url, _ = server
    result = oai(url).completions.create(model="fake", prompt="hello", temperature=0)
    assert result.choices[0].text == expected_text("hello", 16)
    assert result.choices[0].finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 16)


def test_chat_without_a_limit_fills_the_context(server):
    url, deployment = server
    result = oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "hey"}])
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == deployment.runtime.max_model_len - 3
    assert result.choices[0].message.role == "assistant"


def test_streaming_chat_matches_the_whole_reply(server):
    url, _ = server
    client = oai(url)
    messages = [{"role": "user", "content": "stream me"}]
    whole = client.chat.completions.create(model="fake", messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == expected_text("stream me", 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion(server):
    url, _ = server
    chunks = list(oai(url).completions.create(model="fake", prompt="abc", max_tokens=5, stream=True, temperature=0))
    assert "".join(c.choices[0].text for c in chunks) == expected_text("abc", 5)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(server, client):
    with client.stream("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    assert json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"


def test_chat_logprobs_shape(server):
    url, _ = server
    result = oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=3, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == 3
    assert content[0].token == result.choices[0].message.content[0]
    assert content[0].bytes == list(content[0].token.encode())
    assert len(content[0].top_logprobs) == 2 and content[0].logprob <= 0


def test_completion_logprobs_shape(server):
    url, _ = server
    result = oai(url).completions.create(model="fake", prompt="x", max_tokens=3, logprobs=1)
    lp = result.choices[0].logprobs
    assert "".join(lp.tokens) == result.choices[0].text
    assert len(lp.token_logprobs) == 3 and lp.text_offset == [0, 1, 2]
    assert all(token in top for token, top in zip(lp.tokens, lp.top_logprobs))


def test_stop_strings_and_stop_token_ids(server):
    url, _ = server
    client = oai(url)
    full = expected_text("hello", 8)
    result = client.completions.create(model="fake", prompt="hello", max_tokens=8, stop=[full[3:5]])
    assert result.choices[0].text == full[:3] and result.choices[0].finish_reason == "stop"
    third = TOK.encode(full[2])[0]
    result = client.completions.create(model="fake", prompt="hello", max_tokens=8,
                                       extra_body={"stop_token_ids": [third], "top_k": 5, "min_p": 0.0,
                                                   "repetition_penalty": 1.0, "ignore_eos": True})
    assert result.choices[0].finish_reason == "stop" and result.usage.completion_tokens <= 3


def test_prompt_token_ids(server):
    url, _ = server
    result = oai(url).completions.create(model="fake", prompt=[8, 5, 12], max_tokens=3)
    assert result.choices[0].text == expected_text("hel", 3)


def test_n_sequences_on_the_default_path():
    with served(in_flight=False) as (url, _):
        result = oai(url).completions.create(model="fake", prompt="hi", max_tokens=3, n=2, seed=1, temperature=1)
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 6 and result.usage.prompt_tokens == 2


def test_best_of_returns_n_choices_and_refuses_a_stream():
    with served(in_flight=False) as (url, _):
        client = oai(url)
        result = client.completions.create(model="fake", prompt="hi", max_tokens=3, n=2, best_of=3, seed=1,
                                           temperature=1)
        assert [c.index for c in result.choices] == [0, 1] and all(c.logprobs is None for c in result.choices)
        with pytest.raises(openai.BadRequestError, match="best_of cannot be used with stream") as info:
            client.completions.create(model="fake", prompt="hi", best_of=2, stream=True)
        assert info.value.body["param"] == "best_of"


def test_n_sequences_rejected_under_the_flag_naming_the_blocking_path(server):
    url, deployment = server
    with pytest.raises(openai.BadRequestError) as info:
        oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], n=2)
    assert "blocking path" in info.value.body["message"]
    assert info.value.body["code"] == "unsupported_option"
    assert deployment.engine.counters.snapshot()["submitted"] == 0


def test_guided_decoding_and_audio_go_to_the_engine(server):
    url, _ = server
    client = oai(url)
    with pytest.raises(openai.BadRequestError, match="Guided decoding"):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="generateAudio"):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                       modalities=["text", "audio"])


def test_lora_by_model_name_is_rejected_under_the_flag():
    with served(options={"lora_adapters": {"tuned": "/nowhere"}}) as (url, _):
        with pytest.raises(openai.BadRequestError, match="LoRA"):
            oai(url).completions.create(model="tuned", prompt="x", max_tokens=2)


@pytest.mark.parametrize("body,status,param", [
    (b'{"prompt": ', 400, None),
    (b'{"prompt": "x", "bogus": 1}', 400, None),
    (b'{"prompt": "x", "max_tokens": "3"}', 400, "max_tokens"),
    (b'{"prompt": "x", "temperature": 3}', 400, "temperature"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "x", "n": 0}', 400, "n"),
    (json.dumps({"prompt": "x" * 600}).encode(), 400, None),
    (json.dumps({"prompt": "x" * 500, "max_tokens": 100}).encode(), 400, "max_tokens"),
    (b'{"prompt": []}', 400, None),
    (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
])
def test_bad_completion_requests(client, body, status, param):
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_chat_requests(client):
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    wrong = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages[0].content"


def test_unknown_routes_and_methods_answer_in_openai_shape(client):
    assert client.get("/v1/nothing").json()["error"]["message"] == "no route for GET /v1/nothing"
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_metrics_parse_and_follow_the_counters(server, client):
    url, deployment = server
    oai(url).completions.create(model="fake", prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        oai(url).completions.create(model="fake", prompt="hello", n=3)
    settle(deployment)
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    value = {name: f.samples[0].value for name, f in families.items() if f.type in ("counter", "gauge")}
    snap = deployment.engine.counters.snapshot()
    for name in ("submitted", "completed", "cancelled", "failed", "refused", "admitted_mid_flight",
                 "stalls_incompatible", "stalls_guided", "stalls_no_capacity", "preempted"):
        assert value[f"ifb_scheduling_{name}"] == snap[name], name
    assert value["ifb_requests_running"] == 0 and value["ifb_requests_waiting"] == 0
    assert value["ifb_prompt_tokens"] == 5 and value["ifb_generation_tokens"] == 4
    for name in ("ifb_time_to_first_token_seconds", "ifb_inter_token_latency_seconds",
                 "ifb_e2e_request_latency_seconds"):
        assert families[name].type == "histogram"
    count = {s.name: s.value for s in families["ifb_inter_token_latency_seconds"].samples}
    assert count["ifb_inter_token_latency_seconds_count"] == 3
    assert "ifb_prefix_cache_hits" in families


def test_endpoint_a_deployment_does_not_serve_is_404():
    runtime = FakeRuntime(caps=text_caps(endpoints={"chat.completions": ENDPOINTS["chat.completions"]}))
    with served(runtime=runtime) as (url, _):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert response.status_code == 404 and "does not serve /v1/completions" in response.text
        caps = httpx.get(f"{url}/v1/models").json()["data"][0]["capabilities"]
        assert caps["endpoints"] == ["chat.completions"]


def test_option_the_deployment_lacks_is_refused_on_every_path():
    caps = text_caps(endpoints=dict(ENDPOINTS),
                     options={"n_sequences": OptionSupport(Support.NOT_APPLICABLE, reason="No forks here.")})
    with served(in_flight=False, runtime=FakeRuntime(caps=caps)) as (url, _):
        with pytest.raises(openai.BadRequestError, match="No forks here"):
            oai(url).completions.create(model="fake", prompt="x", n=2)


def test_undeclared_endpoints_default_to_completions_and_chat():
    with served(runtime=FakeRuntime()) as (url, _):
        caps = httpx.get(f"{url}/v1/models").json()["data"][0]["capabilities"]
        assert caps["endpoints"] == ["completions", "chat.completions"]
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("in_flight", [True, False])
def test_endpoint_refused_under_the_flag_only(in_flight):
    endpoints = {**ENDPOINTS, "completions": EndpointSupport.REFUSED_UNDER_IFB}
    with served(in_flight=in_flight, runtime=FakeRuntime(caps=text_caps(endpoints=endpoints))) as (url, _):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        caps = httpx.get(f"{url}/v1/models").json()["data"][0]["capabilities"]
    if in_flight:
        assert response.status_code == 400 and "--enable-in-flight-batching" in response.json()["error"]["message"]
        assert caps["endpoints"] == ["chat.completions"]
    else:
        assert response.status_code == 200 and caps["endpoints"] == ["completions", "chat.completions"]
