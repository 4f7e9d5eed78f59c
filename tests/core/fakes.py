"""A model-free runtime for engine tests: the next token is a function of the tokens so far."""

from __future__ import annotations

import threading

import attrs

from ifb.capabilities import DeploymentCaps, OptionSupport, Support
from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Prepared, ScheduledStep, SeatTable, SeqOutput, StepOutput

EOS = 0


class FakeTokenizer:
    """Token i is the letter chr(ord('a') + (i - 1) % 26); 0 is end-of-sequence."""

    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - ord("a")) % 26 + 1 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids if i != EOS)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


def next_token(history: tuple[int, ...], vocab: int = 27) -> int:
    # deterministic and independent of batch mates: greedy output is batch-invariant by construction
    return (sum(history) * 7 + len(history)) % (vocab - 1) + 1


def text_caps(**overrides) -> DeploymentCaps:
    fields = dict(stepped_execution=True, seated_admission=True, max_batch_size=8,
                  batch_invariant_verified=True,
                  options={"differing_sampling": OptionSupport(Support.SERVED)})
    fields.update(overrides)
    return DeploymentCaps(**fields)


@attrs.define
class FakeRuntime:
    caps: DeploymentCaps = attrs.field(factory=text_caps)
    model_name: str = "fake"
    max_model_len: int = 512
    kv_block_size: int = 4
    num_kv_blocks: int = 256
    tokenizer: FakeTokenizer = attrs.field(factory=FakeTokenizer)
    #: request ids whose step raises, to test fault isolation
    fail_ids: set = attrs.field(factory=set)
    #: per request id, a forced output length (then EOS)
    lengths: dict = attrs.field(factory=dict)
    steps: list = attrs.field(factory=list)
    released: list = attrs.field(factory=list)
    step_delay: float = 0.0
    gate: threading.Event | None = None  # when set, execute() waits on it (to hold a batch open)
    seats: SeatTable = attrs.field(factory=SeatTable)

    def prepare(self, spec: RequestSpec) -> Prepared:
        if spec.prompt_token_ids is not None:
            return Prepared(tuple(spec.prompt_token_ids))
        text = spec.prompt if spec.prompt is not None else self.tokenizer.apply_chat_template(list(spec.messages))
        if not text:
            raise InvalidRequest("empty prompt")
        return Prepared(tuple(self.tokenizer.encode(text)))

    def execute(self, step: ScheduledStep) -> StepOutput:
        if self.gate is not None:
            self.gate.wait()
        if self.step_delay:
            import time
            time.sleep(self.step_delay)
        self.steps.append(step)
        return self.outputs_for(step, self.seats.apply(step))

    def outputs_for(self, step: ScheduledStep, seats: list) -> StepOutput:
        """The step's output, given each sequence's seat (what ``execute`` makes of a step)."""
        outs = []
        for seq, seat in zip(step.seqs, seats):
            if seq.request_id.split("-")[0] in self.fail_ids or seq.request_id in self.fail_ids:
                raise RuntimeError(f"injected fault for {seq.request_id}")
            if not seq.is_sampling:
                outs.append(SeqOutput(seq.request_id, None))
                continue
            num_out = len(seat.all_token_ids) - seat.num_prompt_tokens
            forced = self.lengths.get(seq.request_id)
            if forced is not None and num_out + 1 >= forced:
                token = EOS
            else:
                token = next_token(tuple(seat.all_token_ids))
                if seat.params.seed is not None and seat.params.temperature > 0:
                    token = (token + seat.params.seed + num_out) % 26 + 1
            lp = -0.5 if seat.params.logprobs is not None else None
            top = tuple((t, -1.0 - i) for i, t in enumerate(range(1, 1 + (seat.params.logprobs or 0))))
            outs.append(SeqOutput(seq.request_id, token, lp, top))
        return StepOutput(tuple(outs))

    def release(self, request_id: str, seat: int) -> None:
        self.released.append((request_id, seat))
        self.seats.release(request_id)
