"""Numerics whose result for one token does not depend on what else is in the step.

Batch invariance (a request's greedy output is the same batched or alone)
needs more than per-sequence ops: a prompt is split into different prefill
chunks depending on its batch mates, so every token's numbers must not depend
on how many tokens share a tensor. Two CPU effects break that and are avoided
here (both were measured on the reference machine and are pinned by tests):

- ``F.linear`` picks a different GEMM kernel for small row counts, so a row's
  product changes with the number of rows. ``token_linear`` runs one
  matrix-vector product per token (a batched matmul with M = 1; the weight is
  broadcast, not copied).
- Elementwise kernels process the tail of a tensor with scalar code, and for
  ``softplus``, ``silu``, ``sigmoid`` and ``log1p`` the scalar and vector
  implementations differ in the last bit, so a value depends on its position
  in the tensor. ``exp``, ``log`` and plain arithmetic agree, so ``silu`` and
  ``softplus`` are spelled with those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: softplus is the identity above this (as in torch and the reference kernels)
SOFTPLUS_THRESHOLD = 20.0


def token_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 row_invariant: bool = True) -> torch.Tensor:
    """``x [T, in] @ weight.T [in, out] (+ bias)`` with each row computed on its own."""
    if not row_invariant or x.shape[0] == 0:
        return F.linear(x, weight, bias)
    num_rows = x.shape[0]
    out = torch.bmm(x.unsqueeze(1), weight.t().unsqueeze(0).expand(num_rows, -1, -1)).squeeze(1)
    return out + bias if bias is not None else out


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, position-independent."""
    return x / (1.0 + torch.exp(-x))


def log1p(u: torch.Tensor) -> torch.Tensor:
    """``log(1 + u)`` accurate for small ``u`` (Goldberg's correction), position-independent."""
    w = 1.0 + u
    d = w - 1.0
    # log(w) is the log of the rounded 1 + u; scaling by u / (w - 1) corrects the rounding.
    return torch.where(d == 0, u, torch.log(w) * (u / torch.where(d == 0, 1.0, d)))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))``, position-independent."""
    capped = torch.clamp(x, max=SOFTPLUS_THRESHOLD)
    return torch.where(x > SOFTPLUS_THRESHOLD, x, log1p(torch.exp(capped)))
