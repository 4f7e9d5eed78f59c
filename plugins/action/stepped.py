"""pi0 under the engine's stepped execution: prefixes prefilled in the running batch, denoising steps batched.

A request's prompt is its prefix (camera placeholders, ``<bos>``, task, newline). The backbone's
attention over it is bidirectional, so the prefix is computed whole, in the step that schedules its
last chunk; the prefixes that complete in one step run as one padded forward (their camera images
through the vision tower as one batch). Their K/V go into the
request's blocks of a paged cache (the engine's block table, ``kv_block_size`` tokens a block).

From then on the request is a denoising resident: each engine step is one Euler step of the action
expert for every resident, all in one padded forward (each its own prefix K/V gathered from its
blocks, its state, its actions and its step's time). A request joins at any step boundary. Its last
Euler step answers the end token, which finishes it; the plan is attached to its final output
(``finish_output``). Preempted and seated again, a request starts over from its noise: nothing of its
plan depends on random numbers drawn in the engine, so the plan is the same.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from ifb.runtime import ScheduledStep, Seat, SeatTable, SeqOutput, StepOutput
from ifb_plugins.action.gemma import KV
from ifb_plugins.action.pi0 import Pi0
from ifb_plugins.common.layers.attention import write_kv


@attrs.define(eq=False)
class Resident:
    """A seated request between steps: its actions so far and how many Euler steps they have taken."""

    #: the request's prompt length (its prefix KV occupies slots 0..num_prefix-1 of its blocks)
    num_prefix: int
    actions: torch.Tensor  # [C, A], the noise before the first step
    num_steps_done: int = 0
    is_prefilled: bool = False


class PagedPrefixKV:
    """The backbone's K/V per layer in pages of ``block_size`` tokens, addressed by the engine's block ids."""

    def __init__(self, model: Pi0, num_blocks: int, block_size: int) -> None:
        cfg = model.cfg.text
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The flat slots of positions 0..num_tokens-1 of a request with ``block_ids``."""
        positions = torch.arange(num_tokens)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, slots: torch.Tensor, kvs: list[KV]) -> None:
        """Store one request's prefix K/V (``[L, Hkv, D]`` per layer) into ``slots``."""
        for layer, (k, v) in enumerate(kvs):
            write_kv(k, v, self.keys[layer], self.values[layer], slots)

    def gather(self, slots: list[torch.Tensor]) -> tuple[list[KV], torch.Tensor]:
        """Several requests' prefix K/V as one padded batch: ``[B, max L, Hkv, D]`` per layer, and the lengths."""
        lens = torch.tensor([len(s) for s in slots])
        width = int(lens.max())
        out = []
        for k_cache, v_cache in zip(self.keys, self.values, strict=True):
            flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
            out.append(tuple(torch.stack([F.pad(flat[s], (0, 0, 0, 0, 0, width - len(s))) for s in slots])
                             for flat in (flat_k, flat_v)))
        return out, lens


class SteppedPlanner:
    """The engine's ``execute`` for pi0: one step of every seated request, prefixes and Euler steps batched."""

    def __init__(self, model: Pi0, *, num_blocks: int, block_size: int, end_token_id: int) -> None:
        self.model = model
        self.end_token_id = end_token_id
        self.kv = PagedPrefixKV(model, num_blocks, block_size)
        self.seats = SeatTable()
        self.residents: dict[str, Resident] = {}
        #: finished plans ``[C, A]`` float32, until the request's final output takes them
        self.plans: dict[str, torch.Tensor] = {}
        #: how many requests the last steps' backbone and expert forwards carried (what batching achieved)
        self.prefill_batch_sizes: list[int] = []
        self.denoise_batch_sizes: list[int] = []

    @torch.no_grad()
    def execute(self, step: ScheduledStep) -> StepOutput:
        for new in step.new_seqs:  # first seated, or back from preemption: the plan starts over
            self.residents[new.request_id] = Resident(num_prefix=new.num_prompt_tokens, actions=new.state.noise)
        seats = self.seats.apply(step)
        denoising: list[tuple[Seat, Resident]] = []
        for seq, seat in zip(step.seqs, seats, strict=True):
            if seq.is_sampling:  # the whole prefix is scheduled: prefill it (once), then denoise
                denoising.append((seat, self.residents[seq.request_id]))
        self._prefill([(s, r) for s, r in denoising if not r.is_prefilled])
        finished = self._denoise(denoising) if denoising else set()
        return StepOutput(tuple(
            SeqOutput(seq.request_id, self.end_token_id if seq.request_id in finished else None)
            for seq in step.seqs))

    def _prefill(self, batch: list[tuple[Seat, Resident]]) -> None:
        """The backbone over the prefixes completed this step, as one padded forward; K/V into their blocks."""
        if not batch:
            return
        model = self.model
        embeds = model.embed_prefixes([(seat.state.input_ids, seat.state.pixel_values) for seat, _ in batch])
        kvs, lens = model.prefix_kv(embeds)
        self.prefill_batch_sizes = [*self.prefill_batch_sizes[-255:], len(batch)]
        for b, (seat, resident) in enumerate(batch):
            n = int(lens[b])
            self.kv.write(self.kv.slots(seat.block_ids, n), [(k[b, :n], v[b, :n]) for k, v in kvs])
            resident.is_prefilled = True

    def _denoise(self, batch: list[tuple[Seat, Resident]]) -> set[str]:
        """One Euler step of every request in ``batch`` in one forward; the ids whose plan is now done."""
        model = self.model
        num_steps = model.cfg.num_inference_steps
        dt = -1.0 / num_steps
        prefix, lens = self.kv.gather([self.kv.slots(seat.block_ids, r.num_prefix) for seat, r in batch])
        state = torch.stack([seat.state.state for seat, _ in batch])
        actions = torch.stack([r.actions for _, r in batch]).to(state.dtype)
        time = torch.tensor([1.0 + r.num_steps_done * dt for _, r in batch], dtype=torch.float32)
        mask = model.suffix_mask(lens, prefix[0][0].shape[1])
        actions = actions + dt * model.velocity(state, actions, time, prefix, lens, mask)
        self.denoise_batch_sizes = [*self.denoise_batch_sizes[-255:], len(batch)]
        done = set()
        for b, (seat, resident) in enumerate(batch):
            resident.actions = actions[b]
            resident.num_steps_done += 1
            if resident.num_steps_done == num_steps:
                self.plans[seat.request_id] = actions[b].float()
                done.add(seat.request_id)
        return done

    def release(self, request_id: str) -> None:
        """The request left its seat; a plan it finished stays until its final output takes it."""
        self.residents.pop(request_id, None)
        self.seats.release(request_id)

    def take_plan(self, request_id: str) -> torch.Tensor | None:
        return self.plans.pop(request_id, None)
