"""The text runtime: the model driven one scheduled step at a time.

``execute`` packs a step's ragged prefill chunks and decode tokens into one
forward over the paged KV cache, then samples per sequence. What ``prepare``
decides for a request (its grammar, LoRA adapter, media, system-prompt capture)
is a typed ``TextRequestState``; it reaches the runtime once, when the request
takes a seat, and stays in the runtime's ``SeatTable`` until it leaves. Within
one step each row has its own sampling parameters, its own grammar (the masks
are computed while the forward runs) and its own adapter (rows grouped by
adapter, ``lora``); the blocks n > 1 sequences fork are copied before the
forward. On the blocking path the system prompt is captured by
``blocking_prefix``; under in-flight batching the context cache does it.

With a ``drafter`` (speculative decoding) a step that gives a seat room for
drafts first asks the drafter for them, then runs one forward over every seat's
tokens and drafts together and verifies each seat's drafts against its own
rows of logits (``decoding.speculative``). A drafter's failure ends only the
drafting of the seats it was drafting for; their step goes on without drafts.

A family whose sliding-window layers read only their window (``layer_windows``:
Gemma 4, gpt-oss) has them as KV cache groups (``kv_window_groups``): per
window, a pool of its own, sized for every seat's window plus one step's
tokens, beside the full-attention layers' pool, which memory sizes; each
seat's table there (``Seat.window_block_ids``) names the null block where the
engine freed what lies before the window, and each step's metadata is built per
group (``layers.attention.GroupedAttn``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.kv import BlockManager, WindowGroupSpec
from ifb.params import InvalidRequest, RequestSpec, SamplingParams
from ifb.runtime import Prepared, ScheduledSeq, ScheduledStep, Seat, SeatTable, StepOutput
from ifb_plugins.common.decoding.speculative import verify_step
from ifb_plugins.common.layers.attention import GroupedAttn, build_attn_metadata
from ifb_plugins.common.decoding.guided import GuidedDecoder, GuidedGrammar
from ifb_plugins.common.runtime.lora import LoraAdapter, LoraSet, step_groups
from ifb_plugins.common.models.decoder import TextModel, allocate_kv_cache
from ifb_plugins.common.chat.prompt import prompt_token_ids, render_chat
from ifb_plugins.common.decoding.sampling import sample_step, sampled_rows
from ifb_plugins.common.runtime.syscache import SystemPromptCache, system_prefix_length
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.common.speculative.drafter import Drafter, DraftRequest

log = logging.getLogger("ifb.text")

KV_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 8192


#: share of the memory free at start-up that the default KV cache may take, per device kind
KV_MEMORY_FRACTION = {"cpu": 0.1, "cuda": 0.5}


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now: the CUDA allocator's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_capacity_tokens(config: DeployConfig, max_model_len: int, bytes_per_token: int | None = None,
                       device: torch.device | None = None, reserved_bytes: int = 0) -> int:
    """Tokens of KV to allocate: ``--max-kv-cache-capacity``, or a default sized from memory.

    KV blocks are taken as sequences grow, so a bigger pool seats more long
    answers at once. The default is what a tenth of the host's available memory
    holds (half the free memory on a CUDA device), at most every seat at the
    full context, and at least one full context. Without ``bytes_per_token``
    (a runtime that does not size from memory) it is room for every seat at 2k tokens;
    with 0 (a model without attention layers) every seat at the full context.
    ``reserved_bytes`` (the sliding-window groups' pools) come off the memory first.
    """
    if config.max_kv_cache_capacity:
        return config.max_kv_cache_capacity
    if bytes_per_token is None:
        return max(config.max_batch_size * 2048, min(max_model_len, 8192))
    if bytes_per_token == 0:  # no attention layer: the blocks are bookkeeping, no memory
        return config.max_batch_size * max_model_len
    device = device or torch.device("cpu")
    fraction = KV_MEMORY_FRACTION.get(device.type, KV_MEMORY_FRACTION["cpu"])
    affordable = max(0, int(free_memory_bytes(device) * fraction) - reserved_bytes) // bytes_per_token
    return min(config.max_batch_size * max_model_len, max(affordable, max_model_len))


def max_model_len_for(model: TextModel, config: DeployConfig) -> int:
    """The longest context a runtime over ``model`` serves: the model's, ``max_model_len`` if smaller."""
    limit = int(config.options.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
    length = min(model.config.max_position_embeddings, limit)
    if model.config.sliding_window and not getattr(model, "applies_sliding_window", False):
        # attention here is full-context: within the window it equals sliding-window attention,
        # beyond it it would not, so the context stops at the window
        length = min(length, model.config.sliding_window)
    return length


def kv_bytes_per_token(model: TextModel, kv_dtype: torch.dtype) -> int:
    """KV bytes one context token takes in ``model``'s cache (a sharded model: this rank's KV heads)."""
    c = model.config
    element_size = torch.empty((), dtype=kv_dtype).element_size()
    if hasattr(model, "allocate_kv_caches"):  # its layers' KV shapes differ: the family counts them
        return c.kv_bytes_per_token(element_size)
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * element_size


#: positions before a sliding layer's window that a drafter may read: Gemma 4's assistant queries the
#: target's cache one position before the target's next query, with a window one wider
WINDOW_DRAFTER_REACH = 2


def window_pool_blocks(window: int, block_size: int, num_seats: int, token_budget: int) -> int:
    """Blocks a sliding-window group needs so that it never runs short before the full pool does: each
    seat holds at most its window and its share of the step (``ifb.kv.WindowGroup.max_blocks_per_seq``:
    ``ceil((window - 1 + n) / block) + 1``), the shares add up to the token budget, and the admission
    watermark's blocks on top."""
    per_seat = -(-(window + WINDOW_DRAFTER_REACH - 1) // block_size) + 2
    needed = num_seats * per_seat + -(-token_budget // block_size)
    return needed + max(1, needed // 100) + num_seats


@attrs.frozen
class MediaState:
    """A prompt's media as ``media.prompt.expand_media`` placed it: embeddings and, for M-RoPE, positions."""

    #: ``[(prompt rows [N], embeddings [N, H])]`` in prompt order
    embeds: tuple[tuple[torch.Tensor, torch.Tensor], ...] = attrs.field(eq=False, repr=False)
    #: the prompt's ``mrope.MropePositions`` (M-RoPE decoders), else None
    positions: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class TextRequestState:
    """What ``TextRuntime.prepare`` decided for one request (``Prepared.state``)."""

    grammar: GuidedGrammar | None = None
    #: the LoRA adapter applied to the request's rows (held, so an unloaded adapter serves it to its end)
    lora: LoraAdapter | None = attrs.field(default=None, eq=False)
    #: ``save_system_prompt_kv_cache``: capture the system prompt before the request's first step
    is_capturing_system_prompt: bool = False
    media: MediaState | None = None


class TextRuntime:
    def __init__(self, *, model: TextModel, tokenizer: TextTokenizer, caps: DeploymentCaps,
                 config: DeployConfig, model_name: str, lora: LoraSet | None = None,
                 kv_dtype: torch.dtype = torch.float32):
        self.model = model
        self.tokenizer = tokenizer
        self.caps = caps
        self.model_name = model_name
        self.lora = lora or LoraSet(model, {})
        self.max_model_len = max_model_len_for(model, config)
        self.kv_block_size = KV_BLOCK_SIZE
        self.device = next(model.parameters()).device
        # a family whose layers differ in KV shape (Gemma 4, gpt-oss) lays out its own caches
        own_layout = getattr(model, "allocate_kv_caches", None)
        #: per KV cache (layer), its sliding window (None: the full-attention group)
        self.layer_windows: tuple[int | None, ...] = tuple(getattr(model, "layer_windows", tuple)())
        #: the sliding windows that are KV cache groups of their own, and each group's pool (blocks)
        self.windows = tuple(sorted({w for w in self.layer_windows if w is not None}))
        element_size = torch.empty((), dtype=kv_dtype).element_size()
        bytes_per_token = kv_bytes_per_token(model, kv_dtype)
        window_blocks, reserved = {}, 0
        if len(self.windows) == 1:  # the families' one window (a second would need its own null block)
            (window,) = self.windows
            window_blocks[window] = window_pool_blocks(window, KV_BLOCK_SIZE, config.max_batch_size,
                                                       max(config.max_num_batched_tokens, config.max_batch_size))
            window_bytes = model.config.kv_bytes_per_token(element_size, "sliding_attention")
            bytes_per_token -= window_bytes
            reserved = (window_blocks[window] + 1) * KV_BLOCK_SIZE * window_bytes
        else:
            self.windows = ()
        capacity = kv_capacity_tokens(config, self.max_model_len, bytes_per_token, self.device, reserved)
        self.num_kv_blocks = -(-capacity // KV_BLOCK_SIZE)
        # a window group never holds more than the context's blocks (the full pool's count)
        self.num_window_blocks = {w: min(n, self.num_kv_blocks) for w, n in window_blocks.items()}
        if own_layout:
            self.kv_caches = own_layout(self.num_kv_blocks, KV_BLOCK_SIZE, kv_dtype, self.device,
                                        num_window_blocks=self.num_window_blocks.get(self.windows[0])
                                        if self.windows else None)
        else:
            self.kv_caches = allocate_kv_cache(model.config, self.num_kv_blocks, KV_BLOCK_SIZE,
                                               dtype=kv_dtype, device=self.device)
        self.vocab_size = model.config.vocab_size
        self.guided = GuidedDecoder(tokenizer, self.vocab_size)
        #: each seated request's history, block tables and prepared state, kept from the steps' diffs; a
        #: window group's freed entries name its null block, the one past its pool
        self.seats = SeatTable(null_block_ids=[self.num_window_blocks[w] for w in self.windows])
        #: torch intra-op threads while a step runs (None: leave torch's setting alone). With the
        #: matmuls on the native kernels' own threads, torch's remaining per-step ops are too small
        #: to gain from OpenMP, whose workers, woken from a non-main thread, only add latency.
        self.step_torch_threads: int | None = None
        #: picks the tokens of an all-greedy batch (``sampling.sample``'s ``argmax``; None: torch's)
        self.greedy_argmax: Callable[[torch.Tensor], list[int]] | None = None
        #: the draft source where the deployment speculates (``caps.speculation``), else None
        self.drafter: Drafter | None = None
        #: per seat, the target's hidden state that predicted its last token (for drafters that read it)
        self._last_hidden: dict[str, torch.Tensor] = {}

    @property
    def kv_window_groups(self) -> tuple[WindowGroupSpec, ...]:
        """The sliding-window KV groups (``ifb.kv``): the positions before each query that its layers read,
        and a drafter's more where it reads the target's cache (``WINDOW_DRAFTER_REACH``)."""
        reach = WINDOW_DRAFTER_REACH if getattr(self.drafter, "reads_target_kv", False) else 0
        return tuple(WindowGroupSpec(w + reach, self.num_window_blocks[w]) for w in self.windows)

    # ---- admission ----
    def prepare(self, spec: RequestSpec) -> Prepared:
        ids = prompt_token_ids(self.tokenizer, self.vocab_size, spec)
        name = spec.extras.get("lora") or None
        try:
            lora = self.lora.get(name) if name else None
        except KeyError as exc:
            raise InvalidRequest(exc.args[0], param="model") from None
        is_capturing = bool(spec.extras.get("save_system_prompt_kv_cache"))
        state = TextRequestState(grammar=self.guided.compile(spec.extras.get("response_format"), after=spec.thinking),
                                 lora=lora, is_capturing_system_prompt=is_capturing)
        # an adapter changes every layer's KV: the context cache keys its blocks apart
        return Prepared(tuple(ids), state, kv_salt=lora.kv_salt if lora else None,
                        num_pinned_tokens=system_prefix_length(self.tokenizer, spec, ids) if is_capturing else 0)

    def render_chat(self, messages: list[dict]) -> str:
        return render_chat(self.tokenizer, messages)

    # ---- stepped execution ----
    def execute(self, step: ScheduledStep) -> StepOutput:
        want = self.step_torch_threads
        before = torch.get_num_threads() if want else 0
        if not want or before == want:
            return self._execute(step)
        torch.set_num_threads(want)
        try:
            return self._execute(step)
        finally:
            torch.set_num_threads(before)

    @torch.inference_mode()
    def _execute(self, step: ScheduledStep) -> StepOutput:
        seqs = step.seqs
        seats = self.seats.apply(step)
        self.copy_blocks(step.block_copies, step.window_block_copies)
        if self.drafter is not None and any(s.num_draft_tokens for s in seqs):
            return self._speculate(step, seats)
        groups = step_groups([getattr(seat.state, "lora", None) for seat in seats], [len(s.token_ids) for s in seqs],
                             self.device)
        # the grammars' masks for this step's sampling rows are computed while the forward runs
        self.guided.prefetch([seat for s, seat in zip(seqs, seats) if s.is_sampling])
        try:
            with self.lora.step(groups):
                hidden = self._hidden(step, seats)  # [T, H]
            if self.drafter is not None and self.drafter.needs_hidden_states:
                self._keep_hidden(seqs, hidden, [0] * len(seqs))
            return sample_step(seqs, seats, hidden, self.model.compute_logits, argmax=self.greedy_argmax,
                               guided=self.guided)
        finally:
            self.guided.discard()

    def copy_blocks(self, copies, window_copies=()) -> None:
        """Copy KV blocks (source, destination) in every layer: n > 1 sequences forking their prompt's last
        block; a sliding-window group's layers copy its own (``window_copies``, per group)."""
        by_window = {None: copies, **dict(zip(self.windows, window_copies))}
        for i, cache in enumerate(self.kv_caches):
            pairs = by_window.get(self.layer_windows[i] if self.layer_windows else None, copies)
            if cache is None or not pairs:
                continue  # a KV-shared layer's is its source's
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
            for c in cache:
                c.index_copy_(0, dst, c.index_select(0, src))

    @torch.inference_mode()
    def execute_shard(self, step: ScheduledStep) -> None:
        """A tensor-parallel rank other than 0: this rank's shard of the step's forward (its KV heads'
        share written to its cache), and its share of the logits rank 0 samples from (``sample_step``'s rows)."""
        seats = self.seats.apply(step)
        for new in step.new_seqs:  # the prepared state stays on rank 0; the salt names the adapter
            if new.kv_salt is not None:
                self.seats.seats[new.request_id].state = TextRequestState(lora=self.lora.by_salt(new.kv_salt))
        self.copy_blocks(step.block_copies, step.window_block_copies)  # each rank forks its own KV share
        groups = step_groups([getattr(seat.state, "lora", None) for seat in seats], [len(s.token_ids) for s in step.seqs],
                             self.device)
        with self.lora.step(groups):  # each rank's share of the adapters' low-rank products
            hidden = self._hidden(step, seats)
        rows = [t for _, t in sampled_rows(step.seqs)]
        if rows:
            self.model.compute_logits(hidden[rows])

    def _speculate(self, step: ScheduledStep, seats: list[Seat]) -> StepOutput:
        """Draft for the seats given room, then run and verify the step with the drafts in it."""
        seqs = step.seqs
        asked = [i for i, s in enumerate(seqs) if s.num_draft_tokens and s.is_sampling]
        wants_hidden = self.drafter.needs_hidden_states
        results = self.drafter.propose([DraftRequest(
            seqs[i].request_id, seats[i].token_ids, seqs[i].num_draft_tokens, seats[i].block_ids,
            self._last_hidden.get(seqs[i].request_id) if wants_hidden else None,
            window_block_ids=dict(zip(self.windows, seats[i].window_block_ids))) for i in asked])
        drafts: list[tuple[int, ...]] = [()] * len(seqs)
        errors: dict[int, str] = {}
        for i, result in zip(asked, results):
            if isinstance(result, Exception):
                log.warning("drafting for %s failed: %s: %s", seqs[i].request_id, type(result).__name__, result)
                errors[i] = f"{type(result).__name__}: {result}"
            else:
                drafts[i] = tuple(result)[:seqs[i].num_draft_tokens]
        verified = ScheduledStep(step_id=step.step_id, new_seqs=step.new_seqs, seqs=tuple(
            attrs.evolve(s, token_ids=s.token_ids + d) if d else s for s, d in zip(seqs, drafts)))
        groups = step_groups([getattr(seat.state, "lora", None) for seat in seats],
                             [len(s.token_ids) for s in verified.seqs], self.device)
        # a drafting guided seat's masks follow its drafts (``verify_step``), computed after the forward
        self.guided.prefetch([seat for s, seat, d in zip(seqs, seats, drafts) if s.is_sampling and not d])
        try:
            with self.lora.step(groups):
                hidden = self._hidden(verified, seats)
            out = verify_step(seqs, seats, drafts, hidden, self.model.compute_logits, argmax=self.greedy_argmax,
                              guided=self.guided)
        finally:
            self.guided.discard()
        for i, (seq, result) in enumerate(zip(seqs, out.seqs)):
            if result.accepted:
                self.seats.accept(seq.request_id, [t.token_id for t in result.accepted])
            if i in asked:
                self.drafter.accepted(seq.request_id, len(seats[i].token_ids))
            if i in errors:
                out_seqs = list(out.seqs)
                out_seqs[i] = attrs.evolve(result, speculation_error=errors[i])
                out = StepOutput(tuple(out_seqs))
        if wants_hidden:
            self._keep_hidden(verified.seqs, hidden, [len(d) - len(r.accepted) for d, r in zip(drafts, out.seqs)])
        return out

    def _keep_hidden(self, seqs, hidden: torch.Tensor, num_rejected: list[int]) -> None:
        """Keep, per sampling seat, the hidden state that predicted its newest token."""
        last = -1
        for seq, rejected in zip(seqs, num_rejected):
            last += len(seq.token_ids)
            if seq.is_sampling:
                self._last_hidden[seq.request_id] = hidden[last - rejected].clone()

    def _hidden(self, step: ScheduledStep, seats: list[Seat]) -> torch.Tensor:
        """The last layer's hidden states ``[T, H]`` of the step's tokens (their KV written to the cache)."""
        seqs = step.seqs
        input_ids = [t for s in seqs for t in s.token_ids]
        attn = build_attn_metadata([(s.start_pos, len(s.token_ids), seat.block_ids) for s, seat in zip(seqs, seats)],
                                   self.kv_block_size, self.device,
                                   num_prompt_tokens=[seat.num_prompt_tokens for seat in seats])
        if self.windows:  # each sliding-window group's layers read and write their own table
            attn = GroupedAttn(attn, tuple(
                (w, build_attn_metadata([(s.start_pos, len(s.token_ids), seat.window_block_ids[g])
                                         for s, seat in zip(seqs, seats)], self.kv_block_size, self.device))
                for g, w in enumerate(self.windows)))
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = self.step_positions(step, seats)
        return self.model(ids, pos, attn, self.kv_caches, self.step_embeddings(step, seats, ids))

    def step_positions(self, step: ScheduledStep, seats: list[Seat]) -> torch.Tensor:
        """Rotary positions of the step's tokens: ``[T]``, each token's index in its context.

        An M-RoPE runtime overrides this to return ``[3, T]`` ids (``ifb_plugins.common.layers.mrope``).
        """
        positions = [p for s in step.seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
        return torch.tensor(positions, dtype=torch.long, device=self.device)

    def step_embeddings(self, step: ScheduledStep, seats: list[Seat], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Input embeddings ``[T, H]`` for the step, or None to embed ``input_ids`` as usual.

        Multimodal runtimes override this to splice media embeddings over placeholder tokens.
        """
        return None

    def release(self, request_id: str, seat: int) -> None:
        # attention state lives in KV blocks, which the engine frees; a guided matcher and the seat's record here
        self.guided.release(request_id)
        self.seats.release(request_id)
        self._last_hidden.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.release(request_id)

    # ---- blocking path ----
    def blocking_prefix(self, blocks: BlockManager) -> SystemPromptCache:
        """The legacy system-prompt capture over the blocking engine's ``blocks``: a request with
        ``save_system_prompt_kv_cache`` has its system prompt prefilled (with the base weights) before its
        first step, and later requests that start with it lease those blocks."""
        return SystemPromptCache(blocks, self)

    @torch.inference_mode()
    def prefill_only(self, token_ids: list[int], block_ids: list[int],
                     window_block_ids: list[list[int]] = ()) -> None:
        """Compute KV for ``token_ids`` into ``block_ids`` (and each sliding-window group's table) without
        sampling (prefix capture), with the base weights."""
        budget = 512
        seat = Seat("prefix-capture", 0, SamplingParams(), len(token_ids), list(token_ids), list(block_ids),
                    TextRequestState(), window_block_ids=[list(t) for t in window_block_ids])
        for start in range(0, len(token_ids), budget):
            chunk = tuple(token_ids[start:start + budget])
            self._hidden(ScheduledStep(step_id=0, seqs=(ScheduledSeq(
                request_id=seat.request_id, seat=0, token_ids=chunk, start_pos=start, new_block_ids=(),
                is_sampling=False),)), [seat])
