"""Load a LLaVA-style Hugging Face checkpoint directory into a text model plus media encoders.

Layout: ``config.json`` (``text_config``, ``vision_config``, ``audio_config``,
``image_token_id``, ``audio_token_id``), safetensors weights prefixed
``language_model.`` (HF Llama names), ``vision_tower.``, ``audio_tower.``,
``multi_modal_projector.`` and ``audio_projector.``, and ``tokenizer.json`` +
``tokenizer_config.json`` whose special tokens include the placeholders.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from ifb_plugins.common.hf_loader import load_hf_state_dict
from ifb_plugins.common.loader import LoadedCheckpoint, build_model
from ifb_plugins.common.model import TextModel
from ifb_plugins.common.tokenizer import TextTokenizer
from ifb_plugins.vlm.config import VlmConfig
from ifb_plugins.vlm.encoders import MediaModel

TEXT_PREFIX = "language_model."
MEDIA_PREFIXES = ("vision_tower.", "audio_tower.", "multi_modal_projector.", "audio_projector.")


@attrs.frozen
class LoadedVlm:
    config: VlmConfig
    text_model: TextModel = attrs.field(eq=False, repr=False)
    media_model: MediaModel = attrs.field(eq=False, repr=False)
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)
    #: "image" / "audio" -> the placeholder token's text, for the modalities this model takes
    placeholders: dict[str, str] = attrs.field(factory=dict)


def _placeholder_text(tokenizer: TextTokenizer, token_id: int, what: str, vocab_size: int) -> str:
    text = tokenizer.id_to_token(token_id)
    if text is None or not 0 <= token_id < vocab_size:
        raise ValueError(f"{what} {token_id} is not in the vocabulary")
    # It must come back as that one id, or the prompt's placeholders could not be found after rendering.
    if tokenizer.encode(text, add_special_tokens=False) != [token_id]:
        raise ValueError(f"{what} {token_id} ({text!r}) is not a special token of the tokenizer")
    return text


def _load_media(config: VlmConfig, state: dict[str, torch.Tensor], path: Path) -> MediaModel:
    with torch.device("meta"):
        model = MediaModel(config)
    expected = set(model.state_dict())
    missing, extra = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or extra:
        detail = "; ".join(x for x in (f"missing {', '.join(missing[:5])}" if missing else "",
                                       f"unexpected {', '.join(extra[:5])}" if extra else "") if x)
        raise ValueError(f"{path}: the encoder weights do not match the config: {detail}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.float().eval()


def load_vlm_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> LoadedVlm:
    """Read a multimodal checkpoint directory; weights load strictly (missing or extra names raise)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (the vlm plugin loads Hugging Face "
                                "safetensors directories)")
    config = VlmConfig.from_dir(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=config.text.eos_token_ids)
    state = load_hf_state_dict(path)
    text_state = {k.removeprefix(TEXT_PREFIX): v for k, v in state.items() if k.startswith(TEXT_PREFIX)}
    media_state = {k: v for k, v in state.items() if k.startswith(MEDIA_PREFIXES)}
    stray = sorted(state.keys() - media_state.keys() - {TEXT_PREFIX + k for k in text_state})
    if stray:
        raise ValueError(f"{path}: unexpected weights outside the known prefixes: {', '.join(stray[:5])}")
    if not text_state:
        raise ValueError(f"{path}: no language_model.* weights")
    text_model = build_model(LoadedCheckpoint(config.text, text_state, tokenizer, "hf", path), device=device)
    media_model = _load_media(config, media_state, path).to(device)
    placeholders = {}
    if config.image_token_id is not None:
        placeholders["image"] = _placeholder_text(tokenizer, config.image_token_id, "image_token_id",
                                                  config.text.vocab_size)
    if config.audio_token_id is not None:
        placeholders["audio"] = _placeholder_text(tokenizer, config.audio_token_id, "audio_token_id",
                                                  config.text.vocab_size)
    return LoadedVlm(config, text_model, media_model, tokenizer, placeholders)
