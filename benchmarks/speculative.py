"""Speculative decoding on the default model, side by side in one run, A-B-B-A.

1. the policy's input and where a verification step's time goes: one sequence's step for 1..9
   positions after a 512-token context, split into the decoder stack's forward, the output head
   (the 49k-vocabulary lm_head, every verified row) and the acceptance (``verify_step``);
2. batch 1, an input-grounded workload (repeat / rewrite a given piece of code): decode tokens/s
   without drafts and with n-gram prompt lookup (under the policy, and drafting K every step);
3. a ``--quantization none`` target alone and with its own GGUF drafting on the int8-activation kernels;
4. 16 busy seats on the same workload: throughput without drafts and with n-gram drafts under the policy;
5. with ``--llama-server`` (or llama.cpp built by ``llama_cpp_build.py``): the same workloads against
   llama.cpp's server, without drafts, with its n-gram lookup (``--spec-type ngram-simple``) and with
   the same GGUF as its draft model (``--spec-type draft-simple --model-draft``).

Each pair of configurations is loaded at once and its requests alternate A-B-B-A per prompt, so a
ratio is taken from runs side by side; ``spread`` is the ratio of the slower to the faster run of
one configuration on one prompt (the machine's run-to-run noise).

    python benchmarks/speculative.py [--max-tokens 96] [--no-llama-cpp] [--publish]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run_all import free_port, machine_info, stop, wait_healthy  # noqa: E402

from ifb import LLM, SamplingParams  # noqa: E402
from ifb.params import RequestSpec  # noqa: E402

CODE = (HERE.parent / "core" / "kv.py").read_text()[:1500]
TASKS = [
    f"Repeat this Python code exactly, then say what it does:\n\n{CODE}",
    f"Rewrite this code with the class renamed to BlockPool and nothing else changed:\n\n{CODE}",
]
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=6)
#: the committed summary the README cites
SUMMARY = HERE / "speculative.json"


def decode_rate(llm: LLM, prompt: str, max_tokens: int) -> float:
    """Decode tokens/s of one request: from its first token to its last."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first, n = None, 0
    for out in llm.stream(messages=[{"role": "user", "content": prompt}], params=params):
        if out.token_ids and first is None:
            first, n = time.perf_counter(), 0
        n += len(out.token_ids)
    return (n - 1) / (time.perf_counter() - first)


def _speculation(llm: LLM) -> dict:
    spec = llm.health().get("speculative_decoding")
    if not spec:
        return {}
    return {"acceptance_rate": spec["acceptance_rate"], "drafted": spec["drafted"], "accepted": spec["accepted"],
            "steps_drafted": spec["steps_drafted"],
            "accepted_per_drafting_step": spec["accepted"] / max(1, spec["steps_drafted"])}


def abba(run_a, run_b, prompts: list) -> tuple[list[list[float]], list[list[float]]]:
    """Per prompt, A B B A: each configuration's two results."""
    a, b = [], []
    for prompt in prompts:
        first_a, first_b, second_b, second_a = run_a(prompt), run_b(prompt), run_b(prompt), run_a(prompt)
        a.append([first_a, second_a])
        b.append([first_b, second_b])
    return a, b


def summarize(name_a: str, a: list[list[float]], name_b: str, b: list[list[float]]) -> dict:
    """Means, the per-prompt ratios of B over A and the spread of each configuration's repeats."""
    ratios = [statistics.mean(rb) / statistics.mean(ra) for ra, rb in zip(a, b)]
    spread = max(max(r) / min(r) for r in (*a, *b))
    return {name_a: {"tok_s": statistics.mean(v for r in a for v in r), "runs": a},
            name_b: {"tok_s": statistics.mean(v for r in b for v in r), "runs": b},
            "ratio": statistics.mean(ratios), "ratio_per_prompt": ratios, "spread": spread}


def batch1_pair(options_a: dict, options_b: dict, names: tuple[str, str], max_tokens: int) -> dict:
    with LLM(**options_a) as la, LLM(**options_b) as lb:
        for llm in (la, lb):
            decode_rate(llm, "Hi", 4)  # warm-up
        a, b = abba(lambda p: decode_rate(la, p, max_tokens), lambda p: decode_rate(lb, p, max_tokens), TASKS)
        out = summarize(names[0], a, names[1], b)
        out[names[1]].update(_speculation(lb))
    return out


