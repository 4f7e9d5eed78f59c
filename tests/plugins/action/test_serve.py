"""pi0 behind the real app, on the blocking path and under in-flight batching: the planned trajectory over
/v1/chat/completions, bad input answered with 400s naming the field (and the server serving on)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.server.app import build_app

from tests.core.server.conftest import running, settle
from tests.plugins.action.conftest import Pi0Fixture


def _body(content: list[dict], **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def _with_state(case, state) -> list[dict]:
    return [*case.content()[:-1], {"type": "trajectory", "trajectory": state}]


@pytest.mark.parametrize("in_flight", [False, True])
def test_chat_completions_returns_the_planned_trajectory_and_refuses_bad_input(pi0: Pi0Fixture, in_flight):
    deployment = load_deployment(DeployConfig(model=str(pi0.path), plugin="action", enable_in_flight_batching=in_flight,
                                              max_batch_size=4 if in_flight else 1))
    case, ref = pi0.cases[1], pi0.reference[1]
    try:
        with running(build_app(deployment)) as url:
            client = httpx.Client(base_url=url, timeout=60)

            def plan_ok(**extra):
                reply = client.post("/v1/chat/completions", json=_body(case.content(), noise_seed=case.noise_seed,
                                                                        **extra))
                assert reply.status_code == 200, reply.text
                return reply.json()

            answer = plan_ok()
            message = answer["choices"][0]["message"]
            assert (torch.tensor(message["output_trajectory"]) - ref["actions"]).abs().max() <= 1e-4
            assert answer["choices"][0]["finish_reason"] == "stop"
            assert answer["usage"]["prompt_tokens"] == len(ref["input_ids"])

            bad = {
                "wrong dimension": (_body(_with_state(case, [[1.0, 2.0, 3.0]])), "messages[0].content[3].trajectory"),
                "too many points": (_body(_with_state(case, [list(case.state)] * 2)),
                                    "messages[0].content[3].trajectory"),
                # JSON has no infinity, but 1e999 parses as one
                "infinity": (_body(_with_state(case, [[1.0, "INF", 0.0, 0.0]])), "messages[0].content[3].trajectory"),
                "ragged": (_body(_with_state(case, [[1.0], [1.0, 2.0]])), "messages[0].content[3].trajectory"),
                "not numbers": (_body(_with_state(case, [["a", 1.0, 2.0, 3.0]])), "messages[0].content[3].trajectory"),
                "no trajectory": (_body(case.content()[:-1]), "messages"),
                "noise_seed alone": (_body(case.content()[:-1], noise_seed=3), "noise_seed"),
                "two trajectories": (_body([*case.content(), case.content()[-1]]), "messages[0].content[4].trajectory"),
                "ignore_eos": (_body(case.content(), ignore_eos=True), "ignore_eos"),
            }
            for what, (body, param) in bad.items():
                raw = json.dumps(body).replace('"INF"', "1e999").encode()
                reply = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
                assert reply.status_code == 400, (what, reply.text)
                error = reply.json()["error"]
                assert error["param"] is not None and error["param"].startswith(param), (what, error)
            nan = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": '
                              b'[{"type": "trajectory", "trajectory": [[NaN, 1, 2, 3]]}]}]}',
                              headers={"content-type": "application/json"})
            assert nan.status_code == 400 and "NaN" in nan.json()["error"]["message"]
            assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 404

            # still serving, with the same answer
            assert plan_ok()["choices"][0]["message"]["output_trajectory"] == message["output_trajectory"]
            streamed = client.post("/v1/chat/completions", json=_body(case.content(), noise_seed=case.noise_seed,
                                                                       stream=True))
            assert streamed.status_code == 200 and '"output_trajectory"' in streamed.text
            settle(deployment)
    finally:
        deployment.shutdown()


def test_under_in_flight_batching_concurrent_plans_are_each_the_reference(pi0: Pi0Fixture):
    deployment = load_deployment(DeployConfig(model=str(pi0.path), plugin="action", enable_in_flight_batching=True,
                                              max_batch_size=4))
    try:
        with running(build_app(deployment)) as url:
            models = httpx.get(f"{url}/v1/models").json()["data"][0]["capabilities"]["request_options"]
            assert models["past_trajectory"] == "served"

            def plan(case):
                reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                                   json=_body(case.content(), noise_seed=case.noise_seed))
                assert reply.status_code == 200, reply.text
                return torch.tensor(reply.json()["choices"][0]["message"]["output_trajectory"])

            with ThreadPoolExecutor(len(pi0.cases)) as pool:
                plans = list(pool.map(plan, pi0.cases))
            for planned, ref in zip(plans, pi0.reference, strict=True):
                assert (planned - ref["actions"]).abs().max() <= 1e-4
            settle(deployment)
    finally:
        deployment.shutdown()


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_trajectory_to_a_text_model_is_refused_naming_the_field(in_flight):
    from tests.core.server.conftest import served

    with served(in_flight=in_flight) as (url, _):
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=30, json=_body(
            [{"type": "text", "text": "hi"}, {"type": "trajectory", "trajectory": [[0.0, 1.0]]}]))
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert "no trajectory planner" in error["message"] and error["param"] == "messages[0].content[1].trajectory"
        assert httpx.post(f"{url}/v1/chat/completions", timeout=30, json=_body("hi")).status_code == 200
