"""Speculative decoding, the engine's side: what a deployment declares, when to draft, the counters.

A runtime that declares ``SpeculationCaps`` drafts tokens and verifies them in
the same forward: the scheduler gives a speculating decoder ``1 + k`` positions
(its last known token and ``k`` for drafts) under the token budget, with the KV
blocks they need; the runtime's drafter fills the ``k`` and the target model
verifies them, returning the accepted drafts and its own next token. The
request's ``num_computed_tokens`` then advances by what was accepted, and the
blocks only the rejected drafts had used are freed: a verification is the same
``num_computed_tokens`` rule as a prefill chunk or a decode.

``SpeculationPolicy`` picks ``k`` per request and per step, from the request's
measured acceptance and what a longer step costs the whole batch.
"""

from __future__ import annotations

import math
import threading

import attrs

#: the most drafts a request may carry into one step (``K``)
MAX_SPECULATIVE_TOKENS = 16


def check_max_num_drafts(num: int, name: str = "K") -> int:
    """``num`` if it is within 1..16, else ValueError naming ``name`` (the setting) and the range."""
    if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"{name} must be between 1 and {MAX_SPECULATIVE_TOKENS}, not {num!r}")
    return num


@attrs.frozen
class SpeculationPolicy:
    """When drafting costs more than it saves, per request and per step.

    With acceptance ``a`` (the chance a drafted token is accepted, averaged over
    the request's recent verifications), the ``i``-th draft of a step yields a
    token with probability ``a**i``, so ``k`` drafts yield ``a + a**2 + ... + a**k``
    tokens beyond the one a plain decode gives. Each drafted position lengthens
    the step by ``position_cost`` (verification, relative to a one-token step)
    plus ``draft_cost`` (the drafter's), and a longer step delays every seat:
    with ``B`` decoding seats a draft is worth its cost in tokens only when
    ``a**i > (position_cost + draft_cost) * B / (1 + position_cost * (B - 1))``.
    The scheduler drafts the largest ``k`` (up to ``K``) whose last draft still
    clears that bar, and none when the first does not: at batch 1 on a bandwidth-bound
    CPU nearly any acceptance pays, among many busy seats only a high one does.
    """

    #: the cost of one more verified position, relative to a one-token step (measured, see docs/engine.md)
    position_cost: float = 0.05
    #: the drafter's cost per drafted token, relative to a one-token target step
    draft_cost: float = 0.0
    #: acceptance assumed before a request's first verification
    prior_acceptance: float = 0.6
    #: weight of the newest verification in a request's acceptance average
    acceptance_weight: float = 0.3
    #: per step without drafts, a request's acceptance drifts back toward the prior by this share, so a
    #: request that stopped drafting tries again later (its text may start quoting the input)
    recovery: float = 0.02
    #: draft ``K`` every step, whatever it costs (a plugin setting may ask for it)
    is_always: bool = False

    def num_drafts(self, acceptance: float, max_drafts: int, num_decoding: int) -> int:
        """How many drafts (0..``max_drafts``) pay for a request with ``acceptance`` among ``num_decoding`` seats."""
        if max_drafts <= 0:
            return 0
        if self.is_always:
            return max_drafts
        b = max(1, num_decoding)
        bar = (self.position_cost + self.draft_cost) * b / (1.0 + self.position_cost * (b - 1))
        if bar <= 0.0 or acceptance >= 1.0:
            return max_drafts
        if acceptance <= 0.0 or acceptance <= bar:
            return 0
        # the largest k with acceptance**k > bar
        k = math.ceil(math.log(bar) / math.log(acceptance)) - 1
        return max(0, min(max_drafts, k))


@attrs.frozen
class SpeculationCaps:
    """A deployment's speculative decoding, as its plugin declares it for a configuration."""

    #: the draft source: ``ngram`` (prompt lookup) or ``draft-model``
    method: str
    #: ``K``: the most drafts per request and step
    max_num_drafts: int
    policy: SpeculationPolicy = SpeculationPolicy()
    #: what drafts, for logs and /health (``n-gram lookup 2..4``, ``smollm2 (int8 activations)``)
    description: str = ""


@attrs.define
class DraftStats:
    """One request's drafting record (``Request.drafts``)."""

    acceptance: float
    #: why this request drafts no more (``speculative: false``, a draft failure); None: it may draft
    off_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0

    def observe(self, policy: SpeculationPolicy, num_drafted: int, num_accepted: int) -> None:
        """A step verified ``num_drafted`` drafts of this request and accepted ``num_accepted``."""
        if num_drafted:
            # drafts are accepted up to the first rejection: the positions really tried are the accepted
            # ones and that rejected one (the drafts after it were never judged)
            rate = num_accepted / (num_accepted + (num_accepted < num_drafted))
            w = policy.acceptance_weight
            self.acceptance = (1 - w) * self.acceptance + w * rate
            self.num_drafted += num_drafted
            self.num_accepted += num_accepted
        else:
            self.acceptance += (policy.prior_acceptance - self.acceptance) * policy.recovery


@attrs.define
class SpeculationCounters:
    """The speculation counters of ``/health`` and ``/metrics``; changed only by the scheduler."""

    max_num_drafts: int = 0
    #: steps in which at least one request's drafts were verified
    steps_drafted: int = 0
    drafted: int = 0
    accepted: int = 0
    #: per draft position (1..K): drafts verified there, and accepted there
    drafted_by_position: list[int] = attrs.field(factory=list)
    accepted_by_position: list[int] = attrs.field(factory=list)
    #: requests whose drafting failed at run time (they went on without drafts)
    draft_failures: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        n = self.max_num_drafts
        self.drafted_by_position = [0] * n
        self.accepted_by_position = [0] * n

    def record_step(self, verifications: list[tuple[int, int]]) -> None:
        """One step's ``(num_drafted, num_accepted)`` per request whose drafts it verified."""
        verifications = [v for v in verifications if v[0]]
        if not verifications:
            return
        with self.lock:
            self.steps_drafted += 1
            for num_drafted, num_accepted in verifications:
                self.drafted += num_drafted
                self.accepted += num_accepted
                for i in range(min(num_drafted, len(self.drafted_by_position))):
                    self.drafted_by_position[i] += 1
                    self.accepted_by_position[i] += i < num_accepted

    def record_failure(self) -> None:
        with self.lock:
            self.draft_failures += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "max_num_drafts": self.max_num_drafts,
                "steps_drafted": self.steps_drafted, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "acceptance_by_position": [a / d if d else 0.0 for a, d in
                                           zip(self.accepted_by_position, self.drafted_by_position)],
                "drafted_by_position": list(self.drafted_by_position),
                "accepted_by_position": list(self.accepted_by_position),
                "draft_failures": self.draft_failures,
            }
