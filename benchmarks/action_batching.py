"""pi0 trajectory planning: 4 requests in flight against one at a time, side by side in one run (A-B-B-A).

A random-weight pi0 built by transformers (``PI0ForConditionalGeneration`` and ``PI0Processor``,
``save_pretrained``; ``tests/plugins/action/reference.py`` builds it in a process of its own) with
the sizes of ``SIZES`` is served through ``ifb.LLM`` twice in one process: on the blocking path (A,
one request at a time) and under in-flight batching with 4 seats (B). Each leg submits the same
``--requests`` plans at once (one or two cameras, a task, a state, a noise seed each); B's plans are
checked against A's (within 1e-5). Throughput is plans per second over the leg's wall time, and per
second of this process's CPU time (steadier on a machine shared with other jobs); the legs run A, B,
B, A, and each mode's two legs give its spread: where B's slower leg is no faster than A's faster
one, the run is a tie.

    python benchmarks/action_batching.py                 # about 2 minutes on 2 cores
    python benchmarks/action_batching.py --out bench-results/action_batching.json
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: larger than the tests' checkpoint, far smaller than pi0's (PaliGemma 2B + a 300M expert, 3 cameras of
#: 256 tokens): the backbone and the expert 4 layers each, 2 cameras of 16 tokens, pi0's chunk of 50
#: actions of 32 values and 10 steps
SIZES = dict(text_hidden=256, text_layers=4, text_intermediate=1024, text_heads=4, text_head_dim=64,
             vision_hidden=128, vision_intermediate=512, vision_layers=2, vision_heads=4, image_size=56,
             patch_size=14, expert_hidden=128, expert_layers=4, expert_intermediate=512, expert_heads=4,
             expert_head_dim=64, chunk_size=50, max_state_dim=32, max_action_dim=32, vocab=1000)
TASKS = ["pick up the cube", "stack the red block on the blue one", "open the drawer", "wipe the table",
         "put the cup in the sink", "fold the towel", "close the lid", "push the button"]


def build(directory: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.plugins.action.reference", "build", str(directory),
                           json.dumps(SIZES)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])


def camera(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((48, 64, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def specs(num_requests: int) -> list:
    from ifb.params import RequestSpec, Trajectory

    out = []
    for i in range(num_requests):
        images = [{"type": "image_url", "image_url": {"url": camera(10 * i + c)}} for c in range(1 + i % 2)]
        content = [*images, {"type": "text", "text": TASKS[i % len(TASKS)]}]
        state = [0.1 * ((i + k) % 7) - 0.3 for k in range(4)]
        out.append(RequestSpec(messages=({"role": "user", "content": content},),
                               past_trajectory=Trajectory.of([state], noise_seed=i)))
    return out


def leg(llm, requests: list) -> tuple[float, float, list]:
    """Wall seconds and this process's CPU seconds (all its threads) to plan ``requests``, and the plans."""
    import torch

    start, cpu = time.perf_counter(), time.process_time()
    handles = [llm.engine.submit(spec, wait=True) for spec in requests]
    plans = [torch.tensor(h.result().output_trajectory) for h in handles]
    return time.perf_counter() - start, time.process_time() - cpu, plans


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "action_batching.json")
    args = parser.parse_args()
    import torch

    from ifb import LLM

    requests = specs(args.requests)
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        with LLM(tmp, plugin="action") as alone, \
                LLM(tmp, plugin="action", enable_in_flight_batching=True, max_batch_size=4) as batched:
            modes = {"A": ("one at a time", alone), "B": ("4 in flight", batched)}
            leg(alone, requests[:1]), leg(batched, requests[:4])  # warm-up
            legs, reference, worst = [], None, 0.0
            for key in "ABBA":
                name, llm = modes[key]
                wall, cpu, plans = leg(llm, requests)
                legs.append({"mode": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                             "plans_per_s": round(len(plans) / wall, 3), "plans_per_cpu_s": round(len(plans) / cpu, 3)})
                print(json.dumps(legs[-1]), flush=True)
                if reference is None:
                    reference = plans
                worst = max(worst, max(float((p - r).abs().max()) for p, r in zip(plans, reference)))
            assert worst <= 1e-5, f"plans differ by {worst} between the modes"
            denoise = list(batched.deployment.runtime.planner.denoise_batch_sizes)
    summary = {"sizes": SIZES, "requests": args.requests, "legs": legs}
    for metric in ("plans_per_s", "plans_per_cpu_s"):
        rates = {name: [x[metric] for x in legs if x["mode"] == name] for name, _ in modes.values()}
        summary[metric] = {name: {"mean": round(sum(r) / len(r), 3), "min": min(r), "max": max(r)}
                           for name, r in rates.items()}
        fast, slow = rates["4 in flight"], rates["one at a time"]
        summary[metric]["ratio"] = round(sum(fast) / sum(slow), 2)
        # inside the run-to-run spread: the slower B leg no faster than the faster A leg
        summary[metric]["is_tie"] = min(fast) <= max(slow)
    summary.update({
        "max_plan_difference": worst,
        "mean_requests_per_denoising_forward": round(sum(denoise) / len(denoise), 2),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average_at_start": load_at_start,
                    "load_average_at_end": os.getloadavg(), "torch": torch.__version__},
    })
    print(json.dumps(summary, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
