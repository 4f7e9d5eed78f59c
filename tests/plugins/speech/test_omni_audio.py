"""The Qwen3-Omni Thinker's audio input against transformers on the same tiny weights.

Features against its ``WhisperFeatureExtractor`` (as the processor calls it), the
audio encoder against ``Qwen3OmniMoeAudioEncoder``, the placeholder expansion
against the processor's token count, first-step logits and greedy tokens against
the Thinker with ``input_features``; under in-flight batching, audio requests
joining a running batch give their output alone.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest
import torch

from ifb import LLM
from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.models.decoder import allocate_kv_cache
from ifb_plugins.speech.omni_audio import load_audio_encoder

from tests.helpers import submit_staggered

from .omni_reference import feature_extractor, omni_tokenizer
from tests.helpers import one_seat_step

TOKENIZER = omni_tokenizer()
AUDIO_PAD = TOKENIZER.convert_tokens_to_ids("<|audio_pad|>")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
#: 0.3 s: one partial chunk; 2.37 s: two full chunks and a partial one; 5 s: two attention windows and a partial one
SECONDS = (0.3, 2.37, 5.0)


def clip(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    signal = 0.5 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t) + 0.1 * rng.standard_normal(t.size)
    return np.clip(signal, -1, 1).astype(np.float32)


def wav_bytes(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def decoded(samples: np.ndarray) -> np.ndarray:
    """The samples as the server reads them back from 16-bit WAV."""
    return (samples * 32767).astype("<i2").astype(np.float32) / 32768.0


def audio_chat(seed: int, seconds: float, text: str = "Say hi.", params=GREEDY) -> RequestSpec:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(clip(seed, seconds))).decode(),
                                                   "format": "wav"}}
    return RequestSpec(messages=({"role": "user", "content": [part, {"type": "text", "text": text}]},), params=params)


def reference_inputs(seed: int, seconds: float, text: str = "Say hi."):
    """The processor's ids (each ``<|audio_pad|>`` repeated by its token count) and tensors for the same chat."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    features = feature_extractor()(decoded(clip(seed, seconds)), sampling_rate=16000, padding=True,
                                   truncation=False, return_attention_mask=True, return_tensors="pt")
    mask = features["attention_mask"]
    count = int(_get_feat_extract_output_lengths(mask.sum(-1), 50)[0])
    prompt = TOKENIZER.apply_chat_template([{"role": "user", "content": [{"type": "audio"},
                                                                        {"type": "text", "text": text}]}],
                                           add_generation_prompt=True, tokenize=False)
    ids = TOKENIZER(prompt.replace("<|audio_pad|>", "<|audio_pad|>" * count), add_special_tokens=False)["input_ids"]
    return torch.tensor([ids]), features["input_features"], mask


@pytest.fixture(scope="module")
def llm(omni_reference_model):
    with LLM(str(omni_reference_model[0]), plugin="omni", enable_in_flight_batching=True) as llm:
        yield llm


def test_features_and_encoder_equal_the_reference(omni_reference_model):
    path, model = omni_reference_model
    encoder, features = load_audio_encoder(path, json.loads((path / "config.json").read_text()))
    for seed, seconds in enumerate(SECONDS):
        samples = clip(seed, seconds)
        ref = feature_extractor()(samples, sampling_rate=16000, padding=True, truncation=False,
                                  return_attention_mask=True, return_tensors="pt")
        ours = torch.from_numpy(features.features(samples))
        assert ours.shape == ref["input_features"][0].shape
        assert (ours - ref["input_features"][0]).abs().max().item() <= 1e-4
        with torch.no_grad():
            expected = model.thinker.get_audio_features(ref["input_features"],
                                                        feature_attention_mask=ref["attention_mask"]).last_hidden_state
        got = encoder(ours)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-4


