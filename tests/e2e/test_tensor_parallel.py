"""``ifb serve --tensor-parallel-size 3``: the default model (9 heads, 3 KV heads) sharded over three
gloo ranks answers through the official client; a rank killed mid-stream fails the stream with an
error, and the server exits non-zero within the bound, leaving no rank behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.test_server import Server

pytestmark = pytest.mark.e2e

#: the collective time-out the server runs with; a killed rank is found at once (its sockets close)
COLLECTIVE_TIMEOUT = 20
#: the bound the docs state: the time-out, the HTTP server's 5 s of graceful shutdown, the ranks' 2 s
EXIT_BOUND = COLLECTIVE_TIMEOUT + 5 + 2 + 3


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the spawned ranks and multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def test_three_ranks_answer_and_a_lost_rank_stops_the_server(tmp_path):
    from ifb_plugins.text.default_model import resolve_model

    resolve_model(None)
    server = Server(tmp_path / "tp3.log", "--tensor-parallel-size", "3", "--enable-in-flight-batching",
                    "--collective-timeout", str(COLLECTIVE_TIMEOUT))
    try:
        server.wait_ready()
        client = server.client()
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=30, temperature=0)
        assert "Paris" in answer.choices[0].message.content
        ranks = [pid for pid in children(server.process.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(ranks) == 2
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=400,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        received = 0
        with pytest.raises(Exception, match="lost a rank"):
            for _ in stream:
                received += 1
                if received == 3:
                    os.kill(ranks[-1], signal.SIGKILL)
                    killed = time.monotonic()
        assert received >= 3
        code = server.process.wait(timeout=EXIT_BOUND)
        assert time.monotonic() - killed < EXIT_BOUND
        assert code != 0
        assert not [pid for pid in ranks if is_alive(pid)]
        assert "lost a rank" in server.log_path.read_text()
    finally:
        server.stop()
