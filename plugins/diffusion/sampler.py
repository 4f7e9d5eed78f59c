"""The block-diffusion sampler of transformers' ``generation_diffusion_gemma``, one request at a time.

A request generates blocks of ``canvas_length`` tokens, one after another.
Each block starts as a canvas of uniformly random tokens and is denoised over
at most ``max_denoising_steps`` steps, counted down from N to 1. At step n:

1. the logits are divided by the schedule's temperature ``t_min + (t_max - t_min) * n / N``;
2. a token is drawn per position from their softmax (the *denoiser canvas*) and the argmax kept;
3. *entropy-bound acceptance*: positions sorted by entropy, the k lowest accepted while the sum of
   their entropies less the largest stays within ``entropy_bound``; accepted positions take the drawn
   token, the others are *renoised* (a fresh uniform token);
4. *stopping*: the block is done when the argmax has not changed for ``stability_threshold`` steps
   and the mean entropy is below ``confidence_threshold`` (or after step 1);
5. the step's probabilities self-condition the next step.

The block's tokens are the last argmax. Its KV then joins the request's cache
(the encoder runs over it with the next block's first step).

Random numbers come from the request's own generator, drawn as the reference
draws them from torch's global one (``randint`` for a canvas, ``multinomial``
then ``randint`` per step), so a request seeded with ``s`` reproduces
``torch.manual_seed(s); model.generate(...)`` whoever shares its forwards.
A request temperature scales the schedule; 0 is its limit: one-hot
probabilities at the argmax, zero entropy.
"""

from __future__ import annotations

import attrs
import torch

from ifb_plugins.diffusion.config import SamplerSettings


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's entropy, as ``torch.distributions.Categorical(logits=...)`` computes it: ``[L, V]`` -> ``[L]``."""
    return torch.distributions.Categorical(logits=logits).entropy()


def accepted_positions(token_entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Entropy-bound acceptance: ``[L]`` bool, the lowest-entropy positions whose sum less the max is within ``bound``."""
    sorted_entropy, order = torch.sort(token_entropy, dim=-1, descending=False)
    selected = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= bound
    return torch.scatter(torch.zeros_like(selected), -1, order, selected)


@attrs.define(eq=False)
class BlockState:
    """One block being denoised."""

    canvas: torch.Tensor  # [L] the current (partly renoised) canvas
    argmax: torch.Tensor  # [L] the latest prediction
    #: the previous step's probabilities [L, V] (None before the first step)
    self_conditioning: torch.Tensor | None = None
    #: the argmax of the last ``stability_threshold`` steps [S, L] (-1 before there were any)
    history: torch.Tensor | None = None
    #: the step the next forward runs (N first, 1 last)
    step: int = 0
    num_steps: int = 0


@attrs.define(eq=False)
class BlockSampler:
    """Denoises one request's blocks with its own random numbers."""

    settings: SamplerSettings
    vocab_size: int
    canvas_length: int
    generator: torch.Generator
    #: scales the schedule's temperatures; 0: the schedule's limit at 0 (argmax, zero entropy)
    temperature: float = 1.0

    def new_block(self) -> BlockState:
        """A canvas of uniform random tokens."""
        canvas = self._uniform()
        history = None
        if self.settings.stability_threshold:
            history = torch.full((self.settings.stability_threshold, self.canvas_length), -1, dtype=torch.long)
        return BlockState(canvas=canvas, argmax=canvas, history=history, step=self.settings.max_denoising_steps)

    def _uniform(self) -> torch.Tensor:
        # the reference's shape (batch 1, L): the same draws in the same order
        return torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=self.generator)[0]

    def advance(self, block: BlockState, logits: torch.Tensor) -> bool:
        """Apply one denoising step's ``logits [L, V]`` to ``block``; True when the block is done."""
        if self.temperature == 0.0:
            argmax = torch.argmax(logits, dim=-1)  # [L]
            probs = torch.nn.functional.one_hot(argmax, self.vocab_size).float()  # [L, V]
            token_entropy = torch.zeros(self.canvas_length)
        else:
            processed = logits / (self.temperature * self.settings.temperature(block.step))
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            argmax = torch.argmax(processed, dim=-1)
            token_entropy = entropy(processed)
        drawn = torch.multinomial(probs, num_samples=1, generator=self.generator)[:, 0]  # [L]
        accepted = accepted_positions(token_entropy, self.settings.entropy_bound)
        kept = torch.where(accepted, drawn, block.canvas)
        block.canvas = torch.where(~accepted, self._uniform(), kept)
        block.argmax = argmax
        block.self_conditioning = probs
        done = self._stable(block) & bool(token_entropy.mean() < self.settings.confidence_threshold)
        block.step -= 1
        block.num_steps += 1
        return done or block.step == 0

    def _stable(self, block: BlockState) -> bool:
        if block.history is None:
            return True
        stable = bool((block.history == block.argmax[None, :]).all())
        block.history = torch.roll(block.history, shifts=-1, dims=0)
        block.history[-1] = block.argmax
        return stable