def busy_pair(options_b: dict, num_seats: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    common = dict(enable_in_flight_batching=True, max_batch_size=num_seats, max_num_batched_tokens=512)

    def burst(llm: LLM, round_: int) -> float:
        specs = [RequestSpec(messages=({"role": "user", "content": TASKS[i % 2] + f"\n# {round_}.{i}"},),
                             params=params) for i in range(num_seats)]
        start = time.perf_counter()
        results = [h.result() for h in [llm.engine.submit(s) for s in specs]]
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)

    with LLM(**common) as la, LLM(**common, **options_b) as lb:
        a, b = abba(lambda r: burst(la, r), lambda r: burst(lb, r), [0, 1])
        out = summarize("plain", a, "ngram", b)
        out["ngram"].update(_speculation(lb))
    return out


def verification_profile(quantization: str) -> dict:
    """One sequence's step for 1..9 positions after a 512-token context (ms, medians of 7): the whole
    step, and its parts: the decoder stack, the output head over every row, the acceptance."""
    import torch

    from ifb.capabilities import DeployConfig
    from ifb.runtime import NewSeq, ScheduledSeq, ScheduledStep
    from ifb_plugins.common.decoding.speculative import verify_step
    from ifb_plugins.text import declare
    from ifb_plugins.text.build import load_text_runtime
    from ifb_plugins.text.default_model import resolve_model

    config = DeployConfig(model=str(resolve_model(None)), options={"quantization": quantization},
                          max_kv_cache_capacity=1024)
    runtime = load_text_runtime(config, declare(config))
    prompt = tuple(range(100, 612))
    params = SamplingParams(temperature=0.0)
    runtime.execute(ScheduledStep(1, (ScheduledSeq("r", 0, prompt, 0, tuple(range(40)), True),),
                                  (NewSeq("r", 0, prompt, len(prompt), params),)))
    seat = runtime.seats.seats["r"]

    def median_ms(fn) -> float:
        samples = []
        for i in range(10):
            seat.token_ids = list(prompt)
            t = time.perf_counter()
            fn()
            if i >= 3:  # the first runs of a shape warm its kernels up
                samples.append(time.perf_counter() - t)
        return statistics.median(samples) * 1e3

    threads = runtime.step_torch_threads or torch.get_num_threads()
    before = torch.get_num_threads()
    out: dict = {"step_ms": {}, "stack_ms": {}, "head_ms": {}, "accept_ms": {}}
    try:
        for n in (1, 2, 3, 5, 9):
            tokens = tuple(range(200, 200 + n))
            step = ScheduledStep(2, (ScheduledSeq("r", 0, tokens, len(prompt), (), True),))
            out["step_ms"][n] = median_ms(lambda: runtime.execute(step))
            torch.set_num_threads(threads)  # as execute runs its parts
            with torch.inference_mode():
                hidden = runtime._hidden(step, [seat])
                out["stack_ms"][n] = median_ms(lambda: runtime._hidden(step, [seat]))
                out["head_ms"][n] = median_ms(lambda: runtime.model.compute_logits(hidden))
                # the drafts as the step's own argmax would accept them all: the longest acceptance
                logits = runtime.model.compute_logits(hidden)
                drafts = [tuple(logits[:-1].argmax(dim=-1).tolist())]
                seq = ScheduledSeq("r", 0, tokens[:1], len(prompt), (), True, n - 1)
                out["accept_ms"][n] = median_ms(lambda: verify_step(
                    [seq], [seat], drafts, hidden, runtime.model.compute_logits, argmax=runtime.greedy_argmax))
            torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)
    one = out["step_ms"][1]
    out["position_cost"] = statistics.mean((out["step_ms"][n] - one) / (n - 1) / one for n in (2, 3, 5, 9))
    return out


# ---- llama.cpp's server ----

def llama_binary(path: str | None) -> Path | None:
    if path:
        return Path(path)
    import llama_cpp_build

    built = llama_cpp_build.server_path()
    return built if built.exists() else None


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, extra: list[str], seats: int, log: Path, threads: int | None = None):
    port = free_port()
    command = [str(binary), "-m", str(model), "--port", str(port), "-np", str(seats), "-c", str(seats * 2048),
               "-t", str(threads or os.cpu_count()), "--no-webui", *extra]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    with log.open("w") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 300)
        llama_chat(url, "Hi", 4)  # the first forwards pay for allocation
        yield url
    finally:
        stop(proc)


