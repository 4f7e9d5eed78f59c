"""The hybrid runtime: the model driven one scheduled step at a time, state held per seat.

Under ``--enable-context-reuse`` the runtime also keeps recurrent-state
checkpoints (``checkpoints.StateCheckpoints``, exposed as
``state_checkpoints`` for the context cache): each step captures the state at
the checkpoint positions it crosses, and a joiner staged to resume from a
checkpoint has it copied into its seat right after the seat is cleared.

Each seat owns one row of every Mamba layer's conv and SSM state. A request
keeps its seat from admission to release, so joiners prefill in place: a
prefill chunk continues from the state its previous chunk left, and nothing
moves when others join or leave. The seats of a step's new requests
(``ScheduledStep.new_seqs``) are zeroed before the step runs, and ``release``
zeroes a seat as it is freed.
A request preempted for lack of KV blocks is released like any other; when it
is seated again (perhaps in another seat, reset first) its prompt and generated
tokens are prefilled from position 0, so its state is recomputed, not saved.

On the blocking path the engine has one seat: requests (and an n > 1
request's sequences) take seat 0 one after another.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.params import RequestSpec
from ifb.runtime import Prepared, ScheduledStep, SeatTable, StepOutput
from ifb_plugins.mamba.checkpoints import DEFAULT_CHECKPOINT_INTERVAL, StateCheckpoints, plan_capacity
from ifb_plugins.mamba.config import HybridConfig
from ifb_plugins.mamba.layout import build_layout
from ifb_plugins.mamba.loader import build_hybrid_model, load_hybrid_dir
from ifb_plugins.mamba.model import HybridModel, allocate_cache
from ifb_plugins.mamba.vision import ImageInput, load_image_input
from ifb_plugins.common.chat.prompt import prompt_token_ids
from ifb_plugins.common.media.prompt import media_step_positions, splice_embeddings
from ifb_plugins.common.runtime.text import DEFAULT_MAX_MODEL_LEN, KV_BLOCK_SIZE, kv_capacity_tokens
from ifb_plugins.common.runtime.placement import device_of, float32_only
from ifb_plugins.common.decoding.sampling import sample_step
from ifb_plugins.common.chat.tokenizer import TextTokenizer

log = logging.getLogger("ifb.mamba")


def kv_bytes_per_token(config: HybridConfig) -> int:
    """Bytes of paged KV one token takes: K and V of every attention layer (float32, as ``allocate_cache``)."""
    return 4 * 2 * config.num_attention_layers * config.num_kv_heads * config.head_dim


class HybridRuntime:
    def __init__(self, *, model: HybridModel, tokenizer: TextTokenizer, caps: DeploymentCaps,
                 config: DeployConfig, model_name: str, images: ImageInput | None = None):
        self.model = model
        #: an image-text checkpoint's image input (``vision``): encoded at admission, spliced per step
        self.images = images
        self.tokenizer = tokenizer
        self.caps = caps
        self.model_name = model_name
        limit = int(config.options.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
        self.max_model_len = min(model.config.max_position_embeddings, limit)
        self.kv_block_size = KV_BLOCK_SIZE
        self.device = next(model.parameters()).device
        # sized from memory as the text runtime's pool is; the recurrent state per seat is fixed beside it
        capacity = kv_capacity_tokens(config, self.max_model_len, kv_bytes_per_token(model.config), self.device)
        self.num_kv_blocks = -(-capacity // KV_BLOCK_SIZE)
        self.num_seats = max(1, config.max_batch_size)
        self.state_checkpoints: StateCheckpoints | None = None
        interval = config.options.get("hybrid_checkpoint_interval")
        if config.enable_context_reuse:
            interval = int(interval or DEFAULT_CHECKPOINT_INTERVAL)
            plan = plan_capacity(model.config, capacity, KV_BLOCK_SIZE, interval, self.num_seats,
                                 may_grow=config.max_kv_cache_capacity is None)
            self.num_kv_blocks = plan.num_kv_blocks
            self.state_checkpoints = StateCheckpoints(model.config, plan.num_state_slots, interval, KV_BLOCK_SIZE,
                                                      self.device)
            log.info("prefix reuse: %d KV blocks and %d state checkpoint slots (%d blocks each), a checkpoint "
                     "every %d tokens", plan.num_kv_blocks, plan.num_state_slots, plan.blocks_per_slot, interval)
        elif interval is not None:
            raise ValueError("--hybrid-checkpoint-interval sets how often prefix reuse keeps the recurrent state: "
                             "add --enable-context-reuse")
        self.cache = allocate_cache(model.config, self.num_seats, self.num_kv_blocks, KV_BLOCK_SIZE, self.device)
        self.vocab_size = model.config.vocab_size
        #: each seated request's history and block table, kept from the steps' diffs
        self.seats = SeatTable()

    # ---- admission ----
    def prepare(self, spec: RequestSpec) -> Prepared:
        if self.images is not None:
            prepared = self.images.prepare(spec, self.tokenizer, max_model_len=self.max_model_len,
                                           dtype=self.model.backbone.embeddings.weight.dtype)
            if prepared is not None:
                return prepared
        return Prepared(tuple(prompt_token_ids(self.tokenizer, self.vocab_size, spec)))

    # ---- stepped execution ----
    @torch.inference_mode()
    def execute(self, step: ScheduledStep) -> StepOutput:
        seqs = step.seqs
        bad = [s.seat for s in seqs if not 0 <= s.seat < self.num_seats]
        if bad:
            raise ValueError(f"seat {bad[0]} is outside the {self.num_seats} seats this runtime holds state for")
        self.cache.clear_seats(list(step.reset_seats))
        seats = self.seats.apply(step)
        store = self.state_checkpoints
        captures = None
        if store is not None:
            store.apply_restores(seqs, self.cache)
            captures = store.plan(seqs, seats)
        layout = build_layout([(s.seat, s.start_pos, len(s.token_ids), seat.block_ids) for s, seat in zip(seqs, seats)],
                              self.kv_block_size, self.device, captures)
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        embeds = positions = None
        if self.images is not None:  # image rows of this step's chunks, and every token's M-RoPE ids
            embeds = splice_embeddings(step, seats, ids, self.model.embed)
            positions = media_step_positions(step, seats).to(self.device)
        hidden = self.model(ids, layout, self.cache, embeds, positions)  # [T, H]
        if store is not None:
            store.captured(self.cache)
        return sample_step(seqs, seats, hidden, self.model.compute_logits)

    def release(self, request_id: str, seat: int) -> None:
        # KV blocks go back through the engine; the recurrent state lives here and is cleared now.
        self.seats.release(request_id)
        if 0 <= seat < self.num_seats:
            self.cache.clear_seats([seat])
        if self.state_checkpoints is not None:
            self.state_checkpoints.cancel_restore(request_id)

    def seat_state(self, seat: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of a seat's conv and SSM state, one per Mamba layer (for inspection)."""
        return ([t[seat].clone() for t in self.cache.conv], [t[seat].clone() for t in self.cache.ssm])


def load_hybrid_runtime(config: DeployConfig, caps: DeploymentCaps) -> HybridRuntime:
    loaded = load_hybrid_dir(config.model)
    # the recurrent mixers' numerics are written (and tested) in float32: --dtype auto is float32 here
    float32_only(config, "the hybrid Mamba deployment")
    model = build_hybrid_model(loaded, device=device_of(config))
    name = config.options.get("served_model_name") or Path(loaded.path).name
    images = None
    if loaded.vision_state is not None:
        allowed = config.options.get("allowed_local_media_path")
        images = load_image_input(Path(loaded.path), loaded.raw_config or {}, loaded.vision_state, loaded.tokenizer,
                                  next(model.parameters()).device, Path(allowed) if allowed else None)
    log.info("loaded %s (pattern %s, hidden %d%s)", name, loaded.config.pattern, loaded.config.hidden_size,
             ", image input" if images is not None else "")
    return HybridRuntime(model=model, tokenizer=loaded.tokenizer, caps=caps, config=config, model_name=name,
                         images=images)
