"""The batch-independent building blocks: accurate, and a token's value never depends on its neighbours."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ifb_plugins.mamba.numerics import silu, softplus, token_linear
from ifb_plugins.mamba.ssm import NO_LIMIT, chunk_scan_ref, selective_state_update_ref


def test_token_linear_rows_do_not_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(40, 64, generator=gen)
    full = token_linear(x, weight, bias)
    torch.testing.assert_close(full, F.linear(x, weight, bias), atol=1e-5, rtol=0)
    for rows in range(1, 40):
        assert torch.equal(token_linear(x[:rows], weight, bias), full[:rows]), rows
        assert torch.equal(token_linear(x[rows - 1:rows], weight, bias), full[rows - 1:rows]), rows


def test_silu_and_softplus_are_accurate_and_position_independent():
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(500, generator=gen) * 4, torch.tensor([-90.0, -20.0, 0.0, 1e-8, 19.9, 20.1, 60.0])])
    for ours, torch_fn in ((silu, F.silu), (softplus, F.softplus)):
        full = ours(x)
        torch.testing.assert_close(full, torch_fn(x), atol=1e-6, rtol=1e-6)
        # every element alone (the scalar path) equals the element inside the long tensor (the vector path)
        alone = torch.cat([ours(x[i:i + 1]) for i in range(x.numel())])
        assert torch.equal(alone, full)


def test_decode_steps_and_a_chunk_scan_are_the_same_computation():
    gen = torch.Generator().manual_seed(2)
    heads, head_dim, state, groups, n = 4, 8, 16, 2, 9
    A = -torch.rand(heads, generator=gen) * 4
    D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    x = torch.randn(n, heads, head_dim, generator=gen)
    dt = torch.randn(n, heads, generator=gen)
    B, C = torch.randn(n, groups, state, generator=gen), torch.randn(n, groups, state, generator=gen)
    init = torch.randn(3, heads, head_dim, state, generator=gen)

    scanned = init.clone()
    y_scan = chunk_scan_ref(scanned, [1], [0, n], x, dt, A, B, C, D, dt_bias, NO_LIMIT)
    stepped = init.clone()
    ys = []
    for t in range(n):
        # seat 1 decodes in a batch of three, at a different row each step, beside other seats' tokens
        order = [[2, 1, 0], [1, 0, 2], [0, 2, 1]][t % 3]
        row = order.index(1)
        xs, dts = torch.randn(3, heads, head_dim, generator=gen), torch.randn(3, heads, generator=gen)
        Bs, Cs = torch.randn(3, groups, state, generator=gen), torch.randn(3, groups, state, generator=gen)
        xs[row], dts[row], Bs[row], Cs[row] = x[t], dt[t], B[t], C[t]
        y = selective_state_update_ref(stepped, torch.tensor(order), xs, dts, A, Bs, Cs, D, dt_bias, NO_LIMIT)
        ys.append(y[row])
    assert torch.equal(torch.stack(ys), y_scan)
    assert torch.equal(stepped[1], scanned[1])
