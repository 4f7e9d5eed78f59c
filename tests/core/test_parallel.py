"""``ifb.parallel``'s wire and start-up: a step's command survives its encoding (the prepared state
stays on rank 0, unknown keys are errors), and ranks started with different model files refuse to start."""

from __future__ import annotations

import json

import attrs
import cattrs
import pytest
import torch.multiprocessing as mp

from ifb.capabilities import DeployConfig
from ifb.params import SamplingParams
from ifb.parallel import wire
from ifb.parallel.launch import RankEnv, free_port
from ifb.runtime import NewSeq, ScheduledSeq, ScheduledStep

STEP = ScheduledStep(
    step_id=7,
    seqs=(ScheduledSeq("a", 0, (5, 6, 7), 0, (3, 4), True), ScheduledSeq("b", 1, (9,), 12, (), True)),
    new_seqs=(NewSeq("a", 0, (5, 6, 7), 3, SamplingParams(temperature=0.0, stop=("x",)), state=object()),),
)


def test_a_step_crosses_the_wire_without_its_prepared_state():
    command = wire.Command(wire.Kind.STEP, STEP, released=("c",))
    data = wire.encode(command)
    back = wire.decode(data)
    assert back.step.seqs == STEP.seqs and back.released == ("c",) and back.kind is wire.Kind.STEP
    assert back.step.new_seqs[0].state is None
    assert back.step.new_seqs[0].params == STEP.new_seqs[0].params
    assert b"state" not in data
    tampered = json.loads(data)
    tampered["step"]["extra"] = 1
    with pytest.raises(cattrs.ClassValidationError):
        wire.decode(json.dumps(tampered).encode())


def _join(env: RankEnv, config: DeployConfig, results) -> None:
    from ifb.parallel.launch import join_ranks

    try:
        join_ranks(env, config)
        results.put((env.rank, "joined"))
    except Exception as exc:  # noqa: BLE001 - the message is the result
        results.put((env.rank, str(exc)))


def test_ranks_with_different_model_files_refuse_to_start(tmp_path):
    files = [tmp_path / f"rank{r}" / "model.gguf" for r in range(2)]
    for r, f in enumerate(files):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes([r]) * 64)  # same name and size, other bytes
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_join, args=(RankEnv(r, 2, 2, "127.0.0.1", port),
                                             DeployConfig(model=str(files[r]), num_ranks=2, collective_timeout=20),
                                             results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)
    for rank in (0, 1):
        assert "rank(s) 1 started with a different model file" in got[rank]


def test_a_runtime_that_does_not_shard_is_refused_on_every_path():
    from ifb.capabilities import DeploymentCaps
    from ifb.gate import UnsupportedDeployment, check_deployment

    caps = DeploymentCaps(stepped_execution=True, seated_admission=True, max_batch_size=4, num_ranks=2,
                          tensor_parallel_note="its state is not sharded")
    for flag in (False, True):
        with pytest.raises(UnsupportedDeployment, match="--tensor-parallel-size 2: .*2 ranks.*its state is not sharded"):
            check_deployment(caps, DeployConfig(num_ranks=2, enable_in_flight_batching=flag))
    assert check_deployment(attrs.evolve(caps, supports_tensor_parallel=True),
                            DeployConfig(num_ranks=2, enable_in_flight_batching=True)) is None
