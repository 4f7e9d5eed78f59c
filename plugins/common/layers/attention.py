"""Reference (torch) paged attention over a ragged batch.

A step's tokens are packed into one flat ``[T]`` axis: sequence ``b`` owns
tokens ``query_start_loc[b]:query_start_loc[b+1]``, which sit at positions
``seq_lens[b] - n_b .. seq_lens[b] - 1`` of its context. Each layer's K/V cache
is ``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's context
lives in the blocks its block table names, in order.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from ifb_plugins.common.layers import triton_kernels
@attrs.frozen(eq=False)  # tensors inside: identity, not elementwise, comparison
class AttnMetadata:
    """Where this step's tokens go in the KV cache and what each of them may see."""

    #: [T] flat slot (block_id * block_size + offset) receiving each new token's K/V
    slot_mapping: torch.Tensor
    #: [B+1] cumulative query lengths
    query_start_loc: torch.Tensor
    #: [B] context length of each sequence after this step
    seq_lens: torch.Tensor
    #: [B, max_blocks] block ids, padded with 0, cut to the blocks the longest context needs
    block_tables: torch.Tensor
    block_size: int
    # Host-side copies, so the per-layer loop never syncs with the device.
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    #: sequences with exactly one query token (a decode), batched in one SDPA call
    decode_seq_idx: torch.Tensor
    #: [Bd] flat token index of each of those decode tokens
    decode_token_idx: torch.Tensor
    #: sequences with more than one query token (prefill chunks), run one by one
    prefill_seq_idx: tuple[int, ...]
    #: [Bd * W] the decode sequences' block tables, flattened once per step rather than per layer
    decode_block_ids: torch.Tensor | None = None
    #: [Bd, 1, 1, W * block_size] which gathered slots hold each decode sequence's context
    decode_mask: torch.Tensor | None = None
    #: each sequence's prompt length (its positions below it are prompt tokens), when the caller
    #: knows it; the native decoder may quantize prompt rows more coarsely than generated ones
    num_prompt_tokens_host: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @property
    def decode_only(self) -> bool:
        return not self.prefill_seq_idx


@attrs.frozen(eq=False)
class GroupedAttn:
    """A step's attention metadata per KV cache group: the full-attention layers' (``full``) and, per
    sliding window, that group's (``ifb.kv.WindowGroupSpec``): its table names other blocks, in a pool
    of their own, with the entries before the window freed."""

    full: AttnMetadata
    by_window: tuple[tuple[int, AttnMetadata], ...] = ()

    def for_window(self, window: int | None) -> AttnMetadata:
        """The metadata of the layers that attend within ``window`` (None: the whole context)."""
        for w, attn in self.by_window:
            if w == window:
                return attn
        return self.full


def window_start(first_query: int, window: int | None, block_size: int) -> tuple[int, int]:
    """``(block, position)`` where the context a query from ``first_query`` on may see starts: the block
    holding its window's first position (a sliding group frees the blocks before it), 0 without a window."""
    if window is None:
        return 0, 0
    first = max(0, first_query - window + 1) // block_size
    return first, first * block_size


def layer_attn(attn: AttnMetadata | GroupedAttn, window: int | None) -> AttnMetadata:
    """A layer's metadata: its group's in a ``GroupedAttn``; a plain ``AttnMetadata`` serves every layer (one
    table for all, the layout without groups)."""
    return attn.for_window(window) if isinstance(attn, GroupedAttn) else attn