def first_logits(runtime, prepared) -> torch.Tensor:
    """Float32 logits ``[V]`` after the whole prompt, in one prefill over a fresh cache."""
    ids = prepared.prompt_token_ids
    num_blocks = -(-len(ids) // runtime.kv_block_size) + 1
    step, seats = one_seat_step(prepared, tuple(range(num_blocks)), GREEDY)
    caches = allocate_kv_cache(runtime.model.config, num_blocks, runtime.kv_block_size)
    attn = build_attn_metadata([(0, len(ids), seats[0].block_ids)], runtime.kv_block_size, torch.device("cpu"))
    input_ids = torch.tensor(ids)
    with torch.inference_mode():
        hidden = runtime.model(input_ids, runtime.step_positions(step, seats), attn, caches,
                               runtime.step_embeddings(step, seats, input_ids))
        return runtime.model.compute_logits(hidden[-1:])[0]


@pytest.mark.parametrize("seconds", SECONDS[1:])
def test_prompt_logits_and_greedy_tokens_equal_the_thinker(omni_reference_model, llm, seconds):
    _, model = omni_reference_model
    ids, features, mask = reference_inputs(3, seconds)
    prepared = llm.deployment.runtime.prepare(audio_chat(3, seconds))
    assert list(prepared.prompt_token_ids) == ids[0].tolist()  # the processor's expansion
    with torch.no_grad():
        expected = model.thinker(input_ids=ids, input_features=features, feature_attention_mask=mask).logits[0, -1]
        generated = model.thinker.generate(input_ids=ids, input_features=features, feature_attention_mask=mask,
                                           do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    assert (first_logits(llm.deployment.runtime, prepared) - expected).abs().max().item() <= 1e-4
    ours = llm.engine.submit(audio_chat(3, seconds), wait=True).result()
    assert list(ours.token_ids) == generated[0, ids.shape[1]:].tolist()


def test_audio_requests_join_a_running_batch_with_their_output_alone(llm):
    long_text = RequestSpec(messages=({"role": "user", "content": "Hello there, how are you?"},),
                            params=SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
    specs = [long_text, audio_chat(1, 2.37), audio_chat(2, 0.3, "Hello there"), audio_chat(4, 5.0)]
    solo = [llm.engine.submit(s, wait=True).result().token_ids for s in specs]
    before = llm.health()["scheduling"]
    batched = submit_staggered(llm.engine, specs, gap_steps=2)
    after = llm.health()["scheduling"]
    assert [r.token_ids for r in batched] == solo
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] >= 3
    assert after["stalls_incompatible"] == before["stalls_incompatible"]
    runtime = llm.deployment.runtime  # the audio is heard: another clip moves the logits
    heard = first_logits(runtime, runtime.prepare(audio_chat(1, 2.37))) - first_logits(runtime, runtime.prepare(
        audio_chat(5, 2.37)))
    assert heard.abs().max().item() > 1e-3


def test_bad_media_requests_are_400s(llm):
    runtime = llm.deployment.runtime
    image = RequestSpec(messages=({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]},), params=GREEDY)
    with pytest.raises(InvalidRequest, match="not an image Pillow can read"):
        runtime.prepare(image)
    stray = RequestSpec(messages=({"role": "user", "content": [
        {"type": "text", "text": "<|audio_pad|>"}, audio_chat(1, 0.3).messages[0]["content"][0]]},), params=GREEDY)
    with pytest.raises(InvalidRequest, match="2 media placeholders for 1 media parts"):
        runtime.prepare(stray)
    spoken = audio_chat(1, 0.3)
    with pytest.raises(InvalidRequest, match="speech output for a prompt with audio or image input"):
        runtime.prepare(RequestSpec(messages=spoken.messages, params=GREEDY, extras={"generate_audio": True}))
    bad = RequestSpec(messages=({"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "bm90IGEgd2F2", "format": "wav"}}]},), params=GREEDY)
    with pytest.raises(InvalidRequest, match="not a PCM WAV file"):
        runtime.prepare(bad)


def test_chat_route_serves_audio_input(llm):
    from starlette.testclient import TestClient

    from ifb.server.app import build_app

    spec = audio_chat(1, 0.3)
    expected = llm.engine.submit(spec, wait=True).result().text
    with TestClient(build_app(llm.deployment, model_name="omni"), base_url="http://localhost") as client:
        chat = client.post("/v1/chat/completions", json={"messages": list(spec.messages), "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == expected
    assert chat.json()["usage"]["prompt_tokens"] == len(llm.deployment.runtime.prepare(spec).prompt_token_ids)


def test_transcription_route_equals_the_thinkers_greedy_transcription(omni_reference_model, llm):
    """``/v1/audio/transcriptions`` on the Omni Thinker (under in-flight batching): the text is the Thinker's
    greedy answer to the route's instruction over the same clip, as transformers generates it."""
    from starlette.testclient import TestClient

    from ifb.server.app import build_app
    from ifb.server.transcriptions import MAX_TRANSCRIPT_TOKENS, instruction

    _, model = omni_reference_model
    seed, seconds = 2, 0.3
    ids, features, mask = reference_inputs(seed, seconds, text=instruction(None, False))
    with torch.no_grad():
        generated = model.thinker.generate(input_ids=ids, input_features=features, feature_attention_mask=mask,
                                           do_sample=False, max_new_tokens=MAX_TRANSCRIPT_TOKENS,
                                           eos_token_id=list(llm.deployment.runtime.tokenizer.eos_token_ids),
                                           pad_token_id=0)
    expected = TOKENIZER.decode(generated[0, ids.shape[1]:], skip_special_tokens=True).strip()
    with TestClient(build_app(llm.deployment, model_name="omni"), base_url="http://localhost") as client:
        response = client.post("/v1/audio/transcriptions", data={"model": "omni"},
                               files={"file": ("clip.wav", wav_bytes(clip(seed, seconds)), "audio/wav")})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == expected and expected
