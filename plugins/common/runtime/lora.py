"""Per-request LoRA adapters (PEFT safetensors directories), applied on the blocking path.

Adapters are registered by name at start-up and loaded once. While a request
that names one runs, forward hooks add ``scale * B(A(x))`` to the targeted
projections; the base weights are never modified.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import attrs
import torch
from safetensors.torch import load_file
from torch import nn


@attrs.frozen
class LoraAdapter:
    name: str
    scale: float
    #: module name (as in model.named_modules()) -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.field(eq=False, repr=False)


def load_adapter(name: str, path: str | Path, model: nn.Module) -> LoraAdapter:
    """Read ``adapter_config.json`` + ``adapter_model.safetensors`` and match them to ``model``."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.exists() or not weights_file.exists():
        raise FileNotFoundError(f"LoRA adapter {name!r}: {path} needs adapter_config.json and adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    modules = dict(model.named_modules())
    pairs: dict[str, list] = {}
    for key, value in tensors.items():
        # PEFT keys look like base_model.model.<module>.lora_A.weight
        stem, _, kind = key.removesuffix(".weight").rpartition(".")
        module = stem.removeprefix("base_model.model.")
        if kind not in ("lora_A", "lora_B"):
            continue
        if module not in modules:
            raise ValueError(f"LoRA adapter {name!r} targets {module}, which this model does not have")
        pairs.setdefault(module, [None, None])["lora_B" == kind] = value.float()
    weights = {m: (a, b) for m, (a, b) in pairs.items() if a is not None and b is not None}
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} has no lora_A/lora_B weight pairs")
    return LoraAdapter(name, scale, weights)


class LoraSet:
    """The adapters registered at start-up, and the one active for the current request."""

    def __init__(self, model: nn.Module, paths: dict[str, str]):
        self.model = model
        self.adapters = {name: load_adapter(name, p, model) for name, p in paths.items()}

    @contextlib.contextmanager
    def active(self, name: str | None):
        if not name:
            yield
            return
        adapter = self.adapters[name]
        modules = dict(self.model.named_modules())
        handles = []
        for module_name, (a, b) in adapter.weights.items():
            a, b = a.to(modules[module_name].weight.device), b.to(modules[module_name].weight.device)

            def hook(mod, args, out, a=a, b=b):
                return out + adapter.scale * ((args[0] @ a.T) @ b.T).to(out.dtype)

            handles.append(modules[module_name].register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
