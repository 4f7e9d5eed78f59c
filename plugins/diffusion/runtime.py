"""The DiffusionGemma runtime on the blocking path: one request per ``handle_request``.

A request generates ``ceil(max_tokens / canvas_length)`` blocks at most and
stops at the block holding an end-of-sequence token (or a stop token or
string); its answer is cut there and at ``max_tokens``. Each finished block
is streamed as one output. ``params.seed`` seeds the request's sampler;
``params.temperature`` scales the checkpoint's temperature schedule (1: as it
is; 0: its limit, the argmax).
"""

from __future__ import annotations

import math
from typing import Iterator

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.outputs import RequestOutput
from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb.request import Request
from ifb.runtime import Prepared
from ifb_plugins.common.prompt import prompt_token_ids
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
class Generation:
    """One request's blocks so far and why it stops."""

    job: DiffusionJob
    max_tokens: int
    num_blocks_left: int
    stop_ids: frozenset[int]
    num_tokens: int = 0
    finish_reason: str | None = None

    def take(self, block: torch.Tensor) -> list[int]:
        """The tokens of a finished block that belong to the answer; sets ``finish_reason`` when it ends."""
        self.num_blocks_left -= 1
        kept = []
        for token in block.tolist():
            if self.num_tokens >= self.max_tokens:
                self.finish_reason = "length"
                break
            kept.append(token)
            self.num_tokens += 1
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None and (self.num_blocks_left == 0 or self.num_tokens >= self.max_tokens):
            self.finish_reason = "length"
        return kept


class DiffusionRuntime:
    """A DiffusionGemma model served one request at a time: no stepped execution (no ``execute``)."""

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
        # a block's KV is kept as it finishes: in the engine's bookkeeping a KV block is one canvas
        self.kv_block_size = self.config.canvas_length
        self.num_kv_blocks = -(-self.max_model_len // self.kv_block_size)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def num_parameters(self) -> dict[str, int]:
        return {"backbone": sum(p.numel() for p in self.model.parameters())}

    def prepare(self, spec: RequestSpec) -> Prepared:
        check_params(spec.params)
        return Prepared(tuple(prompt_token_ids(self.tokenizer, self.config.vocab_size, spec)))

    def release(self, request_id: str, seat: int) -> None:
        pass

    def new_generation(self, request: Request) -> Generation:
        """A request's sampler (seeded as it asks), empty cache and length limits."""
        params = request.params
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        sampler = BlockSampler(self.settings, self.config.vocab_size, self.config.canvas_length, generator,
                               temperature=params.temperature)
        # no max_tokens: the checkpoint's max_new_tokens, as the reference's generate
        max_tokens = min(params.max_tokens or self.settings.max_new_tokens, request.max_tokens)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(request.eos_token_ids)
        return Generation(job=self.denoiser.new_job(request.prompt_token_ids, sampler), max_tokens=max_tokens,
                          num_blocks_left=math.ceil(max_tokens / self.config.canvas_length),
                          stop_ids=frozenset(stop_ids))

    def block_output(self, request: Request, generation: Generation, block: torch.Tensor) -> RequestOutput:
        """A finished block as the request's next output (its last when the generation ends)."""
        tokens = generation.take(block)
        eos = None
        if generation.finish_reason == "stop" and tokens and tokens[-1] in request.eos_token_ids:
            eos = tokens.pop()  # counted and returned, not detokenized (as the stepped engine does)
        for token in tokens:
            request.detok.add(token)
            if request.detok.stopped:
                generation.finish_reason = "stop"
                break
        request.output_token_ids.extend(tokens + ([eos] if eos is not None else []))
        final = generation.finish_reason is not None
        if final:
            request.detok.flush()
        text = request.detok.release(final=final)
        token_ids, _ = request.detok.release_tokens(final=final)
        return RequestOutput(
            request_id=request.request_id, text=text, token_ids=token_ids + ((eos,) if eos is not None else ()),
            finished=final, finish_reason=generation.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids) - request.detok.num_dropped)

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[RequestOutput]:
        generation = self.new_generation(request)
        while True:
            if request.handle.cancelled.is_set():
                yield RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                                    finish_reason="cancelled")
                return
            (block,) = self.denoiser.step([generation.job])
            if block is not None:
                out = self.block_output(request, generation, block)
                yield out
                if out.finished:
                    return
