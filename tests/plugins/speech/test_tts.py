"""Qwen3-TTS against Qwen's reference (``qwen-tts``) on the same tiny random weights: codes and waveform."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.params import InvalidRequest
from ifb_plugins.speech import generate_audio
from ifb_plugins.speech.text_tokenizer import load_text_tokenizer
from ifb_plugins.speech.tts import assistant_text, instruct_text, load_tts


TEXT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def reference(tts_reference_model):
    return tts_reference_model


@pytest.fixture(scope="module")
def ours(reference):
    return load_tts(reference[0])


def reference_speech(wrapper, text, speaker, language, instruct, max_new_tokens=None):
    """The reference's greedy codes ``[T, G]`` and waveform for one utterance."""
    captured = {}
    generate = wrapper.model.talker.generate

    def capture(*args, **kwargs):
        result = generate(*args, **kwargs)
        codes = [h[-1] for h in result.hidden_states if h[-1] is not None]
        captured["codes"] = torch.stack(codes, 1)[0] if codes else torch.zeros(0, 4, dtype=torch.long)
        return result

    extra = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    wrapper.model.talker.generate = capture
    try:
        wavs, rate = wrapper.generate_custom_voice(text, speaker=speaker, language=language, instruct=instruct,
                                                   do_sample=False, subtalker_dosample=False, **extra)
    finally:
        wrapper.model.talker.generate = generate
    codes = captured["codes"]
    eos = wrapper.model.config.talker_config.codec_eos_token_id
    stop = (codes[:, 0] == eos).nonzero()
    return (codes[:int(stop[0])] if len(stop) else codes), wavs[0], rate


@pytest.mark.parametrize("speaker, language, instruct", [
    ("Vivian", "English", None),
    ("Dylan", "Auto", "Speak slowly and warmly."),  # a dialect speaker, with an instruction
])
def test_codes_and_waveform_equal_the_reference(reference, ours, speaker, language, instruct):
    path, wrapper = reference
    expected_codes, expected_wav, rate = reference_speech(wrapper, TEXT, speaker, language, instruct)
    frames = list(ours.frames(ours.utterance(TEXT, speaker, instruct, language), greedy=True))
    assert torch.equal(torch.stack(frames), expected_codes)
    wav = ours.decode(frames)
    assert rate == ours.sample_rate == 24000
    assert wav.shape == expected_wav.shape and np.abs(expected_wav).max() > 1e-3
    assert np.abs(wav - expected_wav).max() <= 1e-4


def test_generation_stops_at_the_codec_eos_as_the_reference_does(reference, ours):
    _, wrapper = reference
    eos = wrapper.model.config.talker_config.codec_eos_token_id
    normal = list(ours.frames(ours.utterance(TEXT, "Vivian", None, "English"), greedy=True))
    heads = (wrapper.model.talker.codec_head.weight, ours.model.talker.codec_head.weight)
    saved = heads[0][eos].clone()
    with torch.no_grad():
        try:  # EOS outscores the code the third frame would start with: both models get the same head
            for head in heads:
                head[eos] = 3 * head[int(normal[2][0])]
            expected, _, _ = reference_speech(wrapper, TEXT, "Vivian", "English", None)
            frames = list(ours.frames(ours.utterance(TEXT, "Vivian", None, "English"), greedy=True))
        finally:
            for head in heads:
                head[eos] = saved
    assert 2 <= len(expected) < len(normal)  # ended by EOS (masked for the first two codes), not by the limit
    assert torch.equal(torch.stack(frames), expected)


def test_a_range_decoded_as_it_streams_equals_the_whole_decode(ours):
    frames = list(ours.frames(ours.utterance(TEXT, "vivian", None, "english"), greedy=True))
    whole = ours.decode(frames)
    pieces = [ours.decode_range(frames[:end], start) for start, end in ((0, 3), (3, 7), (7, len(frames)))]
    assert np.abs(np.concatenate(pieces) - whole).max() <= 1e-5


def test_bad_inputs_name_what_is_wrong(ours):
    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'.*vivian, dylan"):
        ours.utterance(TEXT, "nobody", None, None)
    with pytest.raises(InvalidRequest, match="unknown language 'klingon'.*auto, english, chinese"):
        ours.utterance(TEXT, None, None, "klingon")
    with pytest.raises(InvalidRequest, match="empty"):
        ours.utterance("  ", None, None, None)


def test_the_deployment_speaks_end_to_end_as_the_reference(reference):
    path, wrapper = reference
    _, expected_wav, _ = reference_speech(wrapper, TEXT, "Vivian", "English", None)
    deployment = load_deployment(DeployConfig(model=str(path), plugin="tts"))
    try:
        pcm = generate_audio(deployment, TEXT, "Vivian", format="pcm", language="English", greedy=True)
    finally:
        deployment.shutdown()
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0
    assert samples.shape == expected_wav.shape
    assert np.abs(samples - expected_wav).max() <= 1e-4  # 16-bit rounding is 1.5e-5


def test_in_flight_batching_is_refused_at_start_up_with_the_reason(reference):
    with pytest.raises(Exception, match="stepped execution"):
        load_deployment(DeployConfig(model=str(reference[0]), plugin="tts", enable_in_flight_batching=True))


@pytest.mark.parametrize("files", [
    ("tokenizer.json", "tokenizer_config.json"),
    ("vocab.json", "merges.txt", "tokenizer_config.json"),  # checkpoints that ship only the BPE files
])
def test_the_text_tokenizer_equals_the_reference_processor(reference, tmp_path, files):
    path, wrapper = reference
    for name in files:
        shutil.copy(path / name, tmp_path / name)
    ours = load_text_tokenizer(tmp_path)
    for text in (assistant_text(TEXT), instruct_text("Speak slowly and warmly."), "你好，世界 12 dogs!\n\n  x"):
        assert ours.encode(text) == wrapper.processor(text=text)["input_ids"][0]
