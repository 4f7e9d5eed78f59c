"""The DiffusionGemma runtime: block-diffusion requests as stepped, seated residents.

Each engine step is one denoising step of every sampling resident, all in one
forward (``Denoiser``). A resident whose block is still denoising returns no
token; one whose block finished returns the whole block, which the scheduler
appends and streams as one output, stops at an end token, a stop token or
string, or ``max_tokens``, and schedules back as tokens to encode, which ride
along with the next block's first step. A request joins at any step boundary
and leaves when its last block is done. ``params.seed`` seeds the request's
own sampler; ``params.temperature`` scales the checkpoint's temperature
schedule (1: as it is; 0: its limit, the argmax).
"""

from __future__ import annotations

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb.runtime import Prepared, ScheduledStep, SeqOutput, StepOutput
from ifb_plugins.common.chat.prompt import prompt_token_ids
from ifb_plugins.diffusion.denoiser import Denoiser, DiffusionJob
from ifb_plugins.diffusion.loader import LoadedDiffusion
from ifb_plugins.diffusion.sampler import BlockSampler

#: sampling parameters a block-diffusion sampler has no use for, with the values that mean "off"
_UNUSED = {"top_p": 1.0, "top_k": (0, -1), "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0}


def check_params(params: SamplingParams) -> None:
    """Refuse what the block-diffusion sampler cannot honour (InvalidRequest naming the parameter)."""
    for name, off in _UNUSED.items():
        value = getattr(params, name)
        if value not in (off if isinstance(off, tuple) else (off,)):
            raise InvalidRequest(f"{name} is not supported by the block-diffusion sampler (its tokens are "
                                 f"accepted by an entropy bound over a temperature schedule); leave it unset")
    if params.logprobs is not None:
        raise InvalidRequest("logprobs are not produced by the block-diffusion sampler: a token's final value "
                             "comes from the last denoising step's argmax, not from one draw")


@attrs.define(eq=False)
class Resident:
    """A seated request: its generation state and what of its tokens the cache already holds."""

    request_id: str
    job: DiffusionJob
    #: tokens the scheduler sent that are not encoded yet (prefill chunks before the sampling one)
    pending: list[int] = attrs.field(factory=list)
    #: tokens the scheduler has sent so far (a recomputation or a re-sent last token starts below it)
    num_seen: int = 0


class DiffusionRuntime:
    """A DiffusionGemma model under the engine: ``execute`` runs one denoising step of a batch of requests."""

    def __init__(self, *, loaded: LoadedDiffusion, caps: DeploymentCaps, config: DeployConfig, model_name: str):
        self.config = loaded.config
        self.settings = loaded.settings
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.caps = caps
        self.model_name = model_name
        self.denoiser = Denoiser(self.model)
        limit = config.options.get("max_model_len")
        self.max_model_len = min(int(limit), self.config.max_position_embeddings) if limit else \
            self.config.max_position_embeddings
        # The KV of finished tokens is each request's own (it grows with it): the engine's block
        # bookkeeping counts a canvas a block, room for every seat's whole context, so no resident is
        # ever preempted (a recomputed request could not resume its random numbers).
        self.kv_block_size = self.config.canvas_length
        self.num_kv_blocks = -(-self.max_model_len // self.kv_block_size) * max(1, config.max_batch_size)
        self._residents: dict[str, Resident] = {}

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def num_parameters(self) -> dict[str, int]:
        return {"backbone": sum(p.numel() for p in self.model.parameters())}

    def prepare(self, spec: RequestSpec) -> Prepared:
        check_params(spec.params)
        return Prepared(tuple(prompt_token_ids(self.tokenizer, self.config.vocab_size, spec)))

    def release(self, request_id: str, seat: int) -> None:
        self._residents.pop(request_id, None)

    def new_sampler(self, params: SamplingParams) -> BlockSampler:
        """A request's sampler with its own generator, seeded as it asks."""
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        return BlockSampler(self.settings, self.config.vocab_size, self.config.canvas_length, generator,
                            temperature=params.temperature)

    def execute(self, step: ScheduledStep) -> StepOutput:
        for new in step.new_seqs:  # seated (a preempted request would start its random numbers afresh)
            job = DiffusionJob(cache=self.model.new_cache(), sampler=self.new_sampler(new.params), pending=None)
            self._residents[new.request_id] = Resident(new.request_id, job)
        sampling: list[Resident] = []
        for seq in step.seqs:
            resident = self._residents[seq.request_id]
            new = seq.token_ids[max(0, resident.num_seen - seq.start_pos):]  # the last token comes back unchanged
            resident.pending.extend(new)
            resident.num_seen = max(resident.num_seen, seq.start_pos + len(seq.token_ids))
            if seq.is_sampling:
                # finished tokens are encoded in one piece, however the scheduler chunked them
                if resident.pending:
                    resident.job.pending = torch.tensor(resident.pending, dtype=torch.long)
                    resident.pending = []
                sampling.append(resident)
        blocks = self.denoiser.step([r.job for r in sampling]) if sampling else []
        finished = {}
        for resident, block in zip(sampling, blocks):
            if block is not None:
                resident.job.pending = None  # the scheduler sends the block back as tokens to encode
                finished[resident.request_id] = block.tolist()
        return StepOutput(tuple(
            SeqOutput(seq.request_id, finished[seq.request_id][0], more_token_ids=tuple(finished[seq.request_id][1:]))
            if seq.request_id in finished else SeqOutput(seq.request_id, None)
            for seq in step.seqs))
