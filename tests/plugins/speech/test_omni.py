"""The Qwen3-Omni deployment against transformers' Qwen3OmniMoeForConditionalGeneration on the same tiny weights."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile
import torch
from starlette.testclient import TestClient

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.engine import RequestRejected
from ifb.params import RequestSpec, SamplingParams
from ifb.server.app import build_app

from .omni_reference import omni_tokenizer

TOKENIZER = omni_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
MESSAGES = [{"role": "user", "content": "Say hi."}]
PROMPT = TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)


def deploy(path, in_flight: bool):
    return load_deployment(DeployConfig(model=str(path), plugin="omni", enable_in_flight_batching=in_flight,
                                        options={"max_audio_frames": 9}))


@pytest.fixture(scope="module")
def text_only(omni_reference_model):
    deployment = deploy(omni_reference_model[0], in_flight=True)
    with TestClient(build_app(deployment, model_name="omni"), base_url="http://localhost") as client:
        yield deployment, client
    deployment.shutdown()


@pytest.fixture(scope="module")
def speaking(omni_reference_model):
    deployment = deploy(omni_reference_model[0], in_flight=False)
    with TestClient(build_app(deployment, model_name="omni"), base_url="http://localhost") as client:
        yield deployment, client
    deployment.shutdown()


def thinker_parameters(model, *parts: str) -> int:
    return sum(t.numel() for name, t in model.thinker.state_dict().items() if name.startswith(parts))


def test_thinker_tokens_equal_the_reference_under_in_flight_batching(omni_reference_model, text_only):
    _, model = omni_reference_model
    deployment, _ = text_only
    expected = model.thinker.generate(input_ids=torch.tensor([PROMPT]), do_sample=False, max_new_tokens=6,
                                      eos_token_id=IM_END)[0, len(PROMPT):].tolist()
    handles = [deployment.engine.submit(RequestSpec(prompt_token_ids=tuple(PROMPT),
                                                    params=SamplingParams(temperature=0, max_tokens=6)))
               for _ in range(2)]  # two at once: batched, each equal to the reference alone
    for handle in handles:
        assert list(handle.result().token_ids) == expected


def test_under_the_flag_only_the_thinker_is_loaded_and_speech_is_refused(omni_reference_model, text_only):
    _, model = omni_reference_model
    deployment, client = text_only
    # the Thinker: its text decoder, audio encoder and vision encoder
    assert deployment.runtime.num_parameters() == {
        "thinker": thinker_parameters(model, "model.language_model.", "lm_head."),
        "audio_encoder": thinker_parameters(model, "model.audio_tower."),
        "vision_encoder": thinker_parameters(model, "model.visual."), "talker": 0, "code2wav": 0}
    with pytest.raises(RequestRejected, match="blocking path"):
        deployment.engine.submit(RequestSpec(prompt_token_ids=tuple(PROMPT), extras={"generate_audio": True}))
    response = client.post("/v1/audio/speech", json={"input": "Hello there", "voice": "ethan"})
    assert response.status_code == 400 and "--enable-in-flight-batching" in response.json()["error"]["message"]
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] is not None
    spoken = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                        "modalities": ["text", "audio"]})
    assert spoken.status_code == 400 and "blocking path" in spoken.json()["error"]["message"]
    image = client.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]})
    assert image.status_code == 400 and "not an image Pillow can read" in image.json()["error"]["message"]


def test_spoken_reply_equals_the_reference_end_to_end(omni_reference_model, speaking):
    """Thinker (greedy) -> Talker (greedy) -> Code2Wav, as Qwen3OmniMoeForConditionalGeneration.generate."""
    _, model = omni_reference_model
    deployment, _ = speaking
    sequences, wav = model.generate(input_ids=torch.tensor([PROMPT]), speaker="ethan", thinker_do_sample=False,
                                    talker_do_sample=False, thinker_max_new_tokens=6, talker_max_new_tokens=9,
                                    thinker_eos_token_id=IM_END)
    spec = RequestSpec(prompt_token_ids=tuple(PROMPT), params=SamplingParams(temperature=0, max_tokens=6),
                       extras={"generate_audio": True, "audio": {"voice": "Ethan", "format": "pcm", "max_frames": 9}})
    final = deployment.engine.submit(spec, wait=True).result()
    assert list(final.token_ids) == sequences[0, len(PROMPT):].tolist()
    samples = np.frombuffer(final.audio.data, dtype="<i2").astype(np.float32) / 32767.0
    expected = wav[0, 0].numpy()
    assert samples.shape == expected.shape and samples.size > 0
    assert np.abs(samples - expected).max() <= 1e-4  # 16-bit rounding is 1.5e-5


def test_the_routes_speak_on_the_blocking_path(speaking):
    deployment, client = speaking
    assert sorted(deployment.runtime.voices) == ["chelsie", "ethan"]  # the config's speaker_id names
    chat = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 4, "seed": 1, "modalities": ["text", "audio"],
        "audio": {"voice": "chelsie", "format": "wav"}})
    assert chat.status_code == 200
    message = chat.json()["choices"][0]["message"]
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message["audio"]["data"])))
    assert rate == 24000 and samples.size > 0 and message["audio"]["transcript"] == message["content"]
    speech = client.post("/v1/audio/speech", json={"input": "Hello there", "voice": "ethan",
                                                   "response_format": "flac", "seed": 2})
    assert speech.status_code == 200 and speech.headers["content-type"] == "audio/flac"
    assert speech.content[:4] == b"fLaC"
    bad = client.post("/v1/audio/speech", json={"input": "Hello there", "voice": "vivian"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "voice"
    assert "unknown voice 'vivian'" in bad.json()["error"]["message"]


def test_generate_audio_says_the_text_on_an_omni_deployment(speaking):
    from ifb_plugins.speech import generate_audio

    wav = generate_audio(speaking[0], "Hello there", "chelsie", format="wav", seed=3)
    samples, rate = soundfile.read(io.BytesIO(wav))
    assert rate == 24000 and samples.size > 0


def test_media_input_is_served_on_the_blocking_path_too(text_only, speaking):
    from .test_omni_audio import audio_chat
    from .test_omni_image import SIZES, image_chat

    clip = audio_chat(1, 0.3).messages[0]["content"][0]
    spec = image_chat(2, SIZES[0], audio=clip)
    batched = text_only[0].engine.submit(spec, wait=True).result()
    alone = speaking[0].engine.submit(spec, wait=True).result()
    assert alone.token_ids == batched.token_ids and len(alone.token_ids) == 6


def test_guided_requests_join_the_thinkers_running_batch(text_only):
    import re

    deployment, _ = text_only
    fmt = {"type": "regex", "regex": "[a-z]{2,5}-[0-9]{2}"}
    guided = RequestSpec(prompt_token_ids=tuple(PROMPT), params=SamplingParams(temperature=0, max_tokens=12),
                         extras={"response_format": fmt})
    alone = deployment.engine.submit(guided, wait=True).result()
    plain = RequestSpec(prompt_token_ids=tuple(PROMPT), params=SamplingParams(temperature=0, max_tokens=12,
                                                                               ignore_eos=True))
    stalls = deployment.engine.counters.stalls["stalls_guided"]
    handles = [deployment.engine.submit(spec, wait=True) for spec in (plain, guided, plain)]
    results = [h.result() for h in handles]
    assert re.fullmatch(fmt["regex"], results[1].text) and results[1].token_ids == alone.token_ids
    assert deployment.engine.counters.stalls["stalls_guided"] == stalls
