"""A tiny Qwen3-MoE GGUF in llama.cpp's ``Q4_K_M`` mix, from llama.cpp's own converter.

``save_kquant_moe`` builds a random Qwen3-MoE with transformers' classes (hidden and
expert widths of 256: whole K-quant super-blocks), ``convert_kquant_moe`` converts it to
float32 with ``convert_hf_to_gguf.py`` (``tests/models/llama_cpp.py``) and rewrites the
file's matrices block by block in K-quant types (llama.cpp's ``llama-quantize`` is C++;
``quantize_k`` is a plain round-to-nearest encoder of valid blocks): every metadata key and
every other tensor copied as the converter wrote them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np

from tests.models import llama_cpp
from tests.models.moe import save_tiny_moe

Q = gguf.GGMLQuantizationType
#: llama.cpp's Q4_K_M choices for a MoE's matrices (GGUF name pattern -> type); the rest stay as written
Q4_K_M_MOE: dict[str, Q] = {
    r"blk\.\d+\.ffn_(gate|up)_exps\.weight": Q.Q4_K,
    r"blk\.\d+\.ffn_down_exps\.weight": Q.Q6_K,
    r"blk\.\d+\.attn_[qko]\w*\.weight": Q.Q4_K,
    r"blk\.\d+\.attn_v\.weight": Q.Q6_K,
    r"output\.weight": Q.Q6_K,
    r"token_embd\.weight": Q.Q4_K,
}
#: the tensors kept float32 whatever a pattern says (norms, the router)
_KEPT = re.compile(r".*(norm|ffn_gate_inp)\.weight")


def save_kquant_moe(directory: Path, seed: int = 6, **sizes: object) -> Path:
    """A tiny random Qwen3-MoE saved by transformers, its widths whole K-quant super-blocks."""
    widths = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, num_experts=32, top_k=4,
                  head_dim=64)
    return save_tiny_moe(directory, "qwen3_moe", seed=seed, **{**widths, **sizes})


def requantize(src: Path, dst: Path, types: Mapping[str, Q],
               quantize: Callable[[np.ndarray, Q], np.ndarray], extra_fields: Mapping[str, Any] = {}) -> Path:
    """``src`` (a float32 GGUF) rewritten into ``dst`` with each matrix whose name matches a pattern
    of ``types`` in that type, row by row (stacked experts too), by ``quantize``; ``extra_fields``
    are metadata added (a test's variant of a file)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for name, value in extra_fields.items():
        writer.add_key_value(name, value, gguf.GGUFValueType.get_type(value))
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        qtype = next((t for pattern, t in types.items() if re.fullmatch(pattern, tensor.name)), None)
        if qtype is None or _KEPT.fullmatch(tensor.name) or tensor.tensor_type != Q.F32:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
            continue
        rows = data.reshape(-1, data.shape[-1]).astype(np.float32)
        blocks = quantize(rows, qtype)
        writer.add_tensor(tensor.name, blocks.reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def convert_kquant_moe(root: Path, quantize: Callable[[np.ndarray, Q], np.ndarray],
                       types: Mapping[str, Q] = Q4_K_M_MOE) -> tuple[Path, Path, Path]:
    """``(checkpoint directory, float32 GGUF, K-quant GGUF)`` of ``save_kquant_moe`` under ``root``."""
    hf_dir = save_kquant_moe(root / "hf")
    f32 = root / "qwen3_moe-f32.gguf"
    llama_cpp.convert([(hf_dir, f32, "f32")])
    return hf_dir, f32, requantize(f32, root / "qwen3_moe-q4_k_m.gguf", types, quantize)
