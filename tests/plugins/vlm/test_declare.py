"""What the vlm plugin declares, its matrix rows, the media predicate and the loader's refusals."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from ifb import LLM
from ifb.capabilities import DeployConfig, Support
from ifb.matrix import build, deployment_row
from ifb.options import has_media
from ifb.params import RequestSpec
from ifb.plugins import default_host
from ifb_plugins.vlm import VARIANTS, declare, pruner_ratio
from ifb_plugins.vlm.families import FAMILIES, load_vlm
from tests.models.media import image_part, png_bytes



def test_pruner_makes_media_founder_only():
    plain = declare(DeployConfig(plugin="vlm", enable_in_flight_batching=True))
    pruned = declare(DeployConfig(plugin="vlm", enable_in_flight_batching=True, options={"visual_token_pruner": 0.5}))
    assert plain.options["media_under_pruner"].support is Support.SERVED
    option = pruned.options["media_under_pruner"]
    assert option.support is Support.FOUNDER_ONLY and option.stall_counter == "stalls_incompatible"
    for caps in (plain, pruned):
        assert caps.options["differing_sampling"].support is Support.SERVED
        for served in ("lora", "n_sequences"):  # tests/plugins/vlm/test_options.py
            assert caps.options[served].support is Support.SERVED
        assert caps.options["save_system_prompt_kv_cache"].support is Support.REJECTED  # no context cache
        assert caps.options["generate_audio"].support is Support.NOT_APPLICABLE
        assert set(caps.endpoints) == {"completions", "chat.completions", "audio.transcriptions"} and caps.batch_invariant_verified


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


def test_an_unknown_architecture_is_refused_naming_the_supported_ones(vlm_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(vlm_checkpoint, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["PaliGemmaForConditionalGeneration"]}))
    supported = [a for f in FAMILIES for a in f.architectures]
    with pytest.raises(ValueError, match="does not serve PaliGemmaForConditionalGeneration") as info:
        LLM(str(path), plugin="vlm")
    assert all(a in str(info.value) for a in supported) and "LlavaForConditionalGeneration" in supported


def test_loader_refuses_weights_the_config_does_not_describe(vlm_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(vlm_checkpoint, path)
    assert set(load_vlm(path).encoders) == {"image"}
    weights = load_file(str(path / "model.safetensors"))
    extra = weights["multi_modal_projector.linear_1.bias"].clone()
    save_file({**weights, "audio_tower.conv1.weight": extra}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weights outside the model's parts: audio_tower.conv1.weight"):
        load_vlm(path)
    del weights["multi_modal_projector.linear_2.bias"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing multi_modal_projector.linear_2.bias"):
        load_vlm(path)


def test_the_image_token_must_be_a_special_token(vlm_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(vlm_checkpoint, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "image_token_index": 40}))
    with pytest.raises(ValueError, match="image_token_id 40 .* not a special token"):
        load_vlm(path)


def siglip_at_48():
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    return SiglipImageProcessorPil(size={"height": 48, "width": 48})


def convnext():
    from transformers.models.convnext.image_processing_pil_convnext import ConvNextImageProcessorPil

    return ConvNextImageProcessorPil()


@pytest.mark.parametrize("image_processor, message", [
    (siglip_at_48, "makes \\(48, 48\\) images but the vision tower takes 32x32"),
    (convnext, "image processor 'ConvNextImageProcessor' is not supported"),
])
def test_an_image_processor_the_tower_cannot_take_is_refused(vlm_checkpoint, tmp_path, image_processor, message):
    import transformers

    path = tmp_path / "ckpt"
    shutil.copytree(vlm_checkpoint, path)
    saved = transformers.AutoProcessor.from_pretrained(path)
    transformers.LlavaProcessor(  # the same processor over another image processor, saved by its class
        image_processor=image_processor(), tokenizer=saved.tokenizer, patch_size=saved.patch_size,
        vision_feature_select_strategy=saved.vision_feature_select_strategy,
        num_additional_image_tokens=saved.num_additional_image_tokens,
        chat_template=saved.chat_template).save_pretrained(path)
    with pytest.raises(ValueError, match=message):
        load_vlm(path)


def test_bad_pruner_fails_at_start_up(vlm_checkpoint):
    with pytest.raises(ValueError, match="visual-token-pruner"):
        LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, visual_token_pruner=2)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_sparse_hub_text_configs_get_the_reference_defaults(model_type):
    import transformers
    from ifb_plugins.common.models.config import TextModelConfig
    from ifb_plugins.vlm.checkpoint import with_text_defaults

    # the special ids are the tokenizer's and the generation config's business, not the shapes'
    reference = {**transformers.AutoConfig.for_model(model_type).to_dict(), "bos_token_id": None, "eos_token_id": None}
    ours = TextModelConfig.from_hf_config(with_text_defaults({"model_type": model_type}))
    assert ours == TextModelConfig.from_hf_config(reference)


@pytest.mark.parametrize("model_type", ["clip_vision_model", "siglip_vision_model"])
def test_vision_configs_get_the_reference_defaults(model_type):
    import transformers
    from ifb_plugins.common.media.vision import VisionConfig

    reference = transformers.AutoConfig.for_model(model_type).to_dict()
    assert VisionConfig.from_hf({"model_type": model_type}) == VisionConfig.from_hf(reference)


def test_audio_configs_get_the_reference_defaults():
    import transformers
    from ifb_plugins.vlm.qwen2_audio import AudioConfig, FeatureExtraction

    assert AudioConfig.from_hf({}) == AudioConfig.from_hf(transformers.Qwen2AudioEncoderConfig().to_dict())
    features = transformers.WhisperFeatureExtractor(feature_size=128).to_dict()
    assert FeatureExtraction.from_hf({}) == FeatureExtraction.from_hf(features)
