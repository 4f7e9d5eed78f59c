"""The speech deployments behind the real server app: /v1/audio/speech, chat audio, /v1/models."""

from __future__ import annotations

import base64
import io
import json
import wave
from types import SimpleNamespace

import openai
import pytest
from starlette.testclient import TestClient

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.server.app import build_app
import ifb_plugins.speech as speech_plugin
from ifb_plugins.speech import audio
from ifb_plugins.speech.testing import save_tiny_omni_checkpoint

HOP = 480


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return save_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni"), seed=5)


@pytest.fixture(scope="module")
def tts_dir(tmp_path_factory):
    return save_tiny_omni_checkpoint(tmp_path_factory.mktemp("tts"), seed=6, with_thinker=False)


def _client(model_dir, plugin, in_flight=False):
    deployment = load_deployment(DeployConfig(model=str(model_dir), plugin=plugin,
                                              enable_in_flight_batching=in_flight))
    return deployment, TestClient(build_app(deployment, model_name="speechy"), base_url="http://localhost")


@pytest.fixture(scope="module")
def omni(omni_dir):
    deployment, client = _client(omni_dir, "omni")
    with client:
        yield client
    deployment.shutdown()


@pytest.fixture(scope="module")
def omni_ifb(omni_dir):
    deployment, client = _client(omni_dir, "omni", in_flight=True)
    with client:
        yield client
    deployment.shutdown()


@pytest.fixture(scope="module")
def tts(tts_dir):
    deployment, client = _client(tts_dir, "tts")
    with client:
        yield client
    deployment.shutdown()


def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=client, max_retries=0)


def frames(data: bytes) -> tuple[int, int, int, int]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()


def endpoints(client: TestClient) -> list[str]:
    return client.get("/v1/models").json()["data"][0]["capabilities"]["endpoints"]


@pytest.mark.parametrize("which", ["omni", "tts"])
def test_speech_endpoint_on_the_default_path(which, request):
    client = request.getfixturevalue(which)
    reply = oai(client).audio.speech.create(model="speechy", voice="echo", input="Hello from the server.",
                                            response_format="wav")
    rate, channels, width, num_frames = frames(reply.content)
    assert (rate, channels, width) == (24000, 1, 2) and num_frames > 0 and num_frames % HOP == 0
    assert reply.response.headers["content-type"] == "audio/wav"
    pcm = client.post("/v1/audio/speech", json={"model": "speechy", "voice": "echo",
                                                "input": "Hello from the server.", "response_format": "pcm"})
    assert pcm.status_code == 200 and pcm.headers["content-type"] == "audio/pcm"
    assert len(pcm.content) == 2 * num_frames
    assert "audio.speech" in endpoints(client)


def test_speech_endpoint_default_format_and_mp3(omni):
    reply = omni.post("/v1/audio/speech", json={"input": "Default format."})
    assert reply.status_code == 200
    assert reply.headers["content-type"] == audio.MEDIA_TYPES[audio.default_speech_format()]
    if audio.mp3_available():
        assert reply.headers["content-type"] == "audio/mpeg" and len(reply.content) > 0


def test_speech_endpoint_refuses_mp3_without_an_encoder(omni, monkeypatch):
    monkeypatch.setattr(audio, "mp3_available", lambda: False)
    reply = omni.post("/v1/audio/speech", json={"input": "x", "response_format": "mp3"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "response_format" and "supported formats: wav, pcm" in error["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"input": "hi", "voice": "nobody"}, "voice", "alloy"),
    ({"input": "hi", "response_format": "flac"}, "response_format", "supported formats"),
    ({"input": "hi", "speed": 9}, "speed", "between"),
    ({"input": "   "}, "input", "empty"),
    ({"input": "x" * 4097}, "input", "4096"),
    ({"input": "hi", "instructions": "whisper"}, "instructions", "not supported"),
    ({"input": "hi", "bogus": 1}, None, "bogus"),
    ({"voice": "alloy"}, "input", "required"),
])
def test_speech_endpoint_bad_requests(omni, body, param, words):
    reply = omni.post("/v1/audio/speech", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_speech_endpoint_unknown_model_is_404(tts):
    reply = tts.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"


def test_chat_audio_output_on_the_default_path(omni):
    reply = oai(omni).chat.completions.create(
        model="speechy", messages=[{"role": "user", "content": "Say something"}], max_tokens=6,
        temperature=0, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    message = reply.choices[0].message
    assert message.audio is not None and message.audio.id.startswith("audio_")
    assert message.audio.transcript == message.content
    assert frames(base64.b64decode(message.audio.data))[:3] == (24000, 1, 2)


def test_streamed_chat_carries_the_audio_on_its_last_chunk(omni):
    reply = omni.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6, "temperature": 0,
        "stream": True, "modalities": ["text", "audio"]})
    chunks = [json.loads(line[len("data: "):]) for line in reply.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    with_audio = [d for d in deltas if "audio" in d]
    assert len(with_audio) == 1 and with_audio[0] is deltas[-1]
    assert with_audio[0]["audio"]["transcript"] == "".join(d.get("content", "") for d in deltas)
    assert frames(base64.b64decode(with_audio[0]["audio"]["data"]))[0] == 24000


def test_under_the_flag_text_is_served_and_speech_refused(omni_ifb):
    client = oai(omni_ifb)
    text = client.chat.completions.create(model="speechy", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert text.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="speechy", voice="alloy", input="hello")
    assert "--enable-in-flight-batching" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="speechy", messages=[{"role": "user", "content": "hi"}],
                                       modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    assert "generateAudio" in info.value.body["message"] and "blocking path" in info.value.body["message"]
    assert "--enable-in-flight-batching" in info.value.body["message"]
    models = omni_ifb.get("/v1/models").json()["data"][0]["capabilities"]
    assert "audio.speech" not in models["endpoints"] and "chat.completions" in models["endpoints"]
    assert models["request_options"]["generate_audio"] == "rejected"


def test_tts_has_no_text_endpoints(tts):
    assert endpoints(tts) == ["audio.speech"]
    reply = tts.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 404


def test_routes_are_added_for_speech_deployments_only():
    text = SimpleNamespace(deployment=SimpleNamespace(kind=SimpleNamespace(plugin="text")))
    assert speech_plugin.ifb_http_routes(app_state=text) == []
    omni = SimpleNamespace(deployment=SimpleNamespace(kind=SimpleNamespace(plugin="speech")))
    assert [r.path for r in speech_plugin.ifb_http_routes(app_state=omni)] == ["/v1/audio/speech"]
