"""Speculation over HTTP: ``speculative: false`` in the body, the counters in /health and /metrics."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ifb.speculative import SpeculationCaps, SpeculationPolicy
from tests.core.fakes import text_caps
from tests.core.server.conftest import ENDPOINTS, served, settle
from tests.core.test_speculative import SpeculatingRuntime


def speculating_server():
    caps = text_caps(endpoints=dict(ENDPOINTS), speculation=SpeculationCaps("test", 3, SpeculationPolicy(is_always=True)))
    return served(runtime=SpeculatingRuntime(caps=caps))


def test_the_body_may_turn_speculation_off_and_the_counters_show():
    with speculating_server() as (url, deployment), httpx.Client(base_url=url, timeout=10) as client:
        body = {"prompt": "hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        on = client.post("/v1/completions", json=body)
        off = client.post("/v1/completions", json={**body, "speculative": False})
        assert on.status_code == off.status_code == 200
        assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        bad = client.post("/v1/completions", json={**body, "speculative": "sometimes"})
        assert bad.status_code == 400 and "speculative" in bad.text
        settle(deployment)
        steps = deployment.runtime.steps
        drafted = {s.request_id for st in steps for s in st.seqs if s.num_draft_tokens}
        assert len(drafted) == 1  # the first request's, never the second's
        health = client.get("/health").json()["speculative_decoding"]
        assert health["drafted"] > 0 and health["accepted"] > 0 and len(health["acceptance_by_position"]) == 3
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["ifb_spec_decode_draft_tokens"].samples[0].value == health["drafted"]
    assert families["ifb_spec_decode_accepted_tokens"].samples[0].value == health["accepted"]
    assert families["ifb_spec_decode_steps_drafted"].samples[0].value == health["steps_drafted"]
    per_pos = {s.labels["position"]: s.value for s in families["ifb_spec_decode_accepted_tokens_per_pos"].samples}
    assert per_pos == {str(i + 1): v for i, v in enumerate(health["accepted_by_position"])}
