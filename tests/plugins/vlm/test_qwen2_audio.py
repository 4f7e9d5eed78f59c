"""Qwen2-Audio against transformers on the same tiny checkpoint: log-mel features, encoder features, prompts,
logits, greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.masking_utils import create_bidirectional_mask

from ifb import LLM, SamplingParams
from ifb.params import InvalidRequest
from ifb_plugins.vlm.families import load_vlm
from ifb_plugins.common.media.parts import MediaItem, decode_wav
from tests.models.media import wav_bytes

from tests.plugins.vlm import tiny
from tests.plugins.vlm.compare import (
    GREEDY, alone, assert_batched_equals_alone, assert_close, chat, first_logits, hf_content, openai_content,
    reference_greedy, reference_inputs,
)

PROMPTS = {
    "one clip": [("audio", wav_bytes(1, seconds=0.4)), ("text", "What do you hear?")],
    "text first": [("text", "Transcribe"), ("audio", wav_bytes(2, seconds=0.93))],
    "two clips": [("audio", wav_bytes(3, seconds=0.25)), ("text", "and"), ("audio", wav_bytes(4, seconds=1.0)),
                  ("text", "Which is louder?")],
    "text only": [("text", "Tell me about paged KV caches.")],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tiny.qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"), seed=7)
    return path, *tiny.reference(path, transformers.Qwen2AudioForConditionalGeneration)


def reference_features(model, inputs) -> torch.Tensor:
    """What ``Qwen2AudioModel.forward`` scatters into the prompt, for every clip."""
    tower = model.model.audio_tower
    lengths, outputs = tower._get_feat_extract_output_lengths(inputs["feature_attention_mask"].sum(-1))
    positions = tower.config.max_source_positions
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(lengths), positions, 1),
                                     attention_mask=(torch.arange(positions)[None] < lengths[:, None]).long())
    with torch.no_grad():
        features = model.model.multi_modal_projector(tower(inputs["input_features"], attention_mask=mask).last_hidden_state)
    return [f[:n] for f, n in zip(features, outputs.tolist())]


@pytest.fixture(scope="module")
def encoder(checkpoint):
    return load_vlm(checkpoint[0]).encoders["audio"]


@pytest.mark.parametrize("num_samples", [4800, 12345, 16000, 3001])
def test_log_mel_and_audio_features_match_transformers(checkpoint, encoder, num_samples):
    path, model, processor = checkpoint
    audio = (np.random.default_rng(num_samples).standard_normal(num_samples) * 0.1).astype(np.float32)
    inputs = processor(text="<|audio_bos|><|AUDIO|><|audio_eos|>", audio=[audio], sampling_rate=16000,
                       return_tensors="pt")
    mel, num_frames = encoder.input_features(audio)
    assert num_frames == int(inputs["feature_attention_mask"].sum())
    assert_close(torch.from_numpy(mel), inputs["input_features"][0, :, :mel.shape[1]], atol=1e-5)
    encoded = encoder.encode(MediaItem("audio", b"", audio))
    expected, = reference_features(model, inputs)
    assert_close(encoded.embeds, expected)
    assert encoded.token_ids == (model.config.audio_token_id,) * int((inputs["input_ids"] == model.config.audio_token_id).sum())


def test_audio_longer_than_the_chunk_is_refused(encoder):
    with pytest.raises(InvalidRequest, match="at most 1 s"):
        encoder.encode(MediaItem("audio", b"", np.zeros(16001, dtype=np.float32)))


@pytest.fixture(scope="module")
def served(checkpoint):
    path, model, processor = checkpoint
    with LLM(str(path), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4) as llm:
        yield llm, model, processor


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(served, prompt):
    llm, model, processor = served
    parts = PROMPTS[prompt]
    clips = [decode_wav(v, "clip", 16000) for kind, v in parts if kind == "audio"]
    inputs = reference_inputs(processor, [{"role": "user", "content": hf_content(parts)}], audio=clips or None,
                              **({"sampling_rate": 16000} if clips else {}))
    spec = chat(openai_content(parts))
    runtime = llm.deployment.runtime
    prepared = runtime.prepare(spec)
    assert list(prepared.prompt_token_ids) == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = model(**inputs).logits[0, -1]
    assert_close(first_logits(runtime, prepared), expected)
    assert list(alone(llm, spec).token_ids) == reference_greedy(model, inputs, GREEDY.max_tokens)


def test_audio_requests_join_mid_flight_and_match_their_output_alone(served):
    llm, _, _ = served
    long_text = chat([{"type": "text", "text": "Tell me a long story about a paged KV cache."}],
                     SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, logprobs=1))
    specs = [long_text, *(chat(openai_content(PROMPTS[p])) for p in ("two clips", "text first", "one clip"))]
    assert_batched_equals_alone(llm, specs)


def test_images_are_refused_and_audio_is_never_pruned(checkpoint):
    path = checkpoint[0]
    with LLM(str(path), plugin="vlm", enable_in_flight_batching=True, visual_token_pruner=0.25) as llm:
        from tests.models.media import image_part, png_bytes

        with pytest.raises(InvalidRequest, match="takes no image input"):
            llm.engine.submit(chat([image_part(png_bytes(0))]))
        prepared = llm.deployment.runtime.prepare(chat(openai_content(PROMPTS["one clip"])))
        (rows, _), = prepared.state.media.embeds
        assert len(rows) == 10  # 0.4 s: 40 frames, 20 positions, pooled to 10