def llama_chat(url: str, prompt: str, max_tokens: int, tag: str = "") -> dict:
    """One greedy chat request; llama.cpp's own timings of its decode (first token to last)."""
    response = httpx.post(url + "/v1/chat/completions", timeout=900, json={
        "messages": [{"role": "user", "content": prompt + tag}], "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "cache_prompt": False})
    response.raise_for_status()
    body = response.json()
    return {"decode_tok_s": body["timings"]["predicted_per_second"],
            "tokens": body["usage"]["completion_tokens"],
            "draft_n": body["timings"].get("draft_n", 0), "draft_n_accepted": body["timings"].get("draft_n_accepted", 0)}


def llama_pair(binary: Path, model: Path, extra: list[str], names: tuple[str, str], max_tokens: int,
               out_dir: Path, seats: int = 1, threads: int | None = None) -> dict:
    drafted: list[dict] = []

    def one(url: str, keep: bool):
        def run(prompt: str) -> float:
            result = llama_chat(url, prompt, max_tokens)
            if keep:
                drafted.append(result)
            return result["decode_tok_s"]
        return run

    def burst(url: str, keep: bool):
        def run(round_: int) -> float:
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(seats) as pool:
                results = list(pool.map(lambda i: llama_chat(url, TASKS[i % 2], max_tokens, f"\n# {round_}.{i}"),
                                        range(seats)))
            if keep:
                drafted.extend(results)
            return sum(r["tokens"] for r in results) / (time.perf_counter() - start)
        return run

    with llama_server(binary, model, [], seats, out_dir / f"llama-{names[0]}-{seats}.log", threads) as ua, \
            llama_server(binary, model, extra, seats, out_dir / f"llama-{names[1]}-{seats}.log", threads) as ub:
        if seats == 1:
            a, b = abba(one(ua, False), one(ub, True), TASKS)
        else:
            a, b = abba(burst(ua, False), burst(ub, True), [0, 1])
    out = summarize(names[0], a, names[1], b)
    n, accepted = sum(r["draft_n"] for r in drafted), sum(r["draft_n_accepted"] for r in drafted)
    out[names[1]].update({"drafted": n, "accepted": accepted, "acceptance_rate": accepted / n if n else 0.0})
    out["flags"] = extra
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--none-max-tokens", type=int, default=32)
    parser.add_argument("--seats", type=int, default=16)
    parser.add_argument("--busy-max-tokens", type=int, default=32)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server (default: llama_cpp_build.py's build)")
    parser.add_argument("--llama-threads", type=int, help="threads of each llama.cpp server (default: every core)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="ifb's side only")
    parser.add_argument("--out", type=Path, default=HERE.parent / "bench-results" / "speculative.json")
    parser.add_argument("--publish", action="store_true", help=f"also write the summary to {SUMMARY.name}")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine_info(quick=False), "load_before": os.getloadavg(),
                    "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}

    def done(key: str, value: dict) -> None:
        report[key] = value
        print(key, json.dumps(value, indent=1), flush=True)
        args.out.write_text(json.dumps(report, indent=1))

    done("verification_profile", {mode: verification_profile(mode) for mode in ("auto", "none")})
    done("batch1_ngram", batch1_pair({}, NGRAM, ("plain", "ngram"), args.max_tokens))
    done("batch1_ngram_always", batch1_pair({}, {**NGRAM, "speculative_policy": "always"},
                                            ("plain", "ngram_always"), args.max_tokens))
    none = {"quantization": "none"}
    done("none_target", batch1_pair(none, {**none, "speculative_model": "smollm2-135m-instruct",
                                           "num_speculative_tokens": 4}, ("plain", "int8_draft"), args.none_max_tokens))
    done("busy", busy_pair(NGRAM, args.seats, args.busy_max_tokens))
    binary = None if args.no_llama_cpp else llama_binary(args.llama_server)
    if binary is not None:
        from ifb_plugins.text.default_model import resolve_model

        model = Path(resolve_model(None))
        ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "6"]
        draft = ["--spec-type", "draft-simple", "--model-draft", str(model), "--spec-draft-n-max", "4"]
        raw = args.out.parent
        done("llama_cpp_batch1_ngram", llama_pair(binary, model, ngram, ("plain", "ngram"), args.max_tokens, raw,
                                                      threads=args.llama_threads))
        done("llama_cpp_batch1_draft", llama_pair(binary, model, draft, ("plain", "draft_model"),
                                                  args.none_max_tokens, raw, threads=args.llama_threads))
        done("llama_cpp_busy", llama_pair(binary, model, ngram, ("plain", "ngram"), args.busy_max_tokens, raw,
                                          seats=args.seats, threads=args.llama_threads))
    report["load_after"] = os.getloadavg()
    args.out.write_text(json.dumps(report, indent=1))
    if args.publish:
        SUMMARY.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
