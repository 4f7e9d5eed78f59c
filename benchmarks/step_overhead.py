"""The engine's Python per decode step at 16 seats with 4k-token contexts (no model).

Times ``schedule()``, what a runtime does with the step's data (its ``SeatTable``:
each sequence's history and block table), and ``update()``, for a batch of 16
requests that are all decoding after 4,096-token prompts. The model's forward is
left out: this is the overhead the engine adds to every step.

    python benchmarks/step_overhead.py [--seats 16] [--context 4096] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ifb.detok import IncrementalDetokenizer
from ifb.kv import BlockManager
from ifb.outputs import RequestHandle
from ifb.params import RequestSpec, SamplingParams
from ifb.request import Request
from ifb.runtime import SeatTable, SeqOutput, StepOutput
from ifb.scheduler import Scheduler


class OneCharTokenizer:
    eos_token_ids = (0,)

    def encode(self, text, add_special_tokens=True):
        return [1] * len(text)

    def decode(self, ids, skip_special_tokens=True):
        return "a" * len(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return ""


def measure(num_seats: int, context: int, num_steps: int) -> list[float]:
    """Seconds per decode step, one entry per step."""
    tokenizer = OneCharTokenizer()
    block_size = 16
    blocks = BlockManager(num_seats * (context + num_steps + 64) // block_size + 16, block_size)
    scheduler = Scheduler(num_seats=num_seats, token_budget=num_seats * context, blocks=blocks, tokenizer=tokenizer,
                          max_model_len=context + num_steps + 64)
    seats = SeatTable()
    params = SamplingParams(max_tokens=num_steps + 10, temperature=0.0, ignore_eos=True)
    for i in range(num_seats):
        ids = [(i * 7 + j) % 1000 + 1 for j in range(context)]
        scheduler.add(Request(request_id=f"r{i}", spec=RequestSpec(prompt_token_ids=tuple(ids), params=params),
                              prompt_token_ids=ids, max_tokens=num_steps + 10, handle=RequestHandle(f"r{i}"),
                              detok=IncrementalDetokenizer(tokenizer, ids, ()), eos_token_ids=(0,)))

    def run(step) -> None:
        # what a runtime reads of each sequence: its history (penalties, grammars) and its block table
        sum(len(s.all_token_ids) + len(s.block_ids) for s in seats.apply(step))
        scheduler.update(step, StepOutput(tuple(SeqOutput(s.request_id, 5) for s in step.seqs)))

    run(scheduler.schedule())  # the prefill
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        run(scheduler.schedule())
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seats", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    times = sorted(measure(args.seats, args.context, args.steps))
    print(f"seats={args.seats} context={args.context}: median {statistics.median(times) * 1e3:.3f} ms, "
          f"p90 {times[int(0.9 * len(times))] * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
