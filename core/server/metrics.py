"""``/metrics``: Prometheus text format from a private registry per app.

Latencies and token counts are measured by the route handlers as outputs
arrive; the engine's scheduling counters are read at scrape time, so they
always match ``/health``.
"""

from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ifb.outputs import RequestOutput

PREFIX = "ifb_"
#: scheduling counters exported as ``ifb_scheduling_<name>_total``
_CUMULATIVE = ("submitted", "completed", "cancelled", "failed", "refused", "admitted_mid_flight", "preempted")
_PREFIX_CACHE = ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_evictions")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector(Collector):
    """Reads ``engine.counters`` at every scrape."""

    def __init__(self, engine, model_name: str):
        self._engine = engine
        self._labels = {"model_name": model_name}

    def _family(self, cls, name: str, doc: str, value: float) -> Metric:
        family = cls(PREFIX + name, doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        counters = self._engine.counters
        snap = counters.snapshot()
        yield self._family(GaugeMetricFamily, "requests_running", "Requests in a seat of the running batch.",
                           snap["resident"])
        yield self._family(GaugeMetricFamily, "requests_waiting", "Requests queued for a seat.", snap["queued"])
        for name in _CUMULATIVE:
            yield self._family(CounterMetricFamily, f"scheduling_{name}", f"Scheduling counter {name}.", snap[name])
        for name in (k for k in snap if k.startswith("stalls_")):
            yield self._family(CounterMetricFamily, f"scheduling_{name}",
                               f"Boundaries at which the queue head could not join ({name}).", snap[name])
        yield self._family(GaugeMetricFamily, "queue_latency_avg_seconds", "Mean time from submit to a seat.",
                           snap["queue_latency_avg_us"] / 1e6)
        yield self._family(GaugeMetricFamily, "queue_latency_max_seconds", "Longest time from submit to a seat.",
                           snap["queue_latency_max_us"] / 1e6)
        if getattr(self._engine, "scheduler", None) is not None and self._engine.scheduler.speculation is not None:
            yield from self._speculation(counters.speculation.snapshot())
        for name in _PREFIX_CACHE:
            if hasattr(counters, name):
                with counters.lock:
                    value = getattr(counters, name)
                yield self._family(CounterMetricFamily, name, f"Prefix cache {name.split('_')[-1]}.", value)


    def _speculation(self, snap: dict) -> Iterator[Metric]:
        yield self._family(CounterMetricFamily, "spec_decode_steps_drafted", "Steps that verified drafted tokens.",
                           snap["steps_drafted"])
        yield self._family(CounterMetricFamily, "spec_decode_draft_tokens", "Drafted tokens verified.",
                           snap["drafted"])
        yield self._family(CounterMetricFamily, "spec_decode_accepted_tokens", "Drafted tokens accepted.",
                           snap["accepted"])
        yield self._family(CounterMetricFamily, "spec_decode_draft_failures",
                           "Requests whose drafting failed (they went on without drafts).", snap["draft_failures"])
        labels = [*self._labels, "position"]
        for name, doc, key in (("spec_decode_draft_tokens_per_pos", "Drafts verified at each draft position.",
                                "drafted_by_position"),
                               ("spec_decode_accepted_tokens_per_pos", "Drafts accepted at each draft position.",
                                "accepted_by_position")):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for i, value in enumerate(snap[key]):
                family.add_metric([*self._labels.values(), str(i + 1)], value)
            yield family


class ServerMetrics:
    """The metrics of one app, in their own registry (two apps in one process never collide)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two streamed tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.",
                                         labels, registry=self.registry).labels(model_name)
        self.registry.register(EngineCollector(engine, model_name))

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Times one request from arrival (its creation) as the handler sees its outputs."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self.arrival = time.monotonic()
        self._last_token: float | None = None
        self._prompt_tokens: dict[int, int] = {}
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        num_tokens = len(out.token_ids)
        if num_tokens:
            self._metrics.generation_tokens.inc(num_tokens)
            if self._last_token is None:
                self._metrics.ttft.observe(now - self.arrival)
                num_tokens -= 1
            elif num_tokens:
                # an output carrying k tokens spreads its wait over them
                gap = (now - self._last_token) / num_tokens
                for _ in range(num_tokens):
                    self._metrics.itl.observe(gap)
            self._last_token = now
        if out.num_prompt_tokens:
            self._prompt_tokens[out.index] = out.num_prompt_tokens
        if out.finished:
            self.finish()

    def finish(self) -> None:
        """The request ended (or its client left): record its latency once."""
        if self._done:
            return
        self._done = True
        # n > 1 sequences share one prompt: count it once
        self._metrics.prompt_tokens.inc(max(self._prompt_tokens.values(), default=0))
        self._metrics.e2e.observe(time.monotonic() - self.arrival)
