"""Read a pi0 checkpoint directory as transformers saves it (``save_pretrained``) into ``Pi0``.

transformers writes pi0 in the hub's (lerobot's) names, ``paligemma_with_expert.paligemma.model.*``,
``paligemma_with_expert.gemma_expert.model.*`` and top-level ``state_proj`` / ``action_*``; its own
module names (``model.vlm.*``, ``model.dit.*``, ``embed_action_time.*``) are read as well. The
expert's token embedding (or the hub's ``lm_head`` in its place) is never used by ``sample_actions``
and is not loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ifb_plugins.action.config import Pi0Config
from ifb_plugins.action.pi0 import Pi0
from ifb_plugins.common.loading.hf import load_hf_state_dict

#: (pattern, replacement) applied in order; a name mapped to "" is not loaded
_RENAMES = (
    (r"^paligemma_with_expert\.paligemma\.lm_head\.", "vlm.language_model.embed_tokens."),
    (r"^paligemma_with_expert\.gemma_expert\.lm_head\..*", ""),
    (r"^paligemma_with_expert\.paligemma\.model\.", "vlm."),
    (r"^paligemma_with_expert\.gemma_expert\.model\.", "dit."),
    (r"^model\.vlm\.", "vlm."),
    (r"^model\.dit\.", "dit."),
    (r"^dit\.embed_tokens\..*", ""),
    (r"^embed_action_time\.", ""),
    (r"^vlm\.language_model\.model\.", "vlm.language_model."),
    (r"^vlm\.vision_tower\.vision_model\.", "vlm.vision_tower."),
    (r"^vlm\.", ""),
)


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in ``Pi0``'s parameters ("" for a tensor pi0's sampler never reads)."""
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
        if not name:
            return ""
    return name


def _is_gemma_norm(name: str) -> bool:
    return name.startswith(("language_model.", "dit.")) and name.endswith("norm.weight")


def load_pi0(path: str | Path, dtype: torch.dtype = torch.float32) -> Pi0:
    """The model of a pi0 directory (``config.json`` and safetensors), every weight checked in."""
    path = Path(path)
    cfg = Pi0Config.from_hf(json.loads((path / "config.json").read_text()))
    state = {}
    for name, tensor in load_hf_state_dict(path).items():
        target = canonical_name(name)
        if target:
            # Gemma's norms scale by (1 + weight): fold the 1 in, so the shared RMSNorm computes them
            state[target] = tensor + 1.0 if _is_gemma_norm(target) else tensor
    model = Pi0(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path} is not a pi0 checkpoint this loader reads: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    return model.to(dtype).eval()
