"""LoRA adapters (PEFT directories), several in one batch.

Adapters are registered by name at start-up (``--lora NAME=DIR``) or loaded and
unloaded while serving (``LoraSet.load`` / ``unload``, the server's admin
routes). A step's rows are grouped by adapter (``LoraSet.step``): a forward
hook on each projection an adapter targets adds ``scale * B(A(x))`` to that
group's rows of the projection's output, one pair of matmuls per adapter and
projection, never a loop over rows; base-model rows are untouched and the base
weights are never modified. The projection may be a float32 ``nn.Linear`` or a
GGUF-block matmul, fused or not (``qkv_proj``, ``gate_up_proj``): the low-rank
product is added to the matching columns of its output.

A request holds its adapter object (not its name) from ``prepare`` on, so an
adapter unloaded while requests use it serves them to their end.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Callable, Sequence

import attrs
import torch
from safetensors.torch import load_file
from torch import nn

#: ``--max-loras``' default: adapters loaded at once
DEFAULT_MAX_LORAS = 4
#: ``--max-lora-rank``'s default
DEFAULT_MAX_LORA_RANK = 64

#: the projections an adapter may target, and the fused module each is a part of after quantization
_PARTS = {
    "self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("gate_up_proj", ("gate_proj", "up_proj")),
}
_SINGLES = {"self_attn": ("o_proj",), "mlp": ("down_proj",)}


def lora_enabled(config) -> bool:
    """Whether a deployment serves adapters: some given at start-up (``--lora``), or room for some (``--max-loras``)."""
    return bool(config.options.get("lora_adapters")) or bool(config.options.get("max_loras"))


#: maps a module name as an adapter spells it to the decoder's (``model.layers.3.self_attn.q_proj``), or to
#: None for a module outside the decoder (a multimodal model's tower)
ModuleNames = Callable[[str], "str | None"]


def _same(module: str) -> str:
    return module


def prefixed_names(prefixes: Sequence[tuple[str, str]]) -> ModuleNames:
    """Module names of a model whose decoder is nested under ``prefixes`` ((prefix, what it becomes), the first
    that matches wins): an adapter made on the whole multimodal model targets the decoder's modules by them."""
    def rename(module: str) -> str | None:
        for prefix, renamed in prefixes:
            if module.startswith(prefix):
                return renamed + module[len(prefix):]
        return None

    return rename


#: cuts an adapter's ``(A [r, in], B [out, r])`` for one projection (by module name) to a rank's share
Shard = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def lora_set(model: nn.Module, config, module_names: ModuleNames = _same, *, shard: Shard | None = None,
             fixed: str | None = None) -> "LoraSet":
    """The adapters a deploy configuration asks for (``lora_adapters``, ``max_loras``, ``max_lora_rank``);
    ``module_names``: how the adapters name the decoder's modules; ``shard`` and ``fixed``: see ``LoraSet``."""
    adapters = dict(config.options.get("lora_adapters") or {})
    max_loras = config.options.get("max_loras") or (max(DEFAULT_MAX_LORAS, len(adapters)) if adapters else 0)
    return LoraSet(model, adapters, max_loras=max_loras,
                   max_rank=config.options.get("max_lora_rank") or DEFAULT_MAX_LORA_RANK, module_names=module_names,
                   shard=shard, fixed=fixed)


class AdapterError(ValueError):
    """An adapter that cannot be served (its message names the module at fault)."""


@attrs.frozen
class LoraAdapter:
    name: str
    rank: int
    scale: float
    #: module name (``model.layers.3.self_attn.q_proj``) -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.field(eq=False, repr=False)
    #: a digest of the weights and scale: the context cache keys an adapter's KV by it
    digest: str = ""

    @property
    def kv_salt(self) -> str:
        return f"lora:{self.name}@{self.digest}"


