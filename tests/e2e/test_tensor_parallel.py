"""``ifb serve --tensor-parallel-size 3``: the default model (9 heads, 3 KV heads) sharded over three
gloo ranks answers through the official client; a rank killed mid-stream fails the stream with an
error, and the server exits non-zero within the bound, leaving no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from ifb.parallel.launch import free_port
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


def wait_ready(url: str, launcher: subprocess.Popen, log_path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            pytest.fail(f"torchrun exited ({launcher.returncode}):\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not start in time:\n{log_path.read_text()}")


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


#: the hung-rank test's collective time-out: short, so the test is; long enough for the tiny model's loads
HUNG_TIMEOUT = 8
HUNG_BOUND = HUNG_TIMEOUT + 5 + 2 + 5


def test_torchrun_ranks_serve_from_rank_0_and_a_hung_rank_stops_the_server(tmp_path):
    """``torchrun --nnodes 1 --nproc-per-node 2 -m ifb serve`` (the rendezvous environment, as a second
    machine would run it) answers through the official client from rank 0; then rank 1 stops answering
    without dying (SIGSTOP) mid-stream: the collective time-out fires, the stream gets the error, and
    rank 0 and torchrun exit non-zero within the bound."""
    from tests.models.text import save_tiny_llama

    checkpoint = save_tiny_llama(tmp_path / "llama", seed=3)
    port, rendezvous = free_port(), free_port()
    log_path = tmp_path / "torchrun.log"
    command = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(rendezvous), "-m", "ifb", "serve", str(checkpoint),
               "--port", str(port), "--log-level", "warning", "--enable-in-flight-batching",
               "--collective-timeout", str(HUNG_TIMEOUT)]
    with log_path.open("w") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    ranks: dict[int, int] = {}
    try:
        wait_ready(f"http://127.0.0.1:{port}", launcher, log_path)
        for pid in children(launcher.pid):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((int(v.split(b"=")[1]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                ranks[rank] = pid
        assert sorted(ranks) == [0, 1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 8
        stream = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        received = 0
        with pytest.raises(Exception, match="lost a rank"):
            for _ in stream:
                received += 1
                if received == 3:
                    os.kill(ranks[1], signal.SIGSTOP)  # alive, silent
                    stopped = time.monotonic()
        while is_alive(ranks[0]) and time.monotonic() - stopped < HUNG_BOUND:
            time.sleep(0.2)
        assert not is_alive(ranks[0]), f"rank 0 still runs {HUNG_BOUND} s after rank 1 stopped answering"
        # torchrun then ends the other ranks (SIGTERM, SIGKILL after its own grace): a stopped rank takes
        # the SIGTERM once it runs again
        os.kill(ranks[1], signal.SIGCONT)
        assert launcher.wait(timeout=30) != 0
        text = log_path.read_text()
        assert "lost a rank" in text and "exitcode  : 3" in text  # torchrun's report of rank 0's status
    finally:
        for pid in ranks.values():
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
