"""Reading one part of a checkpoint: the tensors under a name prefix, adopted by a module built on meta.

Each part is read on its own from the safetensors files, so a part that is not
built is never read into memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from ifb_plugins.common.loading.hf import safetensors_files

M = TypeVar("M", bound=nn.Module)


def load_prefixed(path: str | Path, prefix: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors named ``{prefix}*``, without the prefix, from the checkpoint directory's safetensors files."""
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    state[name[len(prefix):]] = f.get_tensor(name).to(dtype)
    if not state:
        raise ValueError(f"{path} holds no {prefix}* weights")
    return state


def adopt(make: Callable[[], M], state: dict[str, torch.Tensor], part: str,
          ignore: Callable[[str], bool] = lambda name: False) -> M:
    """Build ``make()`` on the meta device and adopt ``state`` (names checked strictly, except ``ignore``d ones).

    Modules built this way keep no derived buffers (they compute RoPE frequencies when run).
    """
    state = {k: v for k, v in state.items() if not ignore(k)}
    with torch.device("meta"):
        module = make()
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"the checkpoint's {part} weights do not match its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()

