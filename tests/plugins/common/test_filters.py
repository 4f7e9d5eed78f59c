"""Tests for ifb_plugins.common.decoding.filters: top-k / top-p / min-p cuts found without whole-row sorts."""

from __future__ import annotations

import math

import pytest
import torch

from ifb_plugins.common.decoding.filters import NUCLEUS_WIDTHS, cut_sizes, filter_logits


def _sorted_cut(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The definition: a stable descending sort of each whole row (ties by id), the first k, then the
    tokens of the renormalised survivors whose mass before them is below p."""
    vocab = x.shape[1]
    keep = torch.zeros_like(x, dtype=torch.bool)
    for i, row in enumerate(x):
        order = row.sort(descending=True, stable=True).indices
        k = min(top_k[i], vocab) if top_k[i] > 0 else vocab
        probs = row.softmax(dim=-1)[order[:k]].double()
        if k < vocab:  # the survivors renormalised; a whole row's softmax already sums to 1
            probs = probs / probs.sum()
        n = 0
        mass = 0.0
        for q in probs.tolist():
            if mass >= top_p[i]:
                break
            n += 1
            mass += q
        keep[i, order[:n]] = True
    return keep


def _kept(x, top_k, top_p) -> torch.Tensor:
    return filter_logits(x, top_k, top_p, [0.0] * x.shape[0]) > -math.inf


def _rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.05, 6.0, num_rows).unsqueeze(1)  # nearly flat rows (wide nuclei) to peaked ones
    x = torch.randn(num_rows, vocab, generator=g) * scale
    return (x * 4).round() / 4  # many ties, some at the cut-offs


@pytest.mark.parametrize("top_k, top_p", [
    (0, 0.9), (0, 0.5), (50, 1.0), (7, 1.0), (40, 0.8), (3000, 0.95), (0, 0.999),
])
def test_cuts_equal_the_whole_row_sort(top_k: int, top_p: float) -> None:
    x = _rows(24, 6000, seed=top_k + int(top_p * 100))
    ks, ps = [top_k] * 24, [top_p] * 24
    assert torch.equal(_kept(x, ks, ps), _sorted_cut(x, ks, ps))


def test_nuclei_wider_than_each_candidate_width_are_found() -> None:
    vocab = 6000
    x = _rows(24, vocab, seed=3)
    sizes, _ = cut_sizes(x, [vocab] * 24, [0.9] * 24)
    # the flat rows' nuclei pass every width the cut looks among first, the peaked rows' close early
    assert max(sizes) > NUCLEUS_WIDTHS[-1] and min(sizes) < NUCLEUS_WIDTHS[0]
    assert any(NUCLEUS_WIDTHS[0] < s < NUCLEUS_WIDTHS[1] for s in sizes)
    assert sizes == _sorted_cut(x, [0] * 24, [0.9] * 24).sum(dim=-1).tolist()


def test_a_rows_cut_does_not_depend_on_its_batch_mates() -> None:
    vocab = 6000
    x = _rows(12, vocab, seed=5)
    mixes = [
        ([0] * 12, [0.9] * 12),
        ([0, 5, 2000, 0, 1, 0, 4100, 0, 0, 64, 0, 0], [0.9, 1.0, 0.7, 0.3, 1.0, 0.9, 0.95, 0.99, 0.9, 0.5, 0.9, 0.9]),
    ]
    alone = [_kept(x[i:i + 1], [0], [0.9]) for i in range(12)]
    for ks, ps in mixes:
        out = _kept(x, ks, ps)
        for i in range(12):
            if ks[i] == 0 and ps[i] == 0.9:
                assert torch.equal(out[i:i + 1], alone[i])


def test_masked_rows_and_disabled_rows() -> None:
    # a guided row: all but three tokens at -inf; top-k larger than what is left keeps the three
    x = torch.full((3, 100), -math.inf)
    x[0, [4, 9, 50]] = torch.tensor([1.0, 2.0, 0.5])
    x[1] = torch.randn(100, generator=torch.Generator().manual_seed(1))
    x[2] = x[1]
    out = filter_logits(x, [20, 0, 5], [0.99, 1.0, 1.0], [0.0] * 3)
    assert (out[0] > -math.inf).nonzero().flatten().tolist() == [4, 9, 50]
    assert torch.equal(out[1], x[1])  # nothing asked of this row
    assert int((out[2] > -math.inf).sum()) == 5


def test_min_p_after_the_cuts() -> None:
    probs = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]])
    out = filter_logits(probs.log(), [0], [1.0], [0.3])
    assert (out > -math.inf).nonzero()[:, 1].tolist() == [0, 1, 2]
