"""``best_of``: candidates generated server-side, the n with the highest cumulative logprob returned.

A request with ``best_of`` = k > n fans out into k sequences as an n > 1
request does (``engine.fan_out``: sequence i seeded ``seed + i``, one prefill
shared under in-flight batching), each asked for its sampled tokens' logprobs.
Their outputs are held here, not streamed (a streamed ``best_of`` is refused);
when the last candidate finishes, the n whose sampled tokens' logprobs sum
highest (the lower index first on a tie) go out, best first, as choices
0..n-1. Logprobs go out only where the request asked for them.
"""

from __future__ import annotations

import attrs

from ifb.outputs import RequestOutput
from ifb.params import SamplingParams


def candidate_params(params: SamplingParams, index: int) -> SamplingParams:
    """Candidate ``index``'s own parameters: one sequence, seeded ``seed + index``, its logprobs kept."""
    seed = {"seed": params.seed + index} if params.seed is not None else {}
    logprobs = {"logprobs": 0} if params.logprobs is None else {}
    return attrs.evolve(params, n=1, best_of=None, **seed, **logprobs)


def cumulative_logprob(outputs: list[RequestOutput]) -> float:
    """The sum of a sequence's sampled tokens' logprobs over its outputs."""
    return sum(lp.logprob for out in outputs for lp in out.logprobs)


@attrs.define
class BestOf:
    """Holds a ``best_of`` request's candidates' outputs until the last finishes, then picks the n best."""

    num_returned: int
    #: whether the request asked for logprobs (the candidates always compute them)
    keeps_logprobs: bool
    outputs: dict[int, list[RequestOutput]] = attrs.field(factory=dict)

    def add(self, output: RequestOutput) -> list[RequestOutput]:
        """Hold one candidate's output; the request's outputs to send once it is the last one (``finished``)."""
        self.outputs.setdefault(output.index, []).append(output)
        return self.select() if output.finished else []

    def ranked(self) -> list[int]:
        """The candidates' indices, highest cumulative logprob first."""
        scores = {i: cumulative_logprob(outs) for i, outs in self.outputs.items()}
        return sorted(scores, key=lambda i: (-scores[i], i))

    def select(self) -> list[RequestOutput]:
        finals = [outs[-1] for outs in self.outputs.values()]
        failed = next((o for o in finals if o.finish_reason == "error"), None)
        if failed is not None:  # one candidate's fault fails the request
            return [attrs.evolve(failed, index=0, finished=True, logprobs=())]
        chosen = self.ranked()[:self.num_returned]
        return [self._merged(self.outputs[i], j, is_last=j == len(chosen) - 1) for j, i in enumerate(chosen)]

    def _merged(self, outs: list[RequestOutput], index: int, *, is_last: bool) -> RequestOutput:
        last = outs[-1]
        return attrs.evolve(
            last, text="".join(o.text for o in outs), token_ids=tuple(t for o in outs for t in o.token_ids),
            logprobs=tuple(lp for o in outs for lp in o.logprobs) if self.keeps_logprobs else (),
            index=index, finished=is_last)
