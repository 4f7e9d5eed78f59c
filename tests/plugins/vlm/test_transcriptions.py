"""``/v1/audio/transcriptions`` with the ``openai`` client on a tiny Qwen2-Audio: the text is transformers' greedy
transcription of the same clip and prompt, under in-flight batching."""

from __future__ import annotations

import json

import openai
import pytest
import torch
import transformers

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.server.app import build_app
from ifb.server.transcriptions import MAX_TRANSCRIPT_TOKENS, instruction
from ifb_plugins.common.media.parts import decode_wav
from tests.models.media import wav_bytes

from tests.core.server.conftest import running
from tests.plugins.vlm import tiny
from tests.plugins.vlm.compare import hf_content, reference_inputs

CLIP = wav_bytes(5, seconds=0.6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tiny.qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"), seed=4)
    model, processor = tiny.reference(path, transformers.Qwen2AudioForConditionalGeneration)
    return path, model, processor


@pytest.fixture(scope="module")
def client(checkpoint):
    path, _, _ = checkpoint
    deployment = load_deployment(DeployConfig(model=str(path), plugin="vlm", enable_in_flight_batching=True,
                                              max_batch_size=2))
    try:
        with running(build_app(deployment, model_name="asr")) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    finally:
        deployment.shutdown()


def expected_text(checkpoint, language: str | None = None, translate: bool = False) -> str:
    _, model, processor = checkpoint
    parts = [("audio", CLIP), ("text", instruction(language, translate))]
    inputs = reference_inputs(processor, [{"role": "user", "content": hf_content(parts)}],
                              audio=[decode_wav(CLIP, "clip", 16000)], sampling_rate=16000)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TRANSCRIPT_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_transcription_equals_transformers_greedy(checkpoint, client):
    expected = expected_text(checkpoint)
    result = client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP, "audio/wav"))
    assert result.text == expected and expected
    text = client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP), response_format="text")
    assert text.strip() == expected
    srt = client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP), response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:00,600\n") and expected in srt
    verbose = client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP),
                                                 response_format="verbose_json", language="English")
    assert verbose.text == expected_text(checkpoint, "English") and verbose.duration == pytest.approx(0.6)


def test_streamed_transcription_and_translation(checkpoint, client):
    events = list(client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP), stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert events[-1].type == "transcript.text.done" and events[-1].text == deltas.strip() == expected_text(checkpoint)
    translated = client.audio.translations.create(model="asr", file=("clip.wav", CLIP))
    assert translated.text == expected_text(checkpoint, translate=True)


def test_bad_uploads_are_openai_4xx(client):
    base = str(client.base_url).rstrip("/")
    import httpx

    cases = [
        ({"files": {"file": ("x.wav", b"not audio")}}, 400, "file"),
        ({"files": {"model": (None, "asr")}}, 400, "file"),
        ({"files": {"file": ("x.wav", CLIP)}, "data": {"response_format": "yaml"}}, 400, "response_format"),
        ({"files": {"file": ("x.wav", CLIP)}, "data": {"colour": "red"}}, 400, "colour"),
        ({"files": {"file": ("x.wav", CLIP)}, "data": {"stream": "maybe"}}, 400, "stream"),
        ({"files": {"file": ("x.wav", CLIP)}, "data": {"model": "whisper-9"}}, 404, "model"),
        ({"content": json.dumps({"file": "x"}), "headers": {"content-type": "application/json"}}, 415, None),
    ]
    for kwargs, status, param in cases:
        response = httpx.post(f"{base}/audio/transcriptions", timeout=30, **kwargs)
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param
