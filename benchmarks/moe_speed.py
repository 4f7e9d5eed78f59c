"""Decode speed of a mixture-of-experts GGUF against a dense one with the same active parameters.

Both are random-weight Qwen3-shaped models written as llama.cpp writes them (Q4_0 matrices,
float32 norms and router), built here in one run:

- MoE (``qwen3moe``): hidden 1024, 12 layers, 16 query / 4 KV heads of 64, 16 experts of
  intermediate 512, top-2 (norm_topk_prob), vocabulary 16384;
- dense (``qwen3``): the same, with one MLP of intermediate 1024 (= 2 x 512) per layer, so a
  token reads as many expert weights as the dense model's MLP has.

Each loads through ``ifb.LLM`` (``quantization="auto"``: the GGUF blocks times 15-bit
activations on the native kernels); decode tokens/s is measured with ``runtime.execute`` on
hand-built decode steps at batch 1 and 16 seats after a 100-token prefill
(``decode_speed.measure_direct``), the models alternating ``--repeats`` times so that all
see the same machine load; the best of the repeats is kept. The native decoder runs both
models' whole layer stacks in C (the MoE's routing and experts included); the dense model's
layer loop in Python is measured too, for the cost of Python dispatch, and the MoE's (the path
MoE models took before their layers ran natively).

    python benchmarks/moe_speed.py                 # about 3 minutes on 2 cores
    python benchmarks/moe_speed.py --out moe.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPE = dict(vocab_size=16384, hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
             num_experts=16, top_k=2, moe_intermediate_size=512)
BATCHES = (1, 16)


def write_models(directory: Path, seed: int = 0) -> dict[str, Path]:
    """The MoE GGUF and its dense twin, random weights (fan-in scaled), Q4_0."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test tree's tiny checkpoints
    from tests.models.moe import hf_moe_config, save_tokenizer_files, write_moe_gguf

    moe = hf_moe_config("qwen3_moe", **SHAPE, norm_topk_prob=True, head_dim=64)
    dense = Qwen3Config(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
                        num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_heads"],
                        num_key_value_heads=SHAPE["num_kv_heads"], head_dim=64,
                        intermediate_size=SHAPE["top_k"] * SHAPE["moe_intermediate_size"],
                        max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
                        tie_word_embeddings=False)
    paths = {}
    gen = torch.Generator().manual_seed(seed)
    for name, config in (("moe", moe), ("dense", dense)):
        hf_dir = directory / name
        config.save_pretrained(hf_dir)
        save_tokenizer_files(hf_dir)
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
        state = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) / math.sqrt(s[-1]))
                 for k, s in shapes.items()}
        paths[name] = write_moe_gguf(hf_dir, directory / f"{name}.gguf", gguf.GGMLQuantizationType.Q4_0, state=state)
        del state
    return paths


def measure(path: Path, batches: tuple[int, ...], *, python_layers: bool = False) -> dict[str, Any]:
    """Decode tokens/s per batch size; ``python_layers``: without the native decoder (the layer
    loop), to separate its cost from the experts' dispatch."""
    from ifb.capabilities import DeployConfig
    from ifb_plugins.common.models.native_decoder import NativeDecoder
    from ifb_plugins.text import declare
    from ifb_plugins.text.build import load_text_runtime

    sys.path.insert(0, str(HERE))
    from decode_speed import measure_direct

    config = DeployConfig(model=str(path), max_batch_size=max(batches), enable_in_flight_batching=True,
                          options={"quantization": "auto"})
    # the text plugin's own build, with the layer loop chosen when the model is built
    runtime = load_text_runtime(config, declare(config), layer_stack="torch" if python_layers else "auto")
    out: dict[str, Any] = {f"batch{b}_decode_tokens_per_s": measure_direct(runtime, b) for b in batches}
    out["layers_run_natively"] = isinstance(runtime.model.layer_stack, NativeDecoder)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per model (the best is kept)")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON")
    args = parser.parse_args(argv)

    import torch

    report: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "shape": SHAPE,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        paths = write_models(Path(tmp))
        report["sizes_mib"] = {k: round(p.stat().st_size / 2**20, 1) for k, p in paths.items()}
        print(f"wrote the GGUFs in {time.perf_counter() - started:.0f} s: {report['sizes_mib']}", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {"moe": [], "dense": [], "dense_python_layers": [],
                                                 "moe_python_layers": []}
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(measure(paths[name.removesuffix("_python_layers")], BATCHES,
                                          python_layers=name.endswith("_python_layers")))
                print(name, json.dumps(runs[name][-1]), flush=True)
    for name, results in runs.items():
        report[name] = {k: max(r[k] for r in results) if k.endswith("_per_s") else results[0][k] for k in results[0]}
    print(f"\n{'decode tokens/s':16} {'MoE':>8} {'dense':>8} {'MoE/dense':>10} {'dense, Python layers':>21} "
          f"{'MoE/that':>9} {'MoE, Python layers':>19} {'native/Python':>14}")
    for b in BATCHES:
        key = f"batch{b}_decode_tokens_per_s"
        moe, dense, slow = report["moe"][key], report["dense"][key], report["dense_python_layers"][key]
        moe_loop = report["moe_python_layers"][key]
        report[f"ratio_batch{b}"] = moe / dense
        report[f"ratio_batch{b}_python_layers"] = moe / slow
        report[f"ratio_batch{b}_moe_native_to_python_layers"] = moe / moe_loop
        print(f"{'batch ' + str(b):16} {moe:8.1f} {dense:8.1f} {moe / dense:9.2f}x {slow:21.1f} {moe / slow:8.2f}x "
              f"{moe_loop:19.1f} {moe / moe_loop:13.2f}x")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
