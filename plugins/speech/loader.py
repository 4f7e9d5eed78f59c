"""Load speech checkpoints: a directory with config.json, safetensors weights and tokenizer files.

Weights are prefixed by part: ``thinker.`` (Hugging Face Llama names under
it, e.g. ``thinker.model.layers.0.self_attn.q_proj.weight``), ``talker.`` and
``code2wav.``. Each part is read on its own from the safetensors files, so a
part that is not built (the Talker and decoder under in-flight batching) is
never read into memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import attrs
import torch
from safetensors import safe_open
from torch import nn

from ifb_plugins.speech.code2wav import Code2Wav
from ifb_plugins.speech.config import SpeechConfig
from ifb_plugins.speech.talker import Talker
from ifb_plugins.common.hf_loader import safetensors_files
from ifb_plugins.common.loader import LoadedCheckpoint, build_model
from ifb_plugins.common.model import TextModel, rope_inv_freq
from ifb_plugins.common.tokenizer import TextTokenizer

PARTS = ("thinker", "talker", "code2wav")


@attrs.frozen
class SpeechCheckpoint:
    """A speech checkpoint's description and tokenizer; weights are read per part on demand."""

    path: Path
    config: SpeechConfig
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)

    @property
    def has_thinker(self) -> bool:
        return self.config.thinker is not None


def read_checkpoint(path: str | Path) -> SpeechCheckpoint:
    """Read config.json and the tokenizer of a speech checkpoint directory (no weights)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such model directory: {path}")
    if not path.is_dir() or not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a speech checkpoint directory (config.json is missing)")
    config = SpeechConfig.from_dict(json.loads((path / "config.json").read_text()))
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json: speech models need one for the input text")
    extra_eos = config.thinker.eos_token_ids if config.thinker is not None else ()
    tokenizer = TextTokenizer.from_hf_dir(path, extra_eos_ids=extra_eos)
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > config.talker.text_vocab_size:
        raise ValueError(f"the tokenizer has {vocab} tokens but the Talker embeds only "
                         f"{config.talker.text_vocab_size}")
    return SpeechCheckpoint(path, config, tokenizer)


def load_part(path: str | Path, part: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors named ``{part}.*``, without the prefix, read from the checkpoint's files alone."""
    prefix = f"{part}."
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    state[name[len(prefix):]] = f.get_tensor(name).to(dtype)
    if not state:
        raise ValueError(f"{path} holds no {prefix}* weights")
    return state


def _adopt(make: Callable[[], nn.Module], state: dict[str, torch.Tensor], part: str) -> nn.Module:
    """Build on the meta device and adopt the checkpoint's tensors; a name mismatch is a clear error."""
    with torch.device("meta"):
        module = make()
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint's {part} weights do not match its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(state, strict=True, assign=True)
    return module


def build_thinker(ckpt: SpeechCheckpoint, device: torch.device | str = "cpu") -> TextModel:
    """The Thinker, a text-plugin ``TextModel`` built by the text loader."""
    if ckpt.config.thinker is None:
        raise ValueError(f"{ckpt.path} has no thinker_config: it is a standalone TTS checkpoint")
    loaded = LoadedCheckpoint(ckpt.config.thinker, load_part(ckpt.path, "thinker"), ckpt.tokenizer, "hf", ckpt.path)
    return build_model(loaded, dtype=torch.float32, device=device)


def build_talker(ckpt: SpeechCheckpoint, device: torch.device | str = "cpu") -> Talker:
    cfg = ckpt.config.talker
    state = load_part(ckpt.path, "talker")
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    talker = _adopt(lambda: Talker(cfg), state, "talker")
    # The RoPE buffer is derived, not stored: it was built on meta and stays float32.
    talker.inv_freq = rope_inv_freq(talker.config)
    return talker.to(device).eval()


def build_code2wav(ckpt: SpeechCheckpoint, device: torch.device | str = "cpu") -> Code2Wav:
    cfg = ckpt.config.code2wav
    return _adopt(lambda: Code2Wav(cfg), load_part(ckpt.path, "code2wav"), "code2wav").to(device).eval()
