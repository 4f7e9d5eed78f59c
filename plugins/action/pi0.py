"""pi0 (``PI0ForConditionalGeneration``): the PaliGemma backbone over the prefix, the action expert and
the flow-matching Euler sampler, computed as transformers' ``sample_actions`` computes them.

The prefix (camera images, then ``<bos>`` task ``\\n``) runs once, fully bidirectional, at positions
0..L-1; its per-layer KV is kept. Each of the ``num_inference_steps`` Euler steps runs the expert over
``1 + chunk_size`` tokens (the state, then the noisy actions with the step's time) at positions L..;
they attend to the prefix's KV and to each other, except that the state does not see the actions.
The actions move by ``dt * velocity`` (``dt = -1 / steps``, time from 1 down to ``1 / steps``).

Several requests run as one padded batch (each its own prefix KV, state and noise); alone is a
batch of one. Shape letters: B requests, L prefix tokens, C chunk size, A action size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ifb_plugins.action.config import Pi0Config
from ifb_plugins.action.gemma import KV, GemmaStack
from ifb_plugins.common.media.vision import VisionTower


class Pi0(nn.Module):
    """Parameter names are the transformers module's with ``model.vlm.`` / ``model.dit.`` /
    ``embed_action_time.`` dropped (``checkpoint.canonical_name`` maps a checkpoint's onto them)."""

    def __init__(self, cfg: Pi0Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg.vision)
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = nn.Linear(cfg.vision.hidden_size, cfg.text.hidden_size)
        self.language_model = GemmaStack(cfg.text, has_embedding=True)
        self.dit = GemmaStack(cfg.expert, has_embedding=False)
        h = cfg.expert.hidden_size
        self.state_proj = nn.Linear(cfg.max_state_dim, h)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, h)
        self.action_time_mlp_in = nn.Linear(2 * h, h)
        self.action_time_mlp_out = nn.Linear(h, h)
        self.action_out_proj = nn.Linear(h, cfg.max_action_dim)
        # the time embedding's frequencies, as PI0TimestepEmbeddings.compute_freqs writes them
        fraction = torch.linspace(0.0, 1.0, h // 2, dtype=torch.float32)
        period = cfg.min_period * (cfg.max_period / cfg.min_period) ** fraction
        self.register_buffer("sinusoid_freq", 1.0 / period * 2 * math.pi, persistent=False)

    # -- the prefix --------------------------------------------------------------------------

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, S, S]`` camera images -> ``[N, tokens per image, H]`` (tower, post norm, projector)."""
        states, _ = self.vision_tower.hidden_states(pixel_values, self.cfg.vision.num_layers)
        return self.multi_modal_projector.linear(self.vision_tower.post_layernorm(states[-1]))

    def embed_prefix(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
        """``input_ids [L]`` with image placeholders -> ``[L, H]``, the images' features spliced in, in order."""
        return self.embed_prefixes([(input_ids, pixel_values)])[0]

    def embed_prefixes(self, prefixes: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        """``embed_prefix`` of several requests, every camera image through the vision tower in one batch."""
        images = [pixels for _, pixels in prefixes if pixels is not None and len(pixels)]
        features = self.image_features(torch.cat(images)) if images else None
        out, first = [], 0
        for input_ids, pixels in prefixes:
            is_image = input_ids == self.cfg.image_token_id
            embeds = self.language_model.embed(input_ids.masked_fill(is_image, 0))
            num_images = 0 if pixels is None else len(pixels)
            own = features[first:first + num_images].flatten(0, 1).to(embeds.dtype) if num_images else \
                embeds.new_zeros((0, embeds.shape[1]))
            first += num_images
            if int(is_image.sum()) != own.shape[0]:
                raise ValueError(f"{int(is_image.sum())} image placeholders for {own.shape[0]} image features")
            out.append(embeds.masked_scatter(is_image[:, None], own) if num_images else embeds)
        return out

    def prefix_kv(self, embeds: list[torch.Tensor]) -> tuple[list[KV], torch.Tensor]:
        """Run the backbone over each request's prefix ``[L_b, H]`` (bidirectional, positions 0..L_b-1).

        Returns each layer's K/V ``[B, max L, Hkv, D]`` (a shorter prefix padded at the end) and the lengths ``[B]``.
        """
        lens = torch.tensor([e.shape[0] for e in embeds], device=embeds[0].device)
        width = int(lens.max())
        x = torch.stack([nn.functional.pad(e, (0, 0, 0, width - e.shape[0])) for e in embeds])
        cols = torch.arange(width, device=x.device)
        mask = (cols[None, :] < lens[:, None])[:, None, :].expand(-1, width, -1)  # [B, L, L]: real keys only
        positions = cols[None, :].expand(len(embeds), -1)
        _, kvs = self.language_model(x, positions, mask)
        return kvs, lens

    # -- the action expert -------------------------------------------------------------------

    def embed_suffix(self, state: torch.Tensor, actions: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """``state [B, max_state_dim]``, ``actions [B, C, A]``, ``time [B]`` -> ``[B, 1 + C, H]``."""
        action_embeds = self.action_in_proj(actions)
        emb = self.sinusoid_freq[None, :] * time.float()[:, None]
        time_embeds = torch.cat([emb.sin(), emb.cos()], dim=1)[:, None, :].expand_as(action_embeds)
        merged = torch.cat([action_embeds, time_embeds.to(action_embeds.dtype)], dim=2)
        merged = self.action_time_mlp_out(nn.functional.silu(self.action_time_mlp_in(merged)))
        return torch.cat([self.state_proj(state)[:, None, :], merged], dim=1)

    def suffix_mask(self, lens: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, 1 + C, width + 1 + C]``: the prefix's real keys for every query; the suffix's keys for the
        actions, and only itself for the state (it must not see the noisy actions)."""
        n = 1 + self.cfg.chunk_size
        prefix = torch.arange(width, device=lens.device)[None, None, :] < lens[:, None, None]
        rows = torch.arange(n, device=lens.device)
        suffix = (rows[:, None] >= 1) | (rows[None, :] == 0)
        return torch.cat([prefix.expand(-1, n, -1), suffix[None].expand(len(lens), -1, -1)], dim=2)

    def velocity(self, state: torch.Tensor, actions: torch.Tensor, time: torch.Tensor, prefix: list[KV],
                 lens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The expert's predicted velocity ``[B, C, A]`` for ``actions`` at ``time``."""
        x = self.embed_suffix(state, actions, time)
        positions = lens[:, None] + torch.arange(x.shape[1], device=x.device)[None, :]
        hidden, _ = self.dit(x, positions, mask, past=prefix)
        return self.action_out_proj(hidden[:, -self.cfg.chunk_size:])

    @torch.no_grad()
    def sample(self, state: torch.Tensor, noise: torch.Tensor, prefix: list[KV], lens: torch.Tensor,
               num_steps: int | None = None) -> torch.Tensor:
        """The flow-matching Euler sampler: ``noise [B, C, A]`` at time 1 -> the planned actions ``[B, C, A]``."""
        num_steps = num_steps or self.cfg.num_inference_steps
        mask = self.suffix_mask(lens, prefix[0][0].shape[1])
        dt = -1.0 / num_steps
        actions = noise
        for step in range(num_steps):
            time = torch.full((state.shape[0],), 1.0 + step * dt, dtype=torch.float32, device=state.device)
            actions = actions + dt * self.velocity(state, actions, time, prefix, lens, mask)
        return actions
