"""Qwen3-ASR against transformers on the same tiny checkpoint: log-mel and encoder features, transcription
prompts (forced language, context), first-step logits, greedy tokens, batched == alone."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
import transformers

from ifb import LLM, SamplingParams
from ifb.params import InvalidRequest, RequestSpec
from ifb.server.transcriptions import instruction
from ifb.transcription import Transcript, Transcription
from ifb_plugins.common.media.parts import MediaItem, decode_wav
from ifb_plugins.vlm.families import load_vlm
from ifb_plugins.vlm.qwen3_asr import Qwen3AsrTranscription
from tests.models.media import audio_part, wav_bytes

from tests.plugins.vlm import tiny
from tests.plugins.vlm.compare import GREEDY, alone, assert_batched_equals_alone, assert_close, first_logits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tiny.qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"), seed=3)
    return path, *tiny.reference(path, transformers.Qwen3ASRForConditionalGeneration)


def clip(num_samples: int) -> np.ndarray:
    return (np.random.default_rng(num_samples).standard_normal(num_samples) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return load_vlm(checkpoint[0]).encoders["audio"]


# under min_length (padded to 0.5 s), under one chunk, whole chunks, several attention windows
@pytest.mark.parametrize("num_samples", [3001, 12345, 16000, 70000])
def test_log_mel_and_audio_features_match_transformers(checkpoint, encoder, num_samples):
    _, model, processor = checkpoint
    audio = clip(num_samples)
    inputs = processor.apply_transcription_request(audio=[audio])
    mel = encoder.features.features(audio)
    num_frames = int(inputs["input_features_mask"].sum())
    assert mel.shape[1] == num_frames
    assert_close(torch.from_numpy(mel), inputs["input_features"][0, :, :num_frames], atol=1e-5)
    with torch.no_grad():
        expected = model.model.get_audio_features(inputs["input_features"],
                                                  inputs["input_features_mask"]).pooler_output
    encoded = encoder.encode(MediaItem("audio", b"", audio))
    assert_close(encoded.embeds, expected)
    assert encoded.token_ids.count(model.config.audio_token_id) == int(
        (inputs["input_ids"] == model.config.audio_token_id).sum())


def transcription_spec(wav: bytes, task: Transcription, params: SamplingParams = GREEDY) -> RequestSpec:
    """What ``/v1/audio/transcriptions`` submits for ``task`` (see ``ifb.server.transcriptions``)."""
    messages = [{"role": "system", "content": task.prompt}] if task.prompt else []
    messages.append({"role": "user", "content": [audio_part(wav),
                                                 {"type": "text", "text": instruction(task.language, False)}]})
    return RequestSpec(messages=tuple(messages), params=params, transcription=task)


TASKS = {
    "detect the language": Transcription(),
    "forced language by code": Transcription(language="en"),
    "forced language by name, with context": Transcription(language="german", prompt="Kubernetes, vLLM"),
}


@pytest.fixture(scope="module")
def served(checkpoint):
    path, model, processor = checkpoint
    with LLM(str(path), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4) as llm:
        yield llm, model, processor


@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_logits_and_greedy_tokens_match_transformers(served, task):
    llm, model, processor = served
    wav = wav_bytes(6, seconds=1.3)
    spec = transcription_spec(wav, TASKS[task])
    inputs = processor.apply_transcription_request(audio=[decode_wav(wav, "clip", 16000)],
                                                   language=TASKS[task].language, prompt=TASKS[task].prompt)
    runtime = llm.deployment.runtime
    prepared = runtime.prepare(spec)
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model(**inputs).logits[0, -1]
    assert_close(first_logits(runtime, prepared), expected)
    model.generation_config.eos_token_id = None  # as ignore_eos
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    assert list(alone(llm, spec).token_ids) == out[0, inputs["input_ids"].shape[1]:].tolist()


def test_transcriptions_join_mid_flight_and_match_their_output_alone(served):
    llm, _, _ = served
    founder = RequestSpec(messages=({"role": "user", "content": [audio_part(wav_bytes(7, seconds=2.5))]},),
                          params=SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, logprobs=1))
    joiners = [transcription_spec(wav_bytes(8, seconds=0.7), TASKS["detect the language"]),
               transcription_spec(wav_bytes(9, seconds=1.9), TASKS["forced language by name, with context"])]
    assert_batched_equals_alone(llm, [founder, *joiners])


def test_tasks_the_model_cannot_do_are_refused(served):
    llm, _, _ = served
    wav = wav_bytes(1, seconds=0.5)
    with pytest.raises(InvalidRequest, match="does not take language 'klingon'"):
        llm.deployment.runtime.prepare(transcription_spec(wav, Transcription(language="klingon")))
    with pytest.raises(InvalidRequest, match="does not translate"):
        llm.deployment.runtime.prepare(transcription_spec(wav, Transcription(translate=True)))


def test_the_language_header_is_read_off_the_transcript():
    read = Qwen3AsrTranscription().read
    assert read("language English<asr_text> Hello there.", True) == Transcript(" Hello there.", "English")
    assert read("language None<asr_text>", True) == Transcript("", None)
    assert read("no header at all", True) == Transcript("no header at all")
    # while the output may still be a header it shows nothing, and everything once it cannot be one
    assert [read(t, False).text for t in ("lang", "language Eng", "language English<asr_text>Hi")] == ["", "", "Hi"]
    assert read("language Eng", True) == Transcript("language Eng")
    assert read("Hi", False) == Transcript("Hi")


def test_the_chat_route_is_the_template_alone(served):
    """A chat request (no transcription task) renders the published template with no prefill."""
    llm, _, processor = served
    wav = wav_bytes(2, seconds=0.5)
    spec = attrs.evolve(transcription_spec(wav, Transcription(language="en")), transcription=None)
    inputs = processor.apply_transcription_request(audio=[decode_wav(wav, "clip", 16000)])
    assert list(llm.deployment.runtime.prepare(spec).prompt_token_ids) == inputs["input_ids"][0].tolist()
