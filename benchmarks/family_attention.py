"""gpt-oss and Gemma 4 step speed with attention on torch against the native kernel (window and sinks in C).

Both families run their own layer loops (``models.gpt_oss``, ``models.gemma4``); on a CPU in
float32 their attention is now ``quant.kernels``' paged attention with a sliding window and
learned sinks (``native``) instead of a per-sequence gather, mask and softmax in torch
(``torch``, the path before). Each model is built once by transformers with random weights and
saved, loaded by the text plugin's own builder, and its weights shared by a twin whose attention
is the torch path; the twins alternate A-B-B-A per repeat on the same hand-built steps (decode
at batch 1 and 8 with every context past the sliding window, and one prefill chunk), the
model's forward timed alone (no sampling, no scheduler). The best of the repeats is kept.

Shapes (random weights, scaled down in layers and experts, attention as the released models have it):

- gpt-oss: gpt-oss-20b's attention (hidden 2880, 64 query / 8 KV heads of 64, sliding window 128,
  sliding and full layers alternating, sinks), 4 layers, 4 experts of 720 (top 2);
- Gemma 4: gemma-4-E2B's attention (hidden 1536, 8 query / 1 KV head, sliding head 256, global
  head 512, window 512, five sliding to one global), 6 layers, MLP 2048, no KV sharing.

    python benchmarks/family_attention.py --repeats 2 --out bench-results/family_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 1024  # every decode's context: past both windows
PREFILL = 256  # one prefill chunk, at a context of CONTEXT
BATCHES = (1, 8)
BLOCK = 16

GPT_OSS = dict(vocab_size=4096, hidden_size=2880, intermediate_size=720, num_hidden_layers=4,
               num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=128, max_position_embeddings=4096,
               layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA4 = dict(vocab_size=4096, hidden_size=1536, intermediate_size=2048, num_hidden_layers=6,
              layer_types=["sliding_attention"] * 5 + ["full_attention"], num_attention_heads=8,
              num_key_value_heads=1, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
              sliding_window=512, vocab_size_per_layer_input=4096, hidden_size_per_layer_input=256,
              num_kv_shared_layers=0, attention_k_eq_v=False, use_double_wide_mlp=False,
              max_position_embeddings=4096)


def build_twins(family: str, directory: Path) -> dict[str, Any]:
    """The family's model with native attention and its torch-attention twin on the same weights."""
    import attrs
    import torch

    sys.path.insert(0, str(ROOT))
    from ifb_plugins.text.families import build_family_model

    if family == "gpt_oss":
        from tests.models.gpt_oss import save_tiny_gpt_oss as save
        shape = GPT_OSS
    else:
        from tests.models.gemma4 import save_tiny_gemma4 as save
        shape = GEMMA4
    save(directory, seed=0, **shape)
    native, _ = build_family_model(directory)
    if native.config.attention_backend != "native":
        raise RuntimeError(f"{family}: the native kernels are unavailable here")
    with torch.device("meta"):
        twin = type(native)(attrs.evolve(native.config, attention_backend="torch"))
    twin.load_state_dict(native.state_dict(), strict=True, assign=True)  # the same tensors
    return {"native": native, "torch": twin.eval()}


def steps(num_seqs: int, num_tokens: int) -> list[Any]:
    """``(attn, positions)`` of one step: ``num_seqs`` sequences at context ``CONTEXT``, each with
    ``num_tokens`` new tokens, blocks scattered."""
    import torch

    from ifb_plugins.common.layers.attention import build_attn_metadata

    per_seq = -(-CONTEXT // BLOCK)
    seqs = [(CONTEXT - num_tokens, num_tokens, [b * per_seq + i for i in range(per_seq)][::-1])
            for b in range(num_seqs)]
    attn = build_attn_metadata(seqs, BLOCK)
    positions = torch.cat([torch.arange(CONTEXT - num_tokens, CONTEXT) for _ in range(num_seqs)])
    return [attn, positions, num_seqs * per_seq]


def timed(fn: Callable[[], object], min_s: float = 1.5) -> float:
    """Seconds per call (the median of the calls in about ``min_s``, after one warm-up)."""
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < min_s or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(model: Any, cases: dict[str, list[Any]]) -> dict[str, float]:
    """Tokens/s of each case's forward on ``model``."""
    import torch

    out = {}
    for name, (attn, positions, blocks) in cases.items():
        caches = model.allocate_kv_caches(blocks, BLOCK, torch.float32, "cpu")
        for k, v in caches:  # a context that was written: random keys and values
            k.normal_()
            v.normal_()
        ids = torch.randint(0, 4096, positions.shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            seconds = timed(lambda: model(ids, positions, attn, caches))
        out[name] = positions.numel() / seconds
        del caches
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="A-B-B-A rounds per family (the best is kept)")
    parser.add_argument("--families", default="gpt_oss,gemma4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "torch_threads": torch.get_num_threads(), "context": CONTEXT}
    cases = {f"decode_batch{b}": steps(b, 1) for b in BATCHES} | {f"prefill_{PREFILL}": steps(1, PREFILL)}
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            twins = build_twins(family, Path(tmp))
            runs: dict[str, list[dict[str, float]]] = {"torch": [], "native": []}
            for _ in range(args.repeats):
                for name in ("torch", "native", "native", "torch"):  # A-B-B-A
                    runs[name].append(measure(twins[name], cases))
                    print(family, name, json.dumps({k: round(v, 1) for k, v in runs[name][-1].items()}), flush=True)
            best = {name: {case: max(r[case] for r in results) for case in cases} for name, results in runs.items()}
            spread = {name: {case: min(r[case] for r in results) / max(r[case] for r in results) for case in cases}
                      for name, results in runs.items()}
            report[family] = {"tokens_per_s": best, "worst_over_best": spread,
                              "native_over_torch": {c: best["native"][c] / best["torch"][c] for c in cases}}
            del twins
    print(f"\n{'tokens/s':24} {'torch':>9} {'native':>9} {'native/torch':>13}")
    for family in args.families.split(","):
        for case in cases:
            t, n = (report[family]["tokens_per_s"][k][case] for k in ("torch", "native"))
            print(f"{family + ' ' + case:24} {t:9.1f} {n:9.1f} {n / t:12.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