def projection_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection an adapter may target -> its (in, out) features, by module name."""
    c = model.config
    attn = {"q_proj": (c.hidden_size, c.q_size), "k_proj": (c.hidden_size, c.kv_size),
            "v_proj": (c.hidden_size, c.kv_size), "o_proj": (c.q_size, c.hidden_size)}
    mlp = {"gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
           "down_proj": (c.intermediate_size, c.hidden_size)}
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, shape in attn.items():
            out[f"model.layers.{i}.self_attn.{name}"] = shape
        if hasattr(layer.mlp, "down_proj"):  # a dense MLP (a mixture of experts takes no adapter)
            for name, shape in mlp.items():
                out[f"model.layers.{i}.mlp.{name}"] = shape
    return out


def load_adapter(name: str, path: str | Path, model: nn.Module, *, max_rank: int = DEFAULT_MAX_LORA_RANK,
                 module_names: ModuleNames = _same, shard: Shard | None = None) -> LoraAdapter:
    """Read ``adapter_config.json`` + ``adapter_model.safetensors`` and check them against ``model``
    (``shard``: a tensor-parallel rank's model, whose projections hold its share of each adapter pair).

    Raises AdapterError naming the module for a rank over ``max_rank``, a module the model lacks
    (or that takes no adapter here, or that lies outside its decoder) and weights of the wrong shape.
    """
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.exists() or not weights_file.exists():
        raise AdapterError(f"LoRA adapter {name!r}: {path} needs adapter_config.json and adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r} is a {config['peft_type']} adapter, not LORA")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    shapes = projection_shapes(model)
    device = model.model.norm.weight.device
    pairs: dict[str, list] = {}
    for key, value in load_file(str(weights_file)).items():
        # PEFT keys look like base_model.model.<module>.lora_A.weight
        stem, _, kind = key.removesuffix(".weight").rpartition(".")
        spelled = stem.removeprefix("base_model.model.")
        if kind not in ("lora_A", "lora_B"):
            if "lora_" in kind or key.endswith("lora_magnitude_vector"):
                raise AdapterError(f"LoRA adapter {name!r}: {key} is not supported (only lora_A / lora_B pairs)")
            continue
        module = module_names(spelled)
        if module is None:
            raise AdapterError(f"LoRA adapter {name!r} targets {spelled}, outside the language model (only the "
                               "decoder's projections take an adapter)")
        if module not in shapes:
            lacks = "does not have" if module not in dict(model.named_modules()) else "takes no adapter at"
            raise AdapterError(f"LoRA adapter {name!r} targets {module}, which this model {lacks}")
        pairs.setdefault(module, [None, None])["lora_B" == kind] = value.float()
    weights = {}
    for module, (a, b) in pairs.items():
        if a is None or b is None:
            raise AdapterError(f"LoRA adapter {name!r}: {module} needs both lora_A and lora_B")
        if shard is not None:
            a, b = shard(module, a, b)
        in_features, out_features = shapes[module]
        r = a.shape[0]
        if r > max_rank:
            raise AdapterError(f"LoRA adapter {name!r}: {module} has rank {r}, over --max-lora-rank {max_rank}")
        if tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise AdapterError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this model's projection takes A [r, {in_features}] and B [{out_features}, r]")
        weights[module] = (a.to(device).contiguous(), b.to(device).contiguous())
    if not weights:
        raise AdapterError(f"LoRA adapter {name!r} has no lora_A/lora_B weight pairs")
    digest = hashlib.blake2b(weights_file.read_bytes() + repr(scale).encode(), digest_size=8).hexdigest()
    return LoraAdapter(name, rank, scale, weights, digest)


@attrs.frozen
class _Part:
    """Where an adapted projection's output lies in the module that computes it: columns [lo, hi)."""

    name: str
    lo: int
    hi: int


def _physical(model: nn.Module, name: str, shapes: dict[str, tuple[int, int]]) -> tuple[nn.Module, _Part]:
    """The module that computes projection ``name``, and the columns of its output that are ``name``'s."""
    owner_name, _, proj = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if hasattr(owner, proj):
        return getattr(owner, proj), _Part(name, 0, shapes[name][1])
    fused, parts = _PARTS[owner_name.rpartition(".")[2]]
    lo = 0
    for part in parts:
        width = shapes[f"{owner_name}.{part}"][1]
        if part == proj:
            return getattr(owner, fused), _Part(name, lo, lo + width)
        lo += width
    raise AdapterError(f"{name} is not computed by this model")


@attrs.frozen
class Group:
    """A step's rows under one adapter."""

    adapter: LoraAdapter
    rows: torch.Tensor | None  # [N] row indices; None: every row of the step


class LoraSet:
    """The adapters served by name, and the hooks that apply a step's groups.

    ``load``, ``unload`` and ``get`` may run on any thread; ``step`` runs on the thread that executes steps
    (hooks are installed there, between forwards).

    On a tensor-parallel rank ``shard`` cuts each adapter pair to the rank's share (``A``'s columns for a
    row-parallel projection, ``B``'s rows for a column-parallel one: the partial products meet in the
    projection's own all-reduce), and ``fixed`` says why no adapter is loaded after start-up.
    """

    def __init__(self, model: nn.Module, paths: dict[str, str], *, max_loras: int = 0,
                 max_rank: int = DEFAULT_MAX_LORA_RANK, module_names: ModuleNames = _same,
                 shard: Shard | None = None, fixed: str | None = None):
        self.model = model
        self.max_rank = max_rank
        self.module_names = module_names
        self.shard = shard
        self.fixed: str | None = None
        #: adapters loaded at once (0: the deployment serves none)
        self.max_loras = max_loras
        self._lock = threading.Lock()
        self._shapes: dict[str, tuple[int, int]] | None = None
        self.adapters: dict[str, LoraAdapter] = {}
        #: physical module -> the projections it computes (set on the executing thread)
        self._hooked: dict[nn.Module, list[_Part]] = {}
        self._groups: Sequence[Group] = ()
        if len(paths) > self.max_loras:
            raise AdapterError(f"{len(paths)} adapters given, over --max-loras {self.max_loras}")
        for name, path in paths.items():
            self.load(name, path)
        self.fixed = fixed

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        if self._shapes is None:
            self._shapes = projection_shapes(self.model)
        return self._shapes

    # ---- the registry (any thread) ----
    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and register an adapter (AdapterError: bad adapter; KeyError-free, names are unique)."""
        if self.fixed is not None:
            raise AdapterError(self.fixed)
        adapter = load_adapter(name, path, self.model, max_rank=self.max_rank, module_names=self.module_names,
                               shard=self.shard)
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            if not self.max_loras:
                raise AdapterError("this deployment serves no LoRA adapters: start it with --max-loras N "
                                   "(or --lora NAME=DIR)")
            if len(self.adapters) >= self.max_loras:
                raise AdapterError(f"{len(self.adapters)} LoRA adapters are loaded, the most --max-loras "
                                   f"({self.max_loras}) allows; unload one first")
            self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving ``name`` to new requests (those that hold it finish with it)."""
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise KeyError(f"no LoRA adapter named {name!r} is loaded")

    def get(self, name: str) -> LoraAdapter:
        with self._lock:
            adapter = self.adapters.get(name)
            known = ", ".join(sorted(self.adapters)) or "none loaded"
        if adapter is None:
            raise KeyError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter

    def by_salt(self, kv_salt: str) -> LoraAdapter:
        """The adapter whose ``kv_salt`` this is (a tensor-parallel rank's lookup of rank 0's choice)."""
        with self._lock:
            found = next((a for a in self.adapters.values() if a.kv_salt == kv_salt), None)
        if found is None:
            raise KeyError(f"no LoRA adapter with KV salt {kv_salt!r} is loaded on this rank")
        return found

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.adapters)

    # ---- per step (the executing thread) ----
    def step(self, groups: Sequence[Group]) -> "_Active":
        """Apply ``groups`` to the forwards run inside the returned context."""
        for group in groups:
            self._hook(group.adapter)
        return _Active(self, groups)

    def _hook(self, adapter: LoraAdapter) -> None:
        for name in adapter.weights:
            module, part = _physical(self.model, name, self.shapes)
            parts = self._hooked.get(module)
            if parts is None:
                parts = self._hooked[module] = []
                module.register_forward_hook(self._apply(parts))
            if part not in parts:
                parts.append(part)

    def _apply(self, parts: list[_Part]):
        def hook(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
            for group in self._groups:
                x = args[0] if group.rows is None else args[0].index_select(0, group.rows)
                for part in parts:
                    pair = group.adapter.weights.get(part.name)
                    if pair is None:
                        continue
                    a, b = pair
                    delta = ((x @ a.T) @ b.T) * group.adapter.scale  # as PEFT: B(A(x)) * scaling
                    cols = out if part.lo == 0 and part.hi == out.shape[1] else out[:, part.lo:part.hi]
                    if group.rows is None:
                        cols += delta
                    else:
                        cols.index_add_(0, group.rows, delta)
            return out

        return hook


class _Active:
    def __init__(self, lora: LoraSet, groups: Sequence[Group]):
        self.lora, self.groups = lora, groups

    def __enter__(self) -> None:
        self.lora._groups = self.groups

    def __exit__(self, *exc) -> None:
        self.lora._groups = ()


def step_groups(adapters: Sequence[LoraAdapter | None], lengths: Sequence[int],
                device: torch.device) -> list[Group]:
    """Group a step's rows by adapter: sequence i (``lengths[i]`` rows, in order) under ``adapters[i]``."""
    rows: dict[str, tuple[LoraAdapter, list[int]]] = {}
    start = 0
    for adapter, length in zip(adapters, lengths):
        if adapter is not None:
            rows.setdefault(adapter.kv_salt, (adapter, []))[1].extend(range(start, start + length))
        start += length
    groups = []
    for adapter, ids in rows.values():
        whole = len(ids) == start
        groups.append(Group(adapter, None if whole else torch.tensor(ids, dtype=torch.long, device=device)))
    return groups
