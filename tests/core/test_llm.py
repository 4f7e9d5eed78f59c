"""The Python API: an exception while ``generate`` / ``chat`` waits cancels the call's requests."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ifb.llm import LLM
from ifb.outputs import RequestHandle
from ifb.params import SamplingParams

from tests.core.fakes import FakeRuntime, text_caps
from tests.core.server.conftest import make_deployment, settle, wait_for

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def _llm(in_flight: bool = True) -> LLM:
    llm = LLM.__new__(LLM)  # the real class around a fake-runtime deployment (no model to load)
    runtime = FakeRuntime(caps=text_caps(), step_delay=0.005)
    llm.deployment = make_deployment(in_flight=in_flight, runtime=runtime)
    llm.config = llm.deployment.config
    return llm


def _interrupt_when_resident(llm: LLM, num: int) -> threading.Thread:
    """SIGINT this process (Ctrl-C) once ``num`` requests hold a seat and have produced tokens."""
    def fire() -> None:
        wait_for(lambda: llm.engine.counters.snapshot()["resident"] == num)
        wait_for(lambda: len(llm.deployment.runtime.steps) >= 5)  # a few tokens in
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def ctrl_c_raises():
    """Python's KeyboardInterrupt handler for SIGINT: a run started in the background by a
    non-interactive shell inherits SIGINT ignored, and Python then installs none."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("in_flight", [True, False])
def test_ctrl_c_in_generate_cancels_and_frees_the_seats(in_flight, ctrl_c_raises):
    llm = _llm(in_flight)
    try:
        num = 2 if in_flight else 1
        thread = _interrupt_when_resident(llm, num)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["abc", "xyz"][:num], LONG)
        thread.join()
        snap = settle(llm.deployment)
        assert snap["cancelled"] == num and snap["completed"] == 0
        assert len(llm.deployment.runtime.steps) < 100  # they stopped long before max_tokens
        # the seats are free: the next call is served
        assert llm.generate("abc", SamplingParams(max_tokens=3, temperature=0))[0].num_output_tokens == 3
    finally:
        llm.close()


def test_an_exception_in_chat_cancels_the_request(monkeypatch):
    llm = _llm()
    try:
        def broken(self):  # the wait fails the way any exception in the caller's thread would
            wait_for(lambda: llm.engine.counters.generation_tokens >= 2)
            raise RuntimeError("injected")

        monkeypatch.setattr(RequestHandle, "result", broken)
        with pytest.raises(RuntimeError, match="injected"):
            llm.chat([{"role": "user", "content": "hello"}], LONG)
        snap = settle(llm.deployment)
        assert snap["cancelled"] == 1 and snap["resident"] == 0 and snap["completed"] == 0
    finally:
        llm.close()


@pytest.mark.parametrize("in_flight", [True, False])
def test_chat_with_media_on_a_text_model_names_the_part_as_the_server_does(in_flight):
    from ifb.capabilities import OptionSupport, Support
    from ifb.engine import RequestRejected
    from ifb.options import text_only_message

    llm = LLM.__new__(LLM)
    caps = text_caps(options={"media_under_pruner": OptionSupport(Support.NOT_APPLICABLE, reason="Text input only.")})
    llm.deployment = make_deployment(in_flight=in_flight, runtime=FakeRuntime(caps=caps))
    llm.config = llm.deployment.config
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    try:
        with pytest.raises(RequestRejected) as refused:
            llm.chat(messages, SamplingParams(max_tokens=2))
        assert str(refused.value) == text_only_message("messages[1].content[1]", "image_url")
        assert "messages[1].content[1] is an image_url part" in str(refused.value)
        assert "pruner" not in str(refused.value)
        assert llm.chat([{"role": "user", "content": "abc"}], SamplingParams(max_tokens=2)).token_ids
        assert llm.engine.counters.snapshot()["submitted"] == 1
    finally:
        llm.close()
