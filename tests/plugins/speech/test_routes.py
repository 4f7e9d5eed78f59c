"""``/v1/audio/speech`` on a Qwen3-TTS deployment behind the real server app, and the deployment's declarations."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile
from starlette.testclient import TestClient

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.params import RequestSpec, SamplingParams
from ifb.server.app import build_app
from ifb_plugins.speech import generate_audio

TEXT = "Hello there, how are you?"
SAMPLES_PER_FRAME = 8  # the tiny speech tokenizer's decode_upsample_rate


@pytest.fixture(scope="module")
def deployment(tts_reference_model):
    deployment = load_deployment(DeployConfig(model=str(tts_reference_model[0]), plugin="tts"))
    yield deployment
    deployment.shutdown()


@pytest.fixture(scope="module")
def client(deployment):
    with TestClient(build_app(deployment, model_name="qwen3-tts"), base_url="http://localhost") as client:
        yield client


def speak(client, **body):
    return client.post("/v1/audio/speech", json={"model": "qwen3-tts", "input": TEXT, "voice": "vivian",
                                                 "seed": 7, **body})


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


@pytest.fixture(scope="module")
def pcm(client):
    response = speak(client, response_format="pcm")
    assert response.status_code == 200 and response.headers["content-type"] == "audio/pcm"
    return pcm_samples(response.content)


def test_pcm_is_the_utterance_at_24_khz(pcm):
    assert pcm.size > 0 and pcm.size % SAMPLES_PER_FRAME == 0 and np.abs(pcm).max() > 0


@pytest.mark.parametrize("fmt, media_type", [("wav", "audio/wav"), ("flac", "audio/flac"), ("opus", "audio/ogg")])
def test_each_container_holds_the_same_audio(client, deployment, pcm, fmt, media_type):
    response = speak(client, response_format=fmt)
    assert response.status_code == 200 and response.headers["content-type"] == media_type
    streamed = response.content
    whole = generate_audio(deployment, TEXT, "vivian", format=fmt, seed=7)  # one file, its length in the header
    samples, rate = soundfile.read(io.BytesIO(whole), dtype="float32")
    assert rate == 24000
    if fmt == "opus":  # lossy, with the codec's own delay: the length is what can be checked
        assert abs(samples.size - pcm.size) <= 24000 // 50 and streamed[:4] == b"OggS"
        return
    assert samples.shape == pcm.shape and np.abs(samples - pcm).max() <= 1.0 / 32767 + 1e-6
    # The stream's header says "length unknown" (it was sent before the length was); the rest is the same file.
    assert len(streamed) == len(whole) and streamed[64:] == whole[64:] and streamed[:4] == whole[:4]


def test_mp3_is_the_default_format(client, pcm):
    response = client.post("/v1/audio/speech", json={"input": TEXT, "voice": "vivian", "seed": 7})
    assert response.status_code == 200 and response.headers["content-type"] == "audio/mpeg"
    data = response.content
    assert data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)  # an MPEG frame sync


def test_speed_scales_the_duration(client, pcm):
    fast = pcm_samples(speak(client, response_format="pcm", speed=2.0).content)
    assert abs(fast.size - pcm.size / 2) <= 2 * SAMPLES_PER_FRAME


def test_sse_streams_base64_deltas_then_done(client, pcm):
    response = speak(client, response_format="pcm", stream_format="sse")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert np.abs(pcm_samples(audio) - pcm).max() <= 1.0 / 32767 + 1e-6


def test_audio_is_sent_as_its_codes_are_decoded(deployment, pcm):
    """Chunks leave the runtime while the talker is still speaking, and add up to the same audio."""
    runtime = deployment.runtime
    runtime.stream_frames = 4
    try:
        spec = RequestSpec(prompt=TEXT, params=SamplingParams(max_tokens=1, seed=7), extras={
            "generate_audio": True, "audio": {"voice": "vivian", "format": "pcm", "stream": True}})
        outputs = list(deployment.engine.submit(spec, wait=True))
    finally:
        runtime.stream_frames = type(runtime).stream_frames
    chunks = [out.audio_chunk for out in outputs if out.audio_chunk]
    num_frames = outputs[-1].audio.num_frames
    assert len(chunks) == -(-num_frames // 4) >= 2
    assert len(chunks[0]) == 4 * SAMPLES_PER_FRAME * 2  # the first 4 frames, before the others were made
    assert not outputs[0].finished
    assert np.abs(pcm_samples(b"".join(chunks)) - pcm).max() <= 1.0 / 32767 + 1e-6


@pytest.mark.parametrize("body, param, message", [
    ({"voice": "nobody"}, "voice", "unknown voice 'nobody'"),
    ({"language": "klingon"}, "language", "unknown language"),
    ({"response_format": "aac"}, "response_format", "supported formats: mp3, opus, flac, wav, pcm"),
    ({"speed": 9}, "speed", "between 0.25 and 4.0"),
    ({"stream_format": "video"}, "stream_format", "audio, sse"),
    ({"input": " "}, "input", "must not be empty"),
])
def test_bad_requests_are_400s_naming_the_field(client, body, param, message):
    response = speak(client, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_models_lists_the_speech_endpoint_and_chat_is_not_served(client):
    assert client.get("/v1/models").status_code == 200
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
