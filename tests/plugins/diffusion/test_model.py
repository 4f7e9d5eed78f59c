"""The backbone against transformers' DiffusionGemma on the same weights: configuration, RoPE and logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.cache_utils import DynamicCache

from ifb_plugins.diffusion.config import DiffusionGemmaConfig, SamplerSettings
from ifb_plugins.diffusion.loader import load_diffusion_dir
from ifb_plugins.diffusion.model import SegmentInput

from . import reference

TOL = 1e-4


@pytest.fixture(scope="module")
def loaded(diffusion_reference):
    return load_diffusion_dir(diffusion_reference[0])


def test_config_reads_each_layer_type(diffusion_reference):
    config = DiffusionGemmaConfig.from_hf(json.loads((diffusion_reference[0] / "config.json").read_text()))
    assert [(s.layer_type, s.head_dim, s.num_kv_heads, s.has_v_proj) for s in config.layers] == [
        ("sliding_attention", 16, 2, True), ("full_attention", 32, 1, False),
        ("sliding_attention", 16, 2, True), ("full_attention", 32, 1, False)]
    assert config.canvas_length == reference.CANVAS and config.sliding_window == 6
    assert config.rope["full_attention"].rope_type == "proportional"


def test_rope_frequencies_are_the_reference_ones(diffusion_reference, loaded):
    rotary = diffusion_reference[1].model.decoder.rotary_emb
    for layer_type in ("sliding_attention", "full_attention"):
        ours = getattr(loaded.model, f"inv_freq_{layer_type}")
        assert torch.equal(ours, getattr(rotary, f"{layer_type}_inv_freq"))


def test_sampler_settings_default_to_the_reference(diffusion_reference):
    # the saved generation_config.json leaves them unset: the reference's defaults apply
    assert SamplerSettings.from_dir(diffusion_reference[0]) == SamplerSettings()
    settings = SamplerSettings.from_dir(diffusion_reference[0], {"t_min": 0.0, "t_max": 1e-6})
    assert settings.temperature(settings.max_denoising_steps) == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="t_min < t_max"):
        SamplerSettings(t_min=0.5, t_max=0.5)


def test_logits_match_the_reference_across_blocks(diffusion_reference, loaded):
    model = diffusion_reference[1]
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, reference.VOCAB, (1, 11), generator=gen)  # longer than the sliding window
    canvas, canvas2 = torch.randint(0, reference.VOCAB, (2, 1, reference.CANVAS), generator=gen)
    self_conditioning = torch.randn(1, reference.CANVAS, reference.VOCAB, generator=gen) * 5
    with torch.no_grad():
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        first = model(input_ids=prompt, cache=cache, decoder_input_ids=canvas).logits[0]
        second = model(cache=cache, decoder_input_ids=canvas,
                       self_conditioning_logits=self_conditioning).logits[0]
        model.model.encoder(input_ids=canvas, cache=cache, position_ids=torch.arange(11, 19)[None])
        next_block = model(cache=cache, decoder_input_ids=canvas2,
                           decoder_position_ids=torch.arange(19, 27)[None]).logits[0]

    kv = loaded.model.new_cache()
    (ours,) = loaded.model([SegmentInput(prompt[0], kv, False), SegmentInput(canvas[0], kv, True)])
    assert (ours - first).abs().max() <= TOL
    (ours,) = loaded.model([SegmentInput(canvas[0], kv, True, torch.softmax(self_conditioning[0], -1))])
    assert (ours - second).abs().max() <= TOL
    # the finished block's KV and the next canvas in one forward, as a request's next step runs them
    (ours,) = loaded.model([SegmentInput(canvas[0], kv, False), SegmentInput(canvas2[0], kv, True)])
    assert (ours - next_block).abs().max() <= TOL
    assert kv.num_tokens == 19 and kv.num_cached(0) == 5 and kv.num_cached(1) == 19
