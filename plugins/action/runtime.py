"""The pi0 runtime: a chat request with camera images, a task and the robot state in; a plan out.

``prepare`` (any thread) reads the request as ``PI0Processor`` would: one user message whose image
parts are the cameras (in order) and whose text parts are the task, and the request's trajectory
(one point: pi0 plans from the current state). It refuses what pi0 cannot take with the field named.
``execute`` (``SteppedPlanner``) serves both paths step by step: on the blocking path one request is
seated, under in-flight batching up to ``max_batch_size``. The final output's ``output_trajectory`` is
``chunk_size`` actions of ``max_action_dim`` values each.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Sequence

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.outputs import RequestOutput
from ifb.params import InvalidRequest, RequestSpec, Trajectory
from ifb.request import Request
from ifb.runtime import Prepared, ScheduledStep, StepOutput
from ifb_plugins.action.pi0 import Pi0
from ifb_plugins.action.processor import Pi0Processing
from ifb_plugins.action.stepped import SteppedPlanner
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
    """pi0 under the engine: each step prefills the prefixes it completes and runs one Euler step of every
    seated request, all batched (``SteppedPlanner``)."""

    kv_block_size = 16

    def __init__(self, *, model: Pi0, processing: Pi0Processing, tokenizer: TextTokenizer, caps: DeploymentCaps,
                 config: DeployConfig, model_name: str, max_model_len: int = 4096):
        self.model = model
        self.processing = processing
        self.tokenizer = tokenizer
        self.caps = caps
        self.model_name = model_name
        self.max_model_len = max_model_len
        # room for every seat's longest prefix: a request is never preempted for blocks (it could be: its
        # plan would start over from its noise, the same plan)
        num_seats = max(1, config.max_batch_size) if config.enable_in_flight_batching else 1
        self.num_kv_blocks = -(-max_model_len // self.kv_block_size) * num_seats
        allowed = config.options.get("allowed_local_media_path")
        self.allowed_media_dir = Path(allowed) if allowed else None
        cfg = model.cfg
        self.image_token = self._token(cfg.image_token_id, "the image placeholder")
        if tokenizer.bos_token_id is None:
            raise ValueError("the tokenizer names no bos_token, which pi0's prompt needs")
        self.bos_token = self._token(tokenizer.bos_token_id, "the bos token")
        if not tokenizer.eos_token_ids:
            raise ValueError("the tokenizer names no eos_token, which ends a planned request")
        self.planner = SteppedPlanner(model, num_blocks=self.num_kv_blocks, block_size=self.kv_block_size,
                                      end_token_id=tokenizer.eos_token_ids[0])

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
        if spec.params.ignore_eos:
            raise InvalidRequest("ignore_eos does not apply to pi0: a request ends when its plan is done",
                                 param="ignore_eos")
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
        return Prepared(prompt_token_ids=tuple(ids), state=plan)

    # ---- the engine's steps (both paths) ----

    def execute(self, step: ScheduledStep) -> StepOutput:
        return self.planner.execute(step)

    def release(self, request_id: str, seat: int) -> None:
        self.planner.release(request_id)

    def finish_output(self, request: Request, output: RequestOutput) -> Sequence[RequestOutput]:
        """The final output with the plan: no text and no output tokens (the end token only ended the steps)."""
        actions = self.planner.take_plan(request.request_id)
        if actions is None:
            raise RuntimeError("the request finished before its plan was done")
        return [attrs.evolve(output, text="", token_ids=(), logprobs=(), num_output_tokens=0,
                             output_trajectory=tuple(tuple(row) for row in actions.tolist()))]
