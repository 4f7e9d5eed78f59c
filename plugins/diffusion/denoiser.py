"""Denoising steps of several requests in one forward.

Every request (a ``DiffusionJob``) brings its current canvas to each forward,
as a segment of its own beside the others, with its own finished-block KV;
a block that just finished rides along as finished tokens to encode, ahead
of the request's next canvas. A job can join before any step and leave after
any: nothing of one job's state depends on who else shares the forward.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ifb_plugins.diffusion.cache import PrefixKV
from ifb_plugins.diffusion.model import DiffusionGemmaModel, SegmentInput
from ifb_plugins.diffusion.sampler import BlockSampler, BlockState


@attrs.define(eq=False)
class DiffusionJob:
    """One request's generation state between denoising steps."""

    cache: PrefixKV
    sampler: BlockSampler
    #: finished tokens whose KV is not cached yet (the prompt, then each finished block) [T]
    pending: torch.Tensor | None
    block: BlockState | None = None
    num_forwards: int = 0


class Denoiser:
    """Runs one denoising step for each of a set of jobs in one forward."""

    def __init__(self, model: DiffusionGemmaModel) -> None:
        self.model = model

    def new_job(self, prompt_ids: Sequence[int], sampler: BlockSampler) -> DiffusionJob:
        return DiffusionJob(cache=self.model.new_cache(), sampler=sampler,
                            pending=torch.tensor(list(prompt_ids), dtype=torch.long))

    def step(self, jobs: Sequence[DiffusionJob]) -> list[torch.Tensor | None]:
        """One denoising step of every job; per job its finished block's tokens ``[L]``, or None."""
        inputs = []
        for job in jobs:
            if job.block is None:
                job.block = job.sampler.new_block()
            if job.pending is not None:
                inputs.append(SegmentInput(job.pending, job.cache, is_canvas=False))
                job.pending = None
            inputs.append(SegmentInput(job.block.canvas, job.cache, is_canvas=True,
                                       self_conditioning=job.block.self_conditioning))
        logits = self.model(inputs)  # one [L, V] per job, in order
        finished: list[torch.Tensor | None] = []
        for job, job_logits in zip(jobs, logits, strict=True):
            job.num_forwards += 1
            if job.sampler.advance(job.block, job_logits):
                finished.append(job.block.argmax)
                job.pending, job.block = job.block.argmax, None
            else:
                finished.append(None)
        return finished
