"""A quantized ``TextModel``'s whole decoder stack as one native call per step.

Once every projection runs on GGUF blocks (``quant.BlockLinear``), what is left
of a decode step in Python is dispatch: a few dozen small tensor operations per
layer, each costing more than its arithmetic. ``NativeDecoder`` hands the layer
loop to ``csrc/qkernels.c`` (``ifb_decoder_forward``): the same norms, fused Q/K/V
and gate/up matmuls, RoPE, KV-cache writes, paged attention and residual adds,
with the same per-row arithmetic as the per-module path, so a row's result
still does not depend on its batch mates or on how its prompt was chunked.

It is one ``models.parts.LayerStack``, beside the layer loop
(``TorchLayerStack``): ``quant.parts.BlockParts`` picks it as the model is built
when the layers fit (``fits_native_decoder``): every projection on
``BlockLinear`` (Q, K and V fused, or, when their block types differ as in
llama.cpp's ``Q4_K_M``, three parts written into the columns of one row), and a
mixture-of-experts layer (``moe.SparseMoE``) with every routed expert on ``BlockLinear``
(``ExpertModules``) and its shared expert's gate/up fused: the routing (top-k, renormalization,
the shared expert's gate) and the experts' block matmuls, rows grouped per expert across the
batch, run in ``csrc/decoder_moe.h``. It reads the very modules the layer loop would run.
Its weights are bound at the first step (after ``build_model`` loaded them):
float32 norms, and (checked per step) contiguous float32 or float16 KV caches.

The parameter structs are defined once, in ``csrc/decoder_params.h``: the C
structs are generated from its field lists, the ctypes mirror here is built
from the same lists (``STRUCTS``), and each ``NativeDecoder`` first checks the
mirror against the compiled library's own report of every size and offset.
"""

from __future__ import annotations

import ctypes
import re
from typing import Sequence

import torch
from torch import nn

from ifb_plugins.common.layers.attention import AttnMetadata
from ifb_plugins.common.models.config import TextModelConfig
from ifb_plugins.common.layers.moe import ExpertModules, SharedExpert, SparseMoE
from ifb_plugins.common.models.decoder import MLP, Attention, DecoderLayer
from ifb_plugins.common.quant.kernels import ACTIVATIONS, KV_DTYPES, Activations, Kernels, check_attention_metadata, sources
from ifb_plugins.common.quant.linear import BlockLinear

_ptr, _long, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_float

#: the C header that defines the parameter structs (the one definition of their layout)
PARAMS_HEADER = "decoder_params.h"
#: a list macro, ``#define IFB_..._FIELDS(F)`` or ``IFB_DECODER_STRUCTS(S)``, up to the blank line after it
_LIST_RE = re.compile(r"#define (IFB_\w+)\([FS]\)(.*?)(?:\n\s*\n|\Z)", re.S)
_ENTRY_RE = re.compile(r"\b[FS]\(([^,()]+),\s*(\w+)\)")
_SCALARS = {"long": ctypes.c_long, "float": ctypes.c_float, "int": ctypes.c_int}


def parse_layout(header: str) -> dict[str, list[tuple[str, str]]]:
    """The structs of ``decoder_params.h`` in its report order: {struct: [(C type, field), ...]}."""
    lists = {name: _ENTRY_RE.findall(body) for name, body in _LIST_RE.findall(header)}
    return {struct.strip(): [(t.strip(), f) for t, f in lists[fields]]
            for struct, fields in lists["IFB_DECODER_STRUCTS"]}


def _ctype(c_type: str, structs: dict[str, type]) -> object:
    base = c_type.replace("const ", "").strip()
    if base in structs:
        return structs[base]
    if base in _SCALARS:
        return _SCALARS[base]
    if base.endswith("*"):
        inner = base[:-1].strip()
        if inner in structs:
            return ctypes.POINTER(structs[inner])
        return ctypes.POINTER(_ptr) if inner.endswith("*") else _ptr
    raise ValueError(f"{PARAMS_HEADER}: no ctypes type for {c_type!r}")


def build_structs(layout: dict[str, list[tuple[str, str]]]) -> dict[str, type[ctypes.Structure]]:
    """The ctypes mirror of ``layout`` (``parse_layout``), one ``Structure`` per C struct."""
    structs: dict[str, type[ctypes.Structure]] = {}
    for name, fields in layout.items():
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": [(f, _ctype(t, structs)) for t, f in fields]})
    return structs


