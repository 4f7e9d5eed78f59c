"""Tiny checkpoints that transformers saved, and their GGUF files as llama.cpp's converter writes them.

``convert_families`` builds one tiny random model per family with transformers' own classes,
``save_pretrained``s it with its tokenizer (``PreTrainedTokenizerFast``, ``text.save_tiny_tokenizer``), and converts each to
every output type the converter writes (``llama_cpp.OUTTYPES``) in one run of the converter;
``tests/conftest.py`` does it once per session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import attrs
import torch

from tests.models import llama_cpp
from tests.models.hybrid import (save_tiny_granite_hybrid, save_tiny_nemotron_3, save_tiny_nemotron_h,
                                 save_tiny_qwen3_5)
from tests.models.gemma4 import save_gemma_style_tokenizer, save_tiny_gemma4
from tests.models.gpt_oss import save_tiny_gpt_oss
from tests.models.moe import randomize, save_tiny_moe
from tests.models.text import save_tiny_tokenizer

VOCAB_SIZE = 320


def save_tiny_dense(directory: Path, arch: str, seed: int = 0) -> Path:
    """A tiny Llama, Mistral, Qwen2 (biased Q/K/V, untied head) or Qwen3 (Q/K norms) from transformers' classes."""
    import transformers

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=0, eos_token_id=2, tie_word_embeddings=arch != "qwen2")
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              # no window: the tiny prompts are shorter than any, and the reference then attends to all
              "mistral": lambda: transformers.MistralConfig(sliding_window=None, **common),
              "qwen2": lambda: transformers.Qwen2Config(**common),
              "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **common)}[arch]()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    save_tiny_tokenizer(directory)
    return directory


#: family -> how its tiny checkpoint is saved
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llama": lambda d: save_tiny_dense(d, "llama", seed=3),
    "qwen2": lambda d: save_tiny_dense(d, "qwen2", seed=4),
    "mistral": lambda d: save_tiny_dense(d, "mistral", seed=13),
    "qwen3": lambda d: save_tiny_dense(d, "qwen3", seed=5),
    "qwen3_moe": lambda d: save_tiny_moe(d, "qwen3_moe", seed=6),
    "mixtral": lambda d: save_tiny_moe(d, "mixtral", seed=7),
    "nemotron_h": lambda d: save_tiny_nemotron_h(d, seed=8),
    # Granite 4.0 hybrids use no position embedding ("nope"), which is what llama.cpp converts
    "granitemoehybrid": lambda d: save_tiny_granite_hybrid(d, seed=9, position_embedding_type="nope"),
    # and without experts, its head tied to the embedding, as Granite 4.0-H is
    "granite_dense": lambda d: save_tiny_granite_hybrid(d, seed=10, position_embedding_type="nope",
                                                        num_local_experts=0, tie_word_embeddings=True),
}


#: families converted in the same run whose GGUF tests live with the family's own tests
#: (tests/plugins/mamba/test_nemotron_3.py, test_qwen3_5_gguf.py, tests/plugins/text/test_gpt_oss*.py,
#: test_gemma4_gguf.py)
FAMILIES_TESTED_APART: dict[str, Callable[[Path], Path]] = {
    # Nemotron 3: Nemotron-H with MoE layers (llama.cpp's nemotron_h_moe)
    "nemotron_3": lambda d: save_tiny_nemotron_3(d, seed=11),
    "gpt_oss": lambda d: save_tiny_gpt_oss(d, seed=12),
    "qwen3_5": lambda d: save_tiny_qwen3_5(d, seed=14),
    "qwen3_5_moe": lambda d: save_tiny_qwen3_5(d, seed=15, moe=True),
    # Gemma 4 text, with a tokenizer of Gemma's kind (the only kind its converter reads)
    "gemma4": lambda d: _with_gemma_tokenizer(save_tiny_gemma4(d, seed=16)),
}

def _with_gemma_tokenizer(directory: Path) -> Path:
    save_gemma_style_tokenizer(directory)
    return directory


#: the converter's own options a family needs. Qwen3.5: ``--no-mtp``. The released checkpoints carry a
#: multi-token-prediction block (``mtp_num_hidden_layers``, ``mtp.*`` tensors) which transformers'
#: ``Qwen3_5ForCausalLM`` does not build, so its ``save_pretrained`` writes neither; without the flag
#: the converter, finding no ``mtp.*`` tensor to count, stops on ``assert self.opt_num_mtp_layers != 0``.
CONVERTER_FLAGS: dict[str, tuple[str, ...]] = {"qwen3_5": ("--no-mtp",), "qwen3_5_moe": ("--no-mtp",)}


@attrs.frozen
class Converted:
    """One family's checkpoint directory and its GGUF file per output type."""

    hf_dir: Path
    ggufs: dict[str, Path]


def convert_families(root: Path) -> dict[str, Converted]:
    """Every family of ``FAMILIES`` and ``FAMILIES_TESTED_APART`` saved under ``root`` and converted to
    every ``llama_cpp.OUTTYPES``."""
    out = {}
    for family, save in {**FAMILIES, **FAMILIES_TESTED_APART}.items():
        hf_dir = save(root / family)
        out[family] = Converted(hf_dir, {t: root / f"{family}-{t}.gguf" for t in llama_cpp.OUTTYPES})
    llama_cpp.convert([(c.hf_dir, path, t, CONVERTER_FLAGS.get(family, ()))
                       for family, c in out.items() for t, path in c.ggufs.items()])
    return out
