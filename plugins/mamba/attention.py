"""Paged attention whose result for a token depends only on that token's own context.

The KV layout, the slot mapping and the block tables are the shared layer's
(``ifb_plugins.common.layers.attention``: ``build_attn_metadata`` and ``write_kv``).
The text plugin's ``paged_attention`` runs one SDPA per prefill chunk and one
padded SDPA for the decodes; both change a token's rounding with the chunk
length and the padding (measured: ~1e-7 differences), which breaks batched ==
alone for a recurrent model whose prompt is chunked differently in a batch.

Here every query token walks its own context one KV block at a time with an
online softmax. Per block the work has a fixed shape, the blocks are visited in
order, and blocks past a token's context are fully masked, which leaves its
running max, sum and output exactly unchanged (scale exp(0) = 1, weight 0).
So a token's output is the same whatever chunk, batch or padding it shares
the step with. Position embedding (RoPE, where a family has it) is applied
to q and k before they get here.
"""

from __future__ import annotations

import math

import torch

from ifb_plugins.common.layers.attention import AttnMetadata


def token_positions(attn: AttnMetadata, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per flat token: (the index of its sequence in the step, its position in that sequence)."""
    seq_idx, positions = [], []
    for b, (n, total) in enumerate(zip(attn.query_lens_host, attn.seq_lens_host)):
        seq_idx.extend([b] * n)
        positions.extend(range(total - n, total))
    return (torch.tensor(seq_idx, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device))


def blockwise_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata,
                        token_seq: torch.Tensor, token_pos: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``.

    The step's own K/V must already be written (``write_kv``). ``token_seq``
    and ``token_pos`` come from ``token_positions``; ``scale`` defaults to
    ``1/sqrt(D)``.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().view(num_tokens, num_kv_heads, group, 1, head_dim)
    tables = attn.block_tables.index_select(0, token_seq)  # [T, W]
    num_blocks = math.ceil(max(attn.seq_lens_host) / block_size)
    offsets = torch.arange(block_size, device=q.device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    running_max = torch.full((num_tokens, num_kv_heads, group), -math.inf, device=q.device)
    running_sum = torch.zeros((num_tokens, num_kv_heads, group), device=q.device)
    acc = torch.zeros((num_tokens, num_kv_heads, group, head_dim), device=q.device)
    for j in range(num_blocks):
        blocks = tables[:, j]
        k = k_cache.index_select(0, blocks).float().permute(0, 2, 1, 3)  # [T, Hkv, bs, D]
        v = v_cache.index_select(0, blocks).float().permute(0, 2, 3, 1)  # [T, Hkv, D, bs]
        scores = (qg * k[:, :, None]).sum(-1) * scale  # [T, Hkv, g, bs]
        visible = (j * block_size + offsets)[None, :] <= token_pos[:, None]  # [T, bs]
        scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
        new_max = torch.maximum(running_max, scores.amax(-1))
        # Block 0 always holds position 0, so new_max is finite from the first block on.
        rescale = torch.exp(running_max - new_max)
        weights = torch.exp(scores - new_max[..., None])  # [T, Hkv, g, bs]
        running_sum = running_sum * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + (weights[:, :, :, None, :] * v[:, :, None]).sum(-1)
        running_max = new_max
    out = acc / running_sum[..., None]
    return out.view(num_tokens, num_heads, head_dim).to(q.dtype)
