"""A fake-runtime deployment behind the real app, served by uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import httpx
import pytest
import uvicorn

from ifb.capabilities import DeployConfig, DeploymentKind, EndpointSupport
from ifb.deploy import Deployment
from ifb.engine import RequestEngine
from ifb.plugins import default_host
from ifb.server.app import build_app

from tests.core.fakes import FakeRuntime, text_caps

ENDPOINTS = {"completions": EndpointSupport.SERVED, "chat.completions": EndpointSupport.SERVED}


def make_deployment(*, in_flight: bool = True, runtime: FakeRuntime | None = None, **config) -> Deployment:
    runtime = runtime or FakeRuntime(caps=text_caps(endpoints=dict(ENDPOINTS)))
    cfg = DeployConfig(model="fake", plugin="fake", enable_in_flight_batching=in_flight,
                       **{"max_batch_size": 2, "max_queued_requests": 2, **config})
    kind = DeploymentKind(name="fake", plugin="fake", title="Fake runtime", declare=lambda c: runtime.caps,
                          load=lambda c: runtime)
    options = default_host().request_options()  # as load_deployment gives them: the plugins' too
    engine = RequestEngine(runtime, cfg, options, in_flight=in_flight)
    return Deployment(kind, cfg, runtime.caps, runtime, engine, None)


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def assert_counters_add_up(deployment: Deployment) -> None:
    """Every submitted request is in exactly one state: ended, queued or resident."""
    snap = deployment.engine.counters.snapshot()
    ended = snap["completed"] + snap["cancelled"] + snap["failed"] + snap["refused"]
    assert snap["submitted"] == ended + snap["queued"] + snap["resident"], snap


def settle(deployment: Deployment) -> dict:
    """Wait until nothing is queued or resident; returns the counters."""
    counters = deployment.engine.counters
    wait_for(lambda: counters.snapshot()["queued"] == 0 and counters.snapshot()["resident"] == 0)
    assert_counters_add_up(deployment)
    return counters.snapshot()


@contextlib.contextmanager
def served(*, api_key: str | None = None, host=None, guard=None,
           **deployment_args) -> Iterator[tuple[str, Deployment]]:
    deployment = make_deployment(**deployment_args)
    gate = deployment.runtime.gate
    try:
        with running(build_app(deployment, api_key=api_key, host=host, guard=guard)) as url:
            yield url, deployment
            if gate is not None:
                gate.set()
            settle(deployment)
    finally:
        if gate is not None:
            gate.set()
        deployment.shutdown()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval)


@pytest.fixture
def server():
    """An in-flight server (batch 2 + queue 2) on the fake runtime; yields (base URL, deployment)."""
    with served() as pair:
        yield pair


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    url, _ = server
    with httpx.Client(base_url=url, timeout=10) as c:
        yield c
