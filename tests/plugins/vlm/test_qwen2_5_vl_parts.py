"""Qwen2.5-VL's parts against transformers on the same tiny random weights: preprocessing, vision
features, M-RoPE positions and the decoder's logits under them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ifb_plugins.common.loading.processor import ProcessorFiles
from ifb_plugins.common.layers.attention import build_attn_metadata
from ifb_plugins.common.loading.hf import load_hf_state_dict
from ifb_plugins.common.loading.checkpoint import LoadedCheckpoint, build_model
from ifb_plugins.common.models.decoder import allocate_kv_cache
from ifb_plugins.common.layers.mrope import grid_ids, prompt_positions
from ifb_plugins.common.media.qwen2_5_vl_vision import Qwen2_5VisionTower
from ifb_plugins.vlm.qwen2_5_vl import Qwen2_5VLConfig, split_state
from ifb_plugins.common.media.qwen2_5_vl_image import QwenVLImageProcessing
from tests.plugins.vlm.tiny_qwen2_5_vl import (
    IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, load_processor, save_tiny_qwen2_5_vl,
)

import transformers

#: (height, width): kept, rounded, grown to min_pixels, shrunk to max_pixels, non-square, partial windows
SIZES = [(56, 56), (50, 90), (20, 30), (300, 500), (57, 211), (130, 75)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), seed=5)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(checkpoint)).eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    return load_processor(checkpoint)


@pytest.fixture(scope="module")
def ours(checkpoint):
    config = Qwen2_5VLConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))
    text_state, vision_state = split_state(load_hf_state_dict(checkpoint))
    tower = Qwen2_5VisionTower(config.vision)
    tower.load_state_dict(vision_state, strict=True)
    text = build_model(LoadedCheckpoint(config.text, text_state, None, "hf", checkpoint))
    pre = QwenVLImageProcessing.from_hf(ProcessorFiles.read(checkpoint).image_processor)
    return config, tower.eval(), text, pre


def image(seed: int, height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)


@pytest.mark.parametrize("size", SIZES)
def test_preprocessing_equals_the_image_processor(ours, processor, size):
    pre = ours[3]
    img = image(1, *size)
    ref = processor.image_processor(images=[img], return_tensors="np")
    pixels, grid = pre(img)
    assert grid == tuple(ref["image_grid_thw"][0])
    np.testing.assert_array_equal(pixels, ref["pixel_values"])


def test_transparency_is_composited_over_white(ours, processor):
    img = image(2, 60, 40, "RGBA")
    ref = processor.image_processor(images=[img], return_tensors="np")
    np.testing.assert_array_equal(ours[3](img)[0], ref["pixel_values"])


def test_config_pixels_bounds_are_read(ours):
    pre = ours[3]
    assert (pre.min_pixels, pre.max_pixels, pre.factor) == (28 * 28 * 4, 28 * 28 * 24, 28)
    legacy = QwenVLImageProcessing.from_hf({"min_pixels": 3136, "max_pixels": 12845056, "size": {}})
    assert (legacy.min_pixels, legacy.max_pixels) == (3136, 12845056)


@pytest.mark.parametrize("size", SIZES)
def test_vision_features_equal_transformers(ours, processor, reference, size):
    _, tower, _, pre = ours
    img = image(3, *size)
    ref = processor.image_processor(images=[img], return_tensors="pt")
    with torch.no_grad():
        expected = reference.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output[0]
    pixels, grid = pre(img)
    features, importance = tower(torch.from_numpy(pixels), grid)
    assert importance.shape == (features.shape[0],) and importance.sum() > 0
    assert features.shape == expected.shape
    assert expected.abs().max() > 0.1  # not a degenerate random model
    assert (features - expected).abs().max() <= 1e-4


def _prompt(processor, images, texts):
    """A chat prompt with the images interleaved into the text, as the processor expands it."""
    content = []
    for text, img in zip(texts, images + [None]):
        content.append({"type": "text", "text": text})
        if img is not None:
            content.append({"type": "image"})
    messages = [{"role": "user", "content": content}]
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[rendered], images=images or None, return_tensors="pt")


def _media(ids: list[int], grids, merge: int) -> list[tuple[int, torch.Tensor]]:
    """``(first index, relative ids)`` of each image span in a prompt."""
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and ids[i - 1] == VISION_START_ID]
    return [(s, grid_ids(int(t), int(h) // merge, int(w) // merge)) for s, (t, h, w) in zip(starts, grids)]


def test_mrope_positions_equal_get_rope_index(processor, reference):
    imgs = [image(4, 50, 90), image(5, 130, 75)]
    inputs = _prompt(processor, imgs, ["Compare", "with", "please."])
    ids = inputs["input_ids"][0].tolist()
    expected, delta = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                     image_grid_thw=inputs["image_grid_thw"])
    got = prompt_positions(len(ids), _media(ids, inputs["image_grid_thw"].tolist(), 2))
    assert torch.equal(got.prompt, expected[:, 0])
    assert got.delta == int(delta) < 0
    assert ids.index(VISION_END_ID) > ids.index(VISION_START_ID)


def test_decoder_logits_with_mrope_equal_transformers(ours, processor, reference):
    """Prefill in two chunks and decode two tokens; every step's logits equal transformers' with its cache."""
    config, tower, text, pre = ours
    imgs = [image(6, 57, 211), image(7, 56, 56)]
    inputs = _prompt(processor, imgs, ["Look:", "and", "now?"])
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=3, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    generated = out.sequences[0, len(ids):].tolist()
    media = _media(ids, inputs["image_grid_thw"].tolist(), config.vision.spatial_merge_size)
    positions = prompt_positions(len(ids), media)
    embeds = text.model.embed_tokens(torch.tensor(ids)).detach().clone()
    for (start, ids_rel), img in zip(media, imgs):
        features = tower(torch.from_numpy(pre(img)[0]), pre(img)[1])[0]
        embeds[start:start + ids_rel.shape[1]] = features
    caches = allocate_kv_cache(config.text, 16, 16)
    blocks = list(range(16))
    cut = media[0][0] + 3  # the first chunk ends inside the first image
    chunks = [(0, cut), (cut, len(ids))] + [(len(ids) + k, len(ids) + k + 1) for k in range(2)]
    all_ids = ids + generated
    with torch.no_grad():
        for step, (lo, hi) in enumerate(chunks):
            attn = build_attn_metadata([(lo, hi - lo, blocks)], 16)
            x = embeds[lo:hi] if hi <= len(ids) else text.model.embed_tokens(torch.tensor(all_ids[lo:hi]))
            hidden = text(torch.tensor(all_ids[lo:hi]), positions.span(lo, hi - lo), attn, caches, x)
            if step == 0:
                continue
            logits = text.compute_logits(hidden[-1:])[0]
            assert (logits - out.logits[step - 1][0]).abs().max() <= 1e-4


def test_both_weight_layouts_load_the_same_model(checkpoint, tmp_path):
    """``model.visual.*`` / ``model.language_model.*`` (the module tree's names) read as the hub's layout."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    modules = save_tiny_qwen2_5_vl(tmp_path / "modules", seed=5, layout="modules")
    raw = load_hf_state_dict(modules)
    assert any(k.startswith("model.language_model.") for k in raw) and any(k.startswith("model.visual.") for k in raw)
    hub_text, hub_vision = split_state(load_hf_state_dict(checkpoint))
    text, vision = split_state(raw)
    for ours_part, hub_part in ((text, hub_text), (vision, hub_vision)):
        assert ours_part.keys() == hub_part.keys()
        assert all(torch.equal(ours_part[k], hub_part[k]) for k in ours_part)
    _, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(modules), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_a_flat_hub_config_reads_as_the_nested_one(checkpoint):
    """transformers 4 wrote the text settings at the top level, with ``rope_scaling`` of type ``mrope``."""
    from transformers import Qwen2_5_VLConfig

    nested = json.loads((checkpoint / "config.json").read_text())
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **text,
            "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    flat.pop("model_type")
    assert Qwen2_5_VLConfig(**flat).text_config.rope_parameters["mrope_section"] == rope["mrope_section"]
    assert Qwen2_5VLConfig.from_hf({**flat, "model_type": "qwen2_5_vl"}) == Qwen2_5VLConfig.from_hf(nested)