def reported_layout(lib: ctypes.CDLL) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """What the compiled library lays out: {struct: (size, [(field, offset), ...])}."""
    lib.ifb_decoder_layout_names.restype = ctypes.c_char_p
    lib.ifb_decoder_layout.argtypes = [ctypes.POINTER(_long), _long]
    lib.ifb_decoder_layout.restype = _long
    names = [part.split(":") for part in lib.ifb_decoder_layout_names().decode().split(";") if part]
    count = lib.ifb_decoder_layout(None, 0)
    numbers = (_long * count)()
    lib.ifb_decoder_layout(numbers, count)
    out, at = {}, 0
    for struct, fields in names:
        fields = [f for f in fields.split(",") if f]
        out[struct] = (numbers[at], list(zip(fields, numbers[at + 1:at + 1 + len(fields)])))
        at += 1 + len(fields)
    return out


def layout_mismatches(structs: dict[str, type[ctypes.Structure]],
                      reported: dict[str, tuple[int, list[tuple[str, int]]]]) -> list[str]:
    """Where the ctypes mirror and the compiled library disagree (empty: they agree)."""
    problems = [f"struct {name} is {'only in the library' if name in reported else 'missing from the library'}"
                for name in sorted(set(structs) ^ set(reported))]
    for name in [n for n in structs if n in reported]:
        mirror = [(f, getattr(structs[name], f).offset) for f, _ in structs[name]._fields_]
        size, fields = reported[name]
        for field in sorted({f for f, _ in mirror} ^ {f for f, _ in fields}):
            side = "the library" if field in dict(fields) else "the ctypes mirror"
            problems.append(f"{name}.{field} is only in {side}")
        if mirror != fields:
            problems.append(f"{name}: fields at {mirror} in the ctypes mirror, {fields} in the library")
        if ctypes.sizeof(structs[name]) != size:
            problems.append(f"{name}: {ctypes.sizeof(structs[name])} bytes in the ctypes mirror, {size} in the library")
    return problems


STRUCTS = build_structs(parse_layout(sources()[PARAMS_HEADER].decode()))
_Weight, _Layer, _Decoder, _Step = (STRUCTS[n] for n in ("weight_t", "layer_t", "decoder_t", "step_t"))


def check_layout(kernels: Kernels) -> None:
    """Raise unless the compiled library lays the parameter structs out as ``STRUCTS`` does."""
    problems = layout_mismatches(STRUCTS, reported_layout(kernels.lib))
    if problems:
        raise RuntimeError(f"the native decoder's parameters disagree with {kernels.path.name}: " + "; ".join(problems))


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(linear: BlockLinear) -> _Weight:
    return _Weight(linear.kind, ACTIVATIONS[linear.activations], linear.blocks.data_ptr(), _ptr_of(linear.bias),
                   linear.out_features, linear.in_features)


#: an empty part of the q | k | v rows (n = 0: the C code skips it)
_NO_ROWS = _Weight(0, 0, None, None, 0, 0)


