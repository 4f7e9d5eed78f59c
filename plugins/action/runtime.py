"""The pi0 runtime: a chat request with camera images, a task and the robot state in; a plan out.

``prepare`` (any thread) reads the request as ``PI0Processor`` would: one user message whose image
parts are the cameras (in order) and whose text parts are the task, and the request's trajectory
(one point: pi0 plans from the current state). It refuses what pi0 cannot take with the field named.
``handle_request`` (the blocking path) runs the prefix, then the sampler, and answers with one output
whose ``output_trajectory`` is ``chunk_size`` actions of ``max_action_dim`` values each.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Iterator

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.outputs import RequestOutput
from ifb.params import InvalidRequest, RequestSpec, Trajectory
from ifb.request import Request
from ifb.runtime import Prepared
from ifb_plugins.action.pi0 import Pi0
from ifb_plugins.action.processor import Pi0Processing
from ifb_plugins.common.media.parts import MAX_MEDIA_ITEMS, parse_messages
from ifb_plugins.common.chat.tokenizer import TextTokenizer

#: pi0 conditions on the current state only: a trajectory of more points is refused, not cut
MAX_POINTS = 1


@attrs.frozen(eq=False)
class PlanInput:
    """What ``prepare`` made of a request for the sampler."""

    input_ids: torch.Tensor  # [L] with image placeholders
    pixel_values: torch.Tensor | None  # [cameras, 3, S, S]
    state: torch.Tensor  # [max_state_dim], normalized and padded
    noise: torch.Tensor  # [chunk_size, max_action_dim]: the actions at time 1


def initial_noise(seed: int | None, chunk_size: int, action_dim: int) -> torch.Tensor:
    """The sampler's starting point; with a seed exactly ``torch.randn((chunk_size, action_dim),
    generator=torch.Generator().manual_seed(seed), dtype=torch.float32)``, so a client can reproduce it."""
    generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    return torch.randn((chunk_size, action_dim), generator=generator, dtype=torch.float32)


class ActionRuntime:
    """pi0 on the blocking path (``handle_request``, one request at a time)."""

    kv_block_size = 16

    def __init__(self, *, model: Pi0, processing: Pi0Processing, tokenizer: TextTokenizer, caps: DeploymentCaps,
                 config: DeployConfig, model_name: str, max_model_len: int = 4096):
        self.model = model
        self.processing = processing
        self.tokenizer = tokenizer
        self.caps = caps
        self.model_name = model_name
        self.max_model_len = max_model_len
        # the prefix is computed whole, in memory of its own: these only bound the prompt for the engine
        self.num_kv_blocks = max_model_len // self.kv_block_size + 1
        allowed = config.options.get("allowed_local_media_path")
        self.allowed_media_dir = Path(allowed) if allowed else None
        cfg = model.cfg
        self.image_token = self._token(cfg.image_token_id, "the image placeholder")
        if tokenizer.bos_token_id is None:
            raise ValueError("the tokenizer names no bos_token, which pi0's prompt needs")
        self.bos_token = self._token(tokenizer.bos_token_id, "the bos token")

    def _token(self, token_id: int, what: str) -> str:
        token = self.tokenizer.tokenizer.id_to_token(token_id)
        if token is None:
            raise ValueError(f"the tokenizer has no token {token_id} ({what})")
        return token

    # ---- admission ----

    def check_trajectory(self, trajectory: Trajectory | None) -> Trajectory:
        """The request's trajectory if pi0 can plan from it; InvalidRequest naming the field if not."""
        cfg = self.model.cfg
        if trajectory is None:
            raise InvalidRequest("pi0 plans from the robot state: send it as a content part "
                                 '{"type": "trajectory", "trajectory": [[...]]} (one point, the current state)',
                                 param="messages")
        field = trajectory.field
        if trajectory.num_points > MAX_POINTS:
            raise InvalidRequest(f"{field} has {trajectory.num_points} points; pi0 plans from the current state "
                                 f"only: send at most {MAX_POINTS} (the current state)", param=field)
        want = self.processing.state_dim
        if want is not None and trajectory.dim != want:
            raise InvalidRequest(f"{field} has points of {trajectory.dim} values; this model's state has {want} "
                                 "(the length of its processor's state statistics)", param=field)
        limit = min(cfg.max_state_dim, self.processing.max_state_dim)
        if trajectory.dim > limit:
            raise InvalidRequest(f"{field} has points of {trajectory.dim} values; this model takes at most {limit}",
                                 param=field)
        return trajectory

    def prepare(self, spec: RequestSpec) -> Prepared:
        trajectory = self.check_trajectory(spec.past_trajectory)
        if spec.messages is None:
            raise InvalidRequest("pi0 takes a chat request: one user message with the camera images and the task",
                                 param="messages")
        if len(spec.messages) != 1 or spec.messages[0].get("role") != "user":
            raise InvalidRequest(f"pi0 takes exactly one user message (its images are the cameras, its text the "
                                 f"task); got {len(spec.messages)} message(s)", param="messages")
        parsed = parse_messages(spec.messages, modalities={"image"}, sampling_rate=16000,
                                allowed_dir=self.allowed_media_dir,
                                allow_hint="start the server with --allowed-local-media-path DIR")
        content = parsed.messages[0]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or ())
        task = "\n".join(p["text"] for p in parts if p["type"] == "text")
        images = [item.data for item in parsed.media]
        if len(images) > MAX_MEDIA_ITEMS:
            raise InvalidRequest(f"at most {MAX_MEDIA_ITEMS} camera images per request", param="messages")
        prompt = self.processing.prompt(task, len(images), self.image_token, self.bos_token)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len}",
                                 param="messages")
        dtype = next(self.model.parameters()).dtype
        pixels = torch.stack([self.processing.image(image) for image in images]).to(dtype) if images else None
        cfg = self.model.cfg
        plan = PlanInput(
            input_ids=torch.tensor(ids, dtype=torch.long),
            pixel_values=pixels,
            state=self.processing.state(trajectory.points[-1]).to(dtype),
            noise=initial_noise(trajectory.noise_seed, cfg.chunk_size, cfg.max_action_dim),
        )
        # planned whole, by handle_request: its prepared state is the model's input
        return Prepared(prompt_token_ids=tuple(ids), state=plan, is_served_whole=True)

    # ---- the blocking path ----

    @torch.no_grad()
    def plan(self, plans: list[PlanInput]) -> torch.Tensor:
        """The planned actions ``[B, chunk_size, max_action_dim]`` float32 of several requests, as one batch."""
        prefix = [self.model.embed_prefix(p.input_ids, p.pixel_values) for p in plans]
        kv, lens = self.model.prefix_kv(prefix)
        state = torch.stack([p.state for p in plans])
        noise = torch.stack([p.noise for p in plans]).to(state.dtype)
        return self.model.sample(state, noise, kv, lens).float()

    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[RequestOutput]:
        if request.handle.cancelled.is_set():
            yield RequestOutput(request_id=request.request_id, text="", token_ids=(), finished=True,
                                finish_reason="cancelled")
            return
        actions = self.plan([request.state])[0]
        yield RequestOutput(
            request_id=request.request_id, text="", token_ids=(), finished=True, finish_reason="stop",
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=0,
            output_trajectory=tuple(tuple(row) for row in actions.tolist()))

    # ---- in-flight batching ----
    # The deployment starts under --enable-in-flight-batching (its declaration passes the gate), but
    # the engine rejects every trajectory at submit and ``prepare`` refuses a request without one, so
    # no pi0 request is ever seated there: a step can only be a fault.

    def execute(self, step):
        raise RuntimeError("pi0 requests are served on the blocking path only: none can be seated in a batch")

    def release(self, request_id: str, seat: int) -> None:
        pass