def build_attn_metadata(
    seqs: Sequence[tuple[int, int, Sequence[int]]],
    block_size: int,
    device: torch.device | str = "cpu",
    num_prompt_tokens: Sequence[int] | None = None,
) -> AttnMetadata:
    """Build the metadata for one step from ``(start_pos, num_new_tokens, block_ids)`` per sequence.

    ``block_ids`` is the sequence's block table; it must cover ``start_pos +
    num_new_tokens`` tokens (extra trailing blocks are allowed and ignored).
    ``num_prompt_tokens``: each sequence's prompt length, or None (unknown).
    """
    if num_prompt_tokens is not None and len(num_prompt_tokens) != len(seqs):
        raise ValueError(f"{len(num_prompt_tokens)} prompt lengths for {len(seqs)} sequences")
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    slots: list[int] = []
    qlens: list[int] = []
    slens: list[int] = []
    for start, n, blocks in seqs:
        if n < 1:
            raise ValueError("every sequence must compute at least one token")
        end = start + n
        if len(blocks) * block_size < end:
            raise ValueError(f"block table of {len(blocks)} blocks cannot hold {end} tokens")
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        qlens.append(n)
        slens.append(end)
    # Only the blocks the longest context touches are gathered; the rest is padding.
    width = max(math.ceil(s / block_size) for s in slens)
    table = [list(blocks[:width]) + [0] * (width - min(len(blocks), width)) for _, _, blocks in seqs]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    decode = [b for b, n in enumerate(qlens) if n == 1]
    decode_ids = decode_mask = None
    if decode:
        decode_ids = torch.tensor([i for b in decode for i in table[b]], dtype=torch.long, device=device)
        decode_lens = torch.tensor([slens[b] for b in decode], dtype=torch.long, device=device)
        # A decode token sits at the last position: it sees its whole context and no padding.
        decode_mask = (torch.arange(width * block_size, device=device) < decode_lens[:, None])[:, None, None, :]
    return AttnMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        seq_lens=torch.tensor(slens, dtype=torch.long, device=device),
        block_tables=torch.tensor(table, dtype=torch.long, device=device),
        block_size=block_size,
        query_lens_host=tuple(qlens),
        seq_lens_host=tuple(slens),
        decode_seq_idx=torch.tensor(decode, dtype=torch.long, device=device),
        decode_token_idx=torch.tensor([starts[b] for b in decode], dtype=torch.long, device=device),
        prefill_seq_idx=tuple(b for b, n in enumerate(qlens) if n > 1),
        decode_block_ids=decode_ids,
        decode_mask=decode_mask,
        num_prompt_tokens_host=None if num_prompt_tokens is None else tuple(num_prompt_tokens),
    )


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's K/V ``[T, Hkv, D]`` into their slots of the paged cache."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata
) -> torch.Tensor:
    """All single-token sequences at once: one masked SDPA over ``[Bd, H, 1, max_ctx]``."""
    if triton_kernels.applies_to(q):  # CUDA inference: the Triton kernel, same math, no gather copy
        return triton_kernels.decode_attention(q, k_cache, v_cache, attn)
    block_ids, mask = attn.decode_block_ids, attn.decode_mask
    if block_ids is None or mask is None:  # metadata built by hand: derive them here
        tables = attn.block_tables.index_select(0, attn.decode_seq_idx)  # [Bd, W]
        lens = attn.seq_lens.index_select(0, attn.decode_seq_idx)  # [Bd]
        ctx = tables.shape[1] * attn.block_size
        mask = (torch.arange(ctx, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        block_ids = tables.flatten()
    bd, ctx = mask.shape[0], mask.shape[-1]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    # index_select on the flat table: the same copy as k_cache[tables], several times cheaper
    k = k_cache.index_select(0, block_ids).view(bd, ctx, hkv, d).transpose(1, 2)  # [Bd, Hkv, ctx, D]
    v = v_cache.index_select(0, block_ids).view(bd, ctx, hkv, d).transpose(1, 2)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    # In a decode-only step the decode tokens are all the tokens, in order.
    qd = q if attn.decode_only else q.index_select(0, attn.decode_token_idx)
    out = F.scaled_dot_product_attention(qd.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)  # [Bd, Hq, 1, D]
    return out.squeeze(2)


def _prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata, b: int, q0: int
) -> torch.Tensor:
    """Sequence ``b``'s query chunk (flat tokens from ``q0``) against its whole context, causally."""
    n, ctx_len = attn.query_lens_host[b], attn.seq_lens_host[b]
    nblocks = math.ceil(ctx_len / attn.block_size)
    blocks = attn.block_tables[b, :nblocks]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache[blocks].view(-1, hkv, d)[:ctx_len].transpose(0, 1)  # [Hkv, ctx, D]
    v = v_cache[blocks].view(-1, hkv, d)[:ctx_len].transpose(0, 1)
    # A leading batch dim of 1: CPU SDPA picks a different (and, vs the HF
    # reference, less exactly matching) kernel for 3-D inputs.
    qb = q[q0 : q0 + n].transpose(0, 1)[None]  # [1, Hq, n, D]
    k, v = k[None].to(q.dtype), v[None].to(q.dtype)  # [1, Hkv, ctx, D]
    start = ctx_len - n
    if start == 0:
        # A whole prompt: SDPA's own (top-left aligned) causal mask is the right one.
        out = F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)
    else:
        # A later chunk: query i sits at position start + i and sees keys 0..start + i.
        qpos = torch.arange(start, ctx_len, device=q.device)[:, None]
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= qpos  # [n, ctx]
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, Hq, D]


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: AttnMetadata
) -> torch.Tensor:
    """Attention of the step's queries ``[T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``.

    The step's own K/V must already be written (``write_kv``). Decode tokens
    share one batched call; each prefill chunk runs on its own.
    """
    if attn.decode_only:
        return _decode_attention(q, k_cache, v_cache, attn)
    out = torch.empty_like(q)
    if attn.decode_token_idx.numel():
        out.index_copy_(0, attn.decode_token_idx, _decode_attention(q, k_cache, v_cache, attn))
    for b in attn.prefill_seq_idx:
        q0 = sum(attn.query_lens_host[:b])  # host arithmetic: no device sync per layer
        out[q0 : q0 + attn.query_lens_host[b]] = _prefill_attention(q, k_cache, v_cache, attn, b, q0)
    return out