def _qkv_parts(attn: nn.Module) -> tuple[nn.Module | None, ...]:
    """The modules of the q | k | v rows: the fused projection, or (block types differing, as in
    llama.cpp's Q4_K_M mix with V in Q6_K) q, k and v."""
    if getattr(attn, "qkv_proj", None) is not None:
        return (attn.qkv_proj,)
    return tuple(getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj"))


#: ``TextModelConfig.router`` values the C code routes, by its ``router_kind``
ROUTER_KINDS = {"softmax_topk": 0, "topk_softmax": 1}


def _mlp_modules(mlp: nn.Module) -> tuple[nn.Module | None, ...] | None:
    """The projections of an MLP the native decoder runs (all must be ``BlockLinear``), or None
    for an MLP it does not compute."""
    if type(mlp) is MLP:
        return getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if type(mlp) is not SparseMoE or type(mlp.experts) is not ExpertModules or mlp.router not in ROUTER_KINDS:
        return None
    if mlp.gate.weight.dtype != torch.float32:
        return None
    modules = (*mlp.experts.gate_up, *mlp.experts.down)
    if mlp.shared_expert is not None:
        if type(mlp.shared_expert) is not SharedExpert:
            return None
        modules += (mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj)
    return modules


def fits_native_decoder(layers: Sequence[nn.Module], config: TextModelConfig) -> bool:
    """Whether ``NativeDecoder`` computes what ``layers`` compute: ``decoder.DecoderLayer``'s own
    attention and MLP or ``moe.SparseMoE`` (a subclass may compute something else) with every
    projection a ``BlockLinear``."""
    for layer in layers:
        attn = layer.self_attn
        if (type(layer), type(attn)) != (DecoderLayer, Attention):
            return False
        mlp = _mlp_modules(layer.mlp)
        if mlp is None or not all(isinstance(m, BlockLinear) for m in (*_qkv_parts(attn), attn.o_proj, *mlp)):
            return False
    return bool(layers)


class NativeDecoder:
    """A ``models.parts.LayerStack``: ``(x, cos, sin, attn, kv_caches) -> x`` for the whole stack in one call."""

    def __init__(self, layers: nn.ModuleList, config: TextModelConfig, kernels: Kernels, *,
                 prompt_activations: Activations | None = None) -> None:
        """``prompt_activations`` (``int8``, or None: the weights' own): the codes of the dense layers'
        matmuls on a step's prompt rows (positions below their sequence's prompt length, where the
        step's ``AttnMetadata`` gives it), the generated rows keeping their weights' activations."""
        if not fits_native_decoder(layers, config):
            raise ValueError("the native decoder runs layers whose every projection is a BlockLinear")
        if prompt_activations not in (None, "int16", "int8"):
            raise ValueError(f"prompt rows take int16 or int8 codes, not {prompt_activations!r}")
        check_layout(kernels)
        self.config = config
        self.prompt_passes = None if prompt_activations is None else ACTIVATIONS[prompt_activations]
        self.layers = layers  # the model's own modules: the weights the pointers point into
        self._forward = kernels.lib.ifb_decoder_forward
        self._forward.argtypes = [ctypes.POINTER(_Decoder), ctypes.POINTER(_Step), _ptr]
        self._forward.restype = ctypes.c_int
        self._decoder: object | None = None  # bound at the first step, once the weights are loaded
        self._keep: list[object] = []  # what the structs point into beyond the modules' own tensors
        self._caches: tuple[tuple[int, ...], object, object, int] | None = None

    def _bind(self) -> object:
        """The parameter structs over the layers' weights (float32 norms)."""
        c = self.config
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if c.qk_norm:
                norms += [attn.q_norm, attn.k_norm]
            if not all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() and not n.weight.is_meta
                       for n in norms):
                raise ValueError("the native decoder needs loaded, contiguous float32 norm weights")
            layers.append(_Layer(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                attn.q_norm.weight.data_ptr() if c.qk_norm else None,
                attn.k_norm.weight.data_ptr() if c.qk_norm else None,
                *(list(map(_weight, _qkv_parts(attn))) + [_NO_ROWS, _NO_ROWS])[:3],
                _weight(attn.o_proj), *self._mlp_fields(mlp)))
        self._layers = (_Layer * len(layers))(*layers)
        self._decoder = _Decoder(len(layers), c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                                 c.head_dim, c.rms_norm_eps, self._layers)
        return self._decoder

    def _mlp_fields(self, mlp: nn.Module) -> list[object]:
        """The layer struct's MLP fields: a dense MLP's gate/up and down, or a mixture of experts'
        routing, experts (arrays kept alive here) and shared expert."""
        if isinstance(mlp, MLP):
            return [_weight(mlp.gate_up_proj), _weight(mlp.down_proj), 0, 0, 0, 0, 0, None, None, None,
                    _NO_ROWS, _NO_ROWS, None]
        experts = mlp.experts
        gate_up = (_Weight * experts.num_experts)(*map(_weight, experts.gate_up))
        down = (_Weight * experts.num_experts)(*map(_weight, experts.down))
        router = mlp.gate.weight.detach().contiguous()
        shared, gate = mlp.shared_expert, None
        if shared is not None:
            gate = mlp.shared_expert_gate.weight.detach().float().contiguous()
        self._keep += [gate_up, down, router, gate]
        return [_NO_ROWS, _NO_ROWS, experts.num_experts, mlp.top_k, ROUTER_KINDS[mlp.router], int(mlp.normalize),
                experts.down[0].in_features, router.data_ptr(), gate_up, down,
                _weight(shared.gate_up_proj) if shared is not None else _NO_ROWS,
                _weight(shared.down_proj) if shared is not None else _NO_ROWS, _ptr_of(gate)]

    def __repr__(self) -> str:
        return f"NativeDecoder({len(self.layers)} layers)"

    def _cache_arrays(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[object, object, int]:
        """The caches' pointer arrays and whether they hold float16 (checked once per set of caches)."""
        ptrs = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._caches is None or self._caches[0] != ptrs:
            c = self.config
            shape = (c.num_kv_heads, c.head_dim)
            dtype = kv_caches[0][0].dtype
            for k, v in kv_caches:
                for cache in (k, v):
                    if (cache.dtype != dtype or dtype not in KV_DTYPES or not cache.is_contiguous()
                            or tuple(cache.shape[2:]) != shape):
                        raise ValueError("the native decoder needs contiguous float32 or float16 KV caches "
                                         f"[blocks, slots, {shape[0]}, {shape[1]}], all of one dtype")
            n = len(kv_caches)
            self._caches = (ptrs, (_ptr * n)(*ptrs[0::2]), (_ptr * n)(*ptrs[1::2]), KV_DTYPES[dtype])
        return self._caches[1], self._caches[2], self._caches[3]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnMetadata,
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        decoder = self._bind() if self._decoder is None else self._decoder
        t, d = x.shape[0], decoder.d
        if len(kv_caches) != decoder.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {decoder.num_layers} layers")
        # TextModel.rotary hands out cos / sin as views of one [T, 2, D] table; rebuild it otherwise.
        if cos.dtype == torch.float32 and cos.stride(0) == 2 * d and sin.data_ptr() == cos.data_ptr() + 4 * d:
            rope, keep = cos.data_ptr(), None
        else:
            keep = torch.stack((cos.reshape(t, d), sin.reshape(t, d)), dim=1).float().contiguous()
            rope = keep.data_ptr()
        k_ptrs, v_ptrs, kv_half = self._cache_arrays(kv_caches)
        check_attention_metadata(attn, kv_caches[0][0].shape[1])
        if attn.slot_mapping.dtype != torch.int64:
            raise ValueError("the native kernels read contiguous int64 attention metadata")
        tables, starts, lens = attn.block_tables, attn.query_start_loc, attn.seq_lens
        out = x.float().contiguous().clone()  # updated in place: never write into the caller's tensor
        row_passes = self._row_passes(attn)
        step = _Step(t, rope, attn.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], starts.data_ptr(),
                     lens.data_ptr(), lens.shape[0], attn.block_size, k_ptrs, v_ptrs, kv_half,
                     _ptr_of(row_passes))
        status = self._forward(ctypes.byref(decoder), ctypes.byref(step), out.data_ptr())
        if status == -1:
            raise MemoryError("the native decoder could not allocate its work buffers")
        if status != 0:
            raise RuntimeError(f"the native decoder's block matmuls refused their weights (status {status})")
        del keep, row_passes
        return out

    def _row_passes(self, attn: AttnMetadata) -> torch.Tensor | None:
        """The step's rows' passes (``step_t.row_passes``): ``prompt_passes`` on the prompt's positions,
        the weights' own on the others; None when every row takes the weights' own. A row's codes
        follow from its position and its sequence's prompt length alone, never from its batch
        mates or from how the prompt was chunked."""
        prompts = attn.num_prompt_tokens_host
        if self.prompt_passes is None or prompts is None:
            return None
        own = ACTIVATIONS[self.layers[0].self_attn.o_proj.activations]
        if own == 0 or own == self.prompt_passes:
            return None
        passes = torch.full((sum(attn.query_lens_host),), own, dtype=torch.uint8)
        row = 0
        for n, end, prompt in zip(attn.query_lens_host, attn.seq_lens_host, prompts):
            num_prompt_rows = max(0, min(end, prompt) - (end - n))  # positions end - n .. end - 1
            passes[row:row + num_prompt_rows] = self.prompt_passes
            row += n
        return passes if bool((passes == self.prompt_passes).any()) else None

