"""What the vlm plugin declares, its matrix rows, the media predicate and the loader's refusals."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from ifb import LLM
from ifb.capabilities import DeployConfig, Support
from ifb.matrix import build, deployment_row
from ifb_plugins.vlm.options import has_media
from ifb.params import RequestSpec
from ifb.plugins import default_host
from ifb_plugins.vlm import VARIANTS, declare, pruner_ratio
from ifb_plugins.vlm.loader import load_vlm_checkpoint
from ifb_plugins.vlm.testing import image_part, png_bytes, save_tiny_vlm_checkpoint


def test_pruner_makes_media_founder_only():
    plain = declare(DeployConfig(plugin="vlm", enable_in_flight_batching=True))
    pruned = declare(DeployConfig(plugin="vlm", enable_in_flight_batching=True, options={"visual_token_pruner": 0.5}))
    assert plain.options["media_under_pruner"].support is Support.SERVED
    option = pruned.options["media_under_pruner"]
    assert option.support is Support.FOUNDER_ONLY and option.stall_counter == "stalls_incompatible"
    for caps in (plain, pruned):
        assert caps.options["differing_sampling"].support is Support.SERVED
        assert caps.options["lora"].support is Support.REJECTED
        assert caps.options["generate_audio"].support is Support.NOT_APPLICABLE
        assert set(caps.endpoints) == {"completions", "chat.completions"} and caps.batch_invariant_verified


@pytest.mark.parametrize("raw, expected", [(None, None), (0.5, 0.5), ("0.25", 0.25), (1.0, None)])
def test_pruner_ratio(raw, expected):
    assert pruner_ratio(DeployConfig(options={"visual_token_pruner": raw})) == expected


@pytest.mark.parametrize("raw", [0, -0.5, 1.5, "half", float("nan")])
def test_bad_pruner_ratio_is_refused(raw):
    with pytest.raises(ValueError, match="visual-token-pruner"):
        declare(DeployConfig(options={"visual_token_pruner": raw}))


def test_matrix_rows():
    kind = default_host().kind("vlm")
    rows = [deployment_row(kind, v) for v in VARIANTS]
    assert [r.status for r in rows] == ["served", "served"]
    assert "founder-only" in rows[0].note
    deployments, requests = build(default_host())
    assert {"Vision / audio input (multimodal)", "Vision / audio input under a visual-token pruner"} <= {
        r.deployment for r in deployments if r.plugin == "vlm"}
    media = [r for r in requests if r.plugin == "vlm" and r.option.startswith("Media under")]
    assert media[0].status == "founder-only"  # the request-level table shows the pruner variant


def test_media_predicate_reads_messages_and_extras():
    text = RequestSpec(messages=({"role": "user", "content": [{"type": "text", "text": "hi"}]},))
    image = RequestSpec(messages=({"role": "user", "content": [image_part(png_bytes(0))]},))
    assert not has_media(text) and not has_media(RequestSpec(prompt="hi"))
    assert has_media(image) and has_media(RequestSpec(prompt="hi", extras={"media": True}))


def test_loader_refuses_mismatched_weights(tmp_path):
    path = save_tiny_vlm_checkpoint(tmp_path / "ckpt", with_audio=False)
    assert load_vlm_checkpoint(path).placeholders == {"image": "<image>"}
    weights = load_file(str(path / "model.safetensors"))
    save_file({**weights, "audio_tower.conv1.weight": weights["vision_tower.vision_model.post_layernorm.weight"].clone()},
              str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected audio_tower.conv1.weight"):
        load_vlm_checkpoint(path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["image_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no image_token_id"):
        load_vlm_checkpoint(path)


def test_bad_pruner_fails_at_start_up(vlm_checkpoint):
    with pytest.raises(ValueError, match="visual-token-pruner"):
        LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, visual_token_pruner=2)
