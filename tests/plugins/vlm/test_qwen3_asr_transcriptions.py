"""``/v1/audio/transcriptions`` with the ``openai`` client on a tiny Qwen3-ASR: the text is transformers' greedy
transcription (``generate`` on ``apply_transcription_request``) of the same clip, language and prompt."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.server.app import build_app
from ifb.server.transcriptions import MAX_TRANSCRIPT_TOKENS
from ifb_plugins.common.media.parts import decode_wav
from tests.models.media import wav_bytes

from tests.core.server.conftest import running
from tests.plugins.vlm import tiny

CLIP = wav_bytes(5, seconds=1.2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tiny.qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"), seed=3)
    model, processor = tiny.reference(path, transformers.Qwen3ASRForConditionalGeneration)
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


def expected_text(checkpoint, language: str | None = None, prompt: str | None = None) -> str:
    """transformers' greedy transcription: the decoded output, after the ``language X<asr_text>`` header the
    model writes when no language is forced (the processor's ``transcription_only`` also collapses runaway
    repetitions, which the server does not)."""
    _, model, processor = checkpoint
    inputs = processor.apply_transcription_request(audio=[decode_wav(CLIP, "clip", 16000)], language=language,
                                                   prompt=prompt)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TRANSCRIPT_TOKENS, do_sample=False)
    text = processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return text.partition("<asr_text>")[2].strip() if "<asr_text>" in text else text.strip()


def test_transcription_equals_transformers_greedy(checkpoint, client):
    expected = expected_text(checkpoint)
    result = client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP, "audio/wav"))
    assert result.text == expected and expected
    forced = client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP), language="fr",
                                                prompt="Kubernetes, vLLM", response_format="verbose_json")
    assert forced.text == expected_text(checkpoint, "fr", "Kubernetes, vLLM") != expected
    assert forced.language == "fr" and forced.duration == pytest.approx(1.2)


def test_streamed_transcription(checkpoint, client):
    events = list(client.audio.transcriptions.create(model="asr", file=("clip.wav", CLIP), language="English",
                                                     stream=True))
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert events[-1].type == "transcript.text.done"
    assert events[-1].text == deltas.strip() == expected_text(checkpoint, "English")


def test_what_the_model_cannot_do_is_an_openai_400(client):
    base = str(client.base_url).rstrip("/")
    for path, data, param in (("audio/transcriptions", {"language": "klingon"}, "language"),
                              ("audio/translations", {}, None)):
        response = httpx.post(f"{base}/{path}", files={"file": ("x.wav", CLIP)}, data=data, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
