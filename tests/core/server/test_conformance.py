"""OpenAI conformance details, echo, /tokenize and /detokenize, and the cross-site defaults."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from ifb.server.guard import GuardConfig, host_of, is_loopback

from tests.core.server.conftest import served
from tests.core.server.test_routes import TOK, expected_text, oai


def test_created_is_per_response_and_the_fingerprint_is_set(server):
    url, _ = server
    client = oai(url)
    first = client.completions.create(model="fake", prompt="abc", max_tokens=2)
    time.sleep(1.05)
    second = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "abc"}], max_tokens=2)
    assert second.created > first.created >= int(time.time()) - 5
    assert first.system_fingerprint and first.system_fingerprint == second.system_fingerprint


def test_models_retrieve(server):
    url, _ = server
    model = oai(url).models.retrieve("fake")
    assert model.id == "fake" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        oai(url).models.retrieve("nope")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_and_usage_leave_out_the_stop_string(server, stream):
    url, _ = server
    full = expected_text("hello", 12)
    stop = full[5:8]  # a stop string of three one-character tokens
    kept = full.index(stop)
    body = dict(model="fake", prompt="hello", max_tokens=12, temperature=0, logprobs=1, stop=stop)
    if stream:
        chunks = list(oai(url).completions.create(stream=True, stream_options={"include_usage": True}, **body))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        usage = chunks[-1].usage
    else:
        result = oai(url).completions.create(**body)
        text, tokens, usage = result.choices[0].text, result.choices[0].logprobs.tokens, result.usage
    assert text == full[:kept]
    assert "".join(tokens) == text and usage.completion_tokens == kept


def test_chat_logprobs_leave_out_the_stop_string(server):
    url, _ = server
    full = expected_text("hey", 10)
    stop = full[4:6]
    result = oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "hey"}],
                                              max_tokens=10, temperature=0, logprobs=True, stop=[stop])
    content = result.choices[0].message.content
    assert content == full[:full.index(stop)]
    assert [e.token for e in result.choices[0].logprobs.content] == list(content)
    assert result.usage.completion_tokens == len(content)


def test_echo(server):
    url, _ = server
    result = oai(url).completions.create(model="fake", prompt="abc", max_tokens=3, temperature=0, echo=True)
    assert result.choices[0].text == "abc" + expected_text("abc", 3)
    pieces = list(oai(url).completions.create(model="fake", prompt=[1, 2, 3], max_tokens=3, temperature=0,
                                              echo=True, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == "abc" + expected_text("abc", 3)


def test_null_content_and_media_messages(server):
    url, _ = server
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content is null"):
        oai(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": None}])


def test_tokenize_and_detokenize(server, client):
    body = client.post("/tokenize", json={"prompt": "abc"}).json()
    assert body == {"count": 3, "max_model_len": 512, "tokens": TOK.encode("abc"), "token_strs": None}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                          "return_token_strs": True}).json()
    assert chat["tokens"] == TOK.encode("hi") and chat["token_strs"] == ["h", "i"]
    assert client.post("/detokenize", json={"tokens": TOK.encode("hello")}).json() == {"prompt": "hello"}


def test_loopback_names():
    for host in ("localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]", "api.localhost"):
        assert is_loopback(host_of(host)), host
    for host in ("evil.example", "localhost.evil.example", "10.0.0.1", "0.0.0.0", ""):
        assert not is_loopback(host_of(host)), host
    assert host_of("[::1]:8000") == "::1" and host_of("LocalHost:80") == "localhost"


def test_allowed_hosts_and_origins():
    guard = GuardConfig(allowed_hosts=("api.example", "*.corp.example"), allowed_origins=("https://app.example",))
    with served(guard=guard) as (url, _):
        with httpx.Client(base_url=url, timeout=10) as client:
            for host, status in (("api.example", 200), ("x.corp.example:8000", 200), ("other.example", 403)):
                assert client.get("/v1/models", headers={"host": host}).status_code == status, host
            # CORS from the allowed origin: the preflight and the request carry the grant
            preflight = client.options("/v1/chat/completions", headers={
                "origin": "https://app.example", "access-control-request-method": "POST",
                "access-control-request-headers": "content-type,authorization"})
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == "https://app.example"
            ok = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1},
                             headers={"origin": "https://app.example"})
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
            foreign = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1},
                                  headers={"origin": "https://evil.example"})
            assert foreign.status_code == 403 and "access-control-allow-origin" not in foreign.headers


def test_same_origin_pages_and_unchecked_hosts():
    with served(guard=GuardConfig(check_host=False)) as (url, _):
        with httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/v1/models", headers={"host": "box.lan:8000"}).status_code == 200
            same = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1},
                               headers={"host": "box.lan:8000", "origin": "http://box.lan:8000"})
            assert same.status_code == 200
