"""Decode speed on a K-quant GGUF: each tensor on its own block type's kernel vs the same file in float32.

Writes a random-weight GGUF of Qwen2-0.5B's shape (hidden 896, intermediate 4864, 14 heads, 2 KV
heads, vocab 151936; ``--layers`` of them) in llama.cpp's ``Q4_K_M`` mix for that shape: the
896-wide inputs are not whole 256-weight super-blocks, so llama.cpp puts Q/K/V/O and gate/up on
its fallbacks (Q5_0, and Q8_0 for V in the layers that get more bits), ``ffn_down`` (4864 wide) on
Q6_K / Q4_K, the tied embedding on Q8_0. The blocks are random valid bytes (speed does not depend
on the values). Then, one model at a time, greedy decoding from an 8-token prompt:

- ``native``: built from ``quant.parts.BlockParts`` (Q5_0 / Q4_K / Q6_K rows as stored on
  ``stored_matmul``, Q8_0 on the interleaved kernel, int16 activations), the native attention;
- ``float32``: the file dequantized at load (``load_gguf``), torch's matmuls.

Both models are built first, then measured in A-B-B-A order. Decode tokens/s is ``(N - 1)``
tokens over the time after the first one.

    python benchmarks/kquant_decode.py --layers 24 --tokens 32
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
import types
from pathlib import Path

import attrs
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import gguf_shapes  # noqa: E402

SHAPE = gguf_shapes.SHAPES["qwen2.5-0.5b"]


def write_gguf(path: Path, num_layers: int, seed: int = 0) -> dict[str, int]:
    """The file (``gguf_shapes``' Q4_K_M mix), and how many tensors of each type it holds."""
    return gguf_shapes.write_gguf(path, attrs.evolve(SHAPE, num_layers=num_layers), "Q4_K_M", seed=seed)


def decode_rate(model: torch.nn.Module, num_tokens: int) -> float:
    from tests.models.text import greedy_generate

    prompt = list(range(100, 108))
    greedy_generate(model, prompt, 2, block_size=16)  # warm-up
    start = time.perf_counter()
    greedy_generate(model, prompt, 1, block_size=16)
    first = time.perf_counter() - start
    start = time.perf_counter()
    greedy_generate(model, prompt, num_tokens, block_size=16)
    return (num_tokens - 1) / (time.perf_counter() - start - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from ifb_plugins.common.quant import kernels as qkernels
    from ifb_plugins.common.quant.parts import BlockParts
    from ifb_plugins.common.loading.gguf import load_gguf, read_gguf_tensors
    from ifb_plugins.common.loading.checkpoint import build_model

    torch.set_num_threads(args.threads)
    kernels = qkernels.load()
    if kernels is None:
        raise SystemExit("the native kernels cannot be built here")
    kernels.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen2-0.5b-shape-q4_k_m.gguf"
        counts = write_gguf(path, args.layers)
        print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {args.layers} layers, tensors {counts}")
        models = {}
        for mode in ("native", "float32"):
            config, state, _ = load_gguf(path)
            parts = (BlockParts(config, read_gguf_tensors(path), state, "native", layer_stack="torch")
                     if mode == "native" else None)
            model = build_model(types.SimpleNamespace(config=config, state_dict=state), parts=parts)
            del state
            if parts is not None:
                print("native:", parts.report.describe())
            gc.collect()
            weight_bytes = sum(b.numel() * b.element_size() for b in [*model.parameters(), *model.buffers()])
            print(f"{mode}: {weight_bytes / 2**20:.0f} MiB of weights and buffers")
            models[mode] = model
        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB (both models)")
        rates: dict[str, list[float]] = {"native": [], "float32": []}
        for mode in ("native", "float32", "float32", "native"):  # A-B-B-A: drifting load hits both alike
            rates[mode].append(decode_rate(models[mode], args.tokens))
            print(f"{mode}: {rates[mode][-1]:.2f} decode tokens/s")
        means = {mode: sum(r) / len(r) for mode, r in rates.items()}
        print(f"mean native {means['native']:.2f}, float32 {means['float32']:.2f} decode tokens/s: "
              f"native / float32 {means['native'] / means['float32']:.2f}x")

if __name__ == "__main__":
    main()
