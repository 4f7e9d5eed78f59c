"""The Triton SSM kernels against the torch path, under Triton's interpreter on CPU.

``TRITON_INTERPRET=1`` must be set before triton is first imported, which
another test may already have done in this process, so the comparison runs in
a subprocess that executes this file as a script and prints one JSON line per
case. Shapes are tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

# name -> (heads, head_dim, state_size, groups, decode seats, prefill chunk lengths, dt limit)
CASES = {
    "decode-and-prefill": (4, 8, 16, 2, (2, 0, 3), (5, 3), (0.0, math.inf)),
    "odd-shapes-one-group": (3, 5, 6, 1, (1,), (1, 7), (0.0, math.inf)),
    "dt-limit": (4, 8, 16, 4, (3, 1), (4,), (0.05, 0.3)),
}
NUM_SEATS = 4


def _inputs(case, num_tokens: int, gen: torch.Generator):
    heads, head_dim, state, groups = case[:4]
    return dict(
        x=torch.randn(num_tokens, heads, head_dim, generator=gen),
        dt=torch.randn(num_tokens, heads, generator=gen) * 2,
        B=torch.randn(num_tokens, groups, state, generator=gen),
        C=torch.randn(num_tokens, groups, state, generator=gen),
    )


def _compare() -> None:
    from ifb_plugins.mamba import ssm
    from ifb_plugins.mamba.triton_kernels import chunk_scan_triton, selective_state_update_triton

    for name, case in CASES.items():
        heads, head_dim, state, groups, seats, lens, limit = case
        gen = torch.Generator().manual_seed(0)
        A = -(torch.rand(heads, generator=gen) * 8 + 0.5)
        D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen) - 1
        state0 = torch.randn(NUM_SEATS, heads, head_dim, state, generator=gen)
        # decode: one token per seat
        dec = _inputs(case, len(seats), gen)
        seat_t = torch.tensor(seats)
        ref_state, tri_state = state0.clone(), state0.clone()
        ref_y = ssm.selective_state_update_ref(ref_state, seat_t, dec["x"], dec["dt"], A, dec["B"], dec["C"], D,
                                               dt_bias, limit)
        tri_y = selective_state_update_triton(tri_state, seat_t, dec["x"], dec["dt"], A, dec["B"], dec["C"], D,
                                              dt_bias, limit)
        report = {"case": name, "decode_y": (tri_y - ref_y).abs().max().item(),
                  "decode_state": (tri_state - ref_state).abs().max().item()}
        # prefill: packed chunks, each continuing from its seat's state
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        pre = _inputs(case, cu[-1], gen)
        chunk_seats = list(range(NUM_SEATS - 1, NUM_SEATS - 1 - len(lens), -1))
        ref_state, tri_state = state0.clone(), state0.clone()
        ref_y = ssm.chunk_scan_ref(ref_state, chunk_seats, cu, pre["x"], pre["dt"], A, pre["B"], pre["C"], D,
                                   dt_bias, limit)
        tri_y = chunk_scan_triton(tri_state, chunk_seats, cu, pre["x"], pre["dt"], A, pre["B"], pre["C"], D,
                                  dt_bias, limit)
        report.update(prefill_y=(tri_y - ref_y).abs().max().item(),
                      prefill_state=(tri_state - ref_state).abs().max().item(),
                      untouched=bool(torch.equal(tri_state[0], state0[0])) if 0 not in chunk_seats else True,
                      scale=ref_y.abs().max().item())
        print(json.dumps(report), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_torch_path(interpreted, name):
    row = interpreted[name]
    assert row["scale"] > 0.5  # outputs are not trivially small
    tolerance = 1e-6 * max(1.0, row["scale"]) + 1e-6  # float32 rounding of exp/log and the sums
    for key in ("decode_y", "decode_state", "prefill_y", "prefill_state"):
        assert row[key] <= tolerance, f"{key} differs by {row[key]:.3g}"
    assert row["untouched"]  # seats outside the call keep their state


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_dispatches_to_triton_on_cuda():
    from ifb_plugins.mamba import ssm

    gen = torch.Generator().manual_seed(0)
    state = torch.randn(2, 4, 8, 16, generator=gen)
    args = [torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, generator=gen), -torch.rand(4, generator=gen),
            torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen), torch.randn(4, generator=gen),
            torch.randn(4, generator=gen)]
    ref_state = state.clone()
    ref = ssm.chunk_scan_ref(ref_state, [1], [0, 3], *args)
    gpu_state = state.cuda()
    out = ssm.chunk_scan(gpu_state, [1], [0, 3], *[a.cuda() for a in args])
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(gpu_state.cpu(), ref_state, atol=2e-5, rtol=0)


if __name__ == "__main__":
    _compare()
