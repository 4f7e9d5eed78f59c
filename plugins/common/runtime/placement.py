"""The device and weights dtype a plugin builds its deployment on (``--device`` / ``--dtype``).

The core resolves ``DeployConfig.device`` before a deployment loads (``ifb.placement``);
``device_of`` resolves it again where a loader runs without that step (a tensor-parallel shard),
so a plugin always gets a real device. ``weights_dtype`` maps ``DeployConfig.dtype`` to the
torch dtype the loader builds its floating weights in.
"""

from __future__ import annotations

import torch

from ifb.capabilities import DeployConfig
from ifb.placement import resolve_device

#: the torch dtype of each ``--dtype`` name but ``auto``
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: every dtype a loader may build its weights in
FLOAT_DTYPES = frozenset(TORCH_DTYPES.values())


def device_of(config: DeployConfig) -> torch.device:
    """The torch device ``config`` runs on (``cuda`` normalised to ``cuda:0``)."""
    device = torch.device(resolve_device(config.device))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def weights_dtype(config: DeployConfig, *, supported: frozenset[torch.dtype] = FLOAT_DTYPES,
                  what: str = "this deployment") -> torch.dtype:
    """The dtype of the weights: ``auto`` is bfloat16 on CUDA and float32 on the CPU (float32 when
    ``supported`` lacks bfloat16); an explicit dtype outside ``supported`` is a ValueError."""
    name = config.dtype or "auto"
    if name == "auto":
        wanted = torch.bfloat16 if device_of(config).type == "cuda" else torch.float32
        return wanted if wanted in supported else torch.float32
    if name not in TORCH_DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of auto, {', '.join(TORCH_DTYPES)}")
    dtype = TORCH_DTYPES[name]
    if dtype not in supported:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in supported))
        raise ValueError(f"--dtype {name}: {what} builds its weights in {names} only")
    return dtype


def float32_only(config: DeployConfig, what: str) -> torch.dtype:
    """float32, for a loader whose numerics are built (and tested) in float32 only: ``--dtype auto``
    is float32 there and any other explicit dtype a ValueError naming ``what``."""
    return weights_dtype(config, supported=frozenset({torch.float32}), what=what)
