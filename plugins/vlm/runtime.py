"""The multimodal runtime: the text runtime plus media encoders that run at admission.

``prepare`` parses content parts, decodes and encodes the media (so the step
loop never runs an encoder) and expands each ``<image>`` / ``<audio>``
placeholder into one token per media embedding. ``step_embeddings`` splices
those embeddings over the placeholder rows of whatever prefill chunk a step
carries, so a media request joins a running batch like any other.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

from pathlib import Path

import attrs
import torch

from ifb.blocking import drive_alone
from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.params import InvalidRequest, RequestSpec
from ifb.request import Request
from ifb.runtime import Prepared, ScheduledStep
from ifb_plugins.common.lora import LoraSet
from ifb_plugins.common.runtime import TextRuntime
from ifb_plugins.vlm.encoders import MediaModel
from ifb_plugins.vlm.loader import LoadedVlm
from ifb_plugins.vlm.media import MediaItem, parse_messages
from ifb_plugins.vlm.mel import log_mel_spectrogram

#: ``Prepared.extras`` keys: ``[(first prompt index, embeddings [N, H])]`` in prompt order, the KV salt
#: (a digest of the media bytes, for the context cache) and a marker that the request carries media.
MEDIA_EMBEDS, KV_SALT, MEDIA = "media_embeds", "kv_salt", "media"


class VlmRuntime(TextRuntime):
    def __init__(self, *, loaded: LoadedVlm, caps: DeploymentCaps, config: DeployConfig, model_name: str,
                 pruner_ratio: float | None = None, lora: LoraSet | None = None):
        super().__init__(model=loaded.text_model, tokenizer=loaded.tokenizer, caps=caps, config=config,
                         model_name=model_name, lora=lora)
        self.vlm_config = loaded.config
        self.media_model: MediaModel = loaded.media_model
        self.placeholders = dict(loaded.placeholders)
        self.placeholder_ids = {kind: tid for kind, tid in (("image", loaded.config.image_token_id),
                                                            ("audio", loaded.config.audio_token_id)) if tid is not None}
        self.pruner_ratio = pruner_ratio
        allowed = config.options.get("allowed_local_media_path")
        self.allowed_media_dir = Path(allowed) if allowed else None

    # ---- admission ----
    def prepare(self, spec: RequestSpec) -> Prepared:
        media: tuple[MediaItem, ...] = ()
        if spec.messages is not None:
            pre = self.vlm_config.preprocess
            vision = self.vlm_config.vision
            parsed = parse_messages(
                spec.messages, placeholders=self.placeholders, image_size=vision.image_size if vision else None,
                image_mean=pre.image_mean, image_std=pre.image_std, sampling_rate=pre.sampling_rate,
                allowed_dir=self.allowed_media_dir)
            media = parsed.media
            spec = attrs.evolve(spec, messages=parsed.messages)
        prepared = super().prepare(spec)
        ids = list(prepared.prompt_token_ids)
        kinds = {tid: kind for kind, tid in self.placeholder_ids.items()}
        found = [(i, kinds[t]) for i, t in enumerate(ids) if t in kinds]
        if [kind for _, kind in found] != [m.kind for m in media]:
            raise InvalidRequest(self._mismatch(found, media))
        if not media:
            return prepared
        expanded: list[int] = []
        spans: list[tuple[int, torch.Tensor]] = []
        salt = hashlib.blake2b(digest_size=16)
        at = 0
        for (index, kind), item in zip(found, media, strict=True):
            expanded += ids[at:index]
            embeds = self.encode(item)
            spans.append((len(expanded), embeds))
            expanded += [ids[index]] * embeds.shape[0]
            at = index + 1
            salt.update(kind.encode() + item.digest)
        expanded += ids[at:]
        extras = {**prepared.extras, MEDIA_EMBEDS: spans, KV_SALT: salt.hexdigest(), MEDIA: True}
        return Prepared(tuple(expanded), extras)

    def _mismatch(self, found: list[tuple[int, str]], media: tuple[MediaItem, ...]) -> str:
        if not media:
            kind = found[0][1]
            return (f"the prompt contains the {kind} placeholder {self.placeholders[kind]!r} but no {kind}: "
                    f"send media as content parts")
        return (f"the prompt has {len(found)} media placeholders for {len(media)} media parts: "
                f"remove {', '.join(map(repr, self.placeholders.values()))} from the message text")

    def encode(self, item: MediaItem) -> torch.Tensor:
        """Embeddings ``[N, H]`` of one media item, in the text model's embedding space and dtype."""
        device = self.device
        if item.kind == "image":
            embeds = self.media_model.encode_image(item.data.to(device), self.pruner_ratio)
        else:
            pre, audio = self.vlm_config.preprocess, self.vlm_config.audio
            mel = log_mel_spectrogram(item.data.to(device), audio.num_mel_bins, pre.n_fft, pre.hop_length,
                                      pre.sampling_rate)
            embeds = self.media_model.encode_audio(mel)
        return embeds.to(self.model.model.embed_tokens.weight.dtype)

    # ---- stepped execution ----
    def step_embeddings(self, step: ScheduledStep, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with each chunk's media placeholder rows replaced by their media embeddings.

        A prefill chunk covers prompt positions ``start_pos .. start_pos + n``;
        it may hold only part of a media span, so each span is clipped to it.
        """
        patches: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for seq in step.seqs:
            n = len(seq.token_ids)
            for start, embeds in seq.extras.get(MEDIA_EMBEDS, ()):
                lo, hi = max(start, seq.start_pos), min(start + embeds.shape[0], seq.start_pos + n)
                if lo < hi:
                    patches.append((offset + lo - seq.start_pos, embeds[lo - start:hi - start]))
            offset += n
        if not patches:
            return None  # text only: the model embeds the ids itself
        embeds = self.model.model.embed_tokens(input_ids)  # [T, H]
        for row, rows in patches:
            embeds[row:row + rows.shape[0]] = rows
        return embeds

    # ---- blocking path ----
    def handle_request(self, spec: RequestSpec, request: Request) -> Iterator[Any]:
        if request.extras.get(MEDIA) and spec.extras.get("save_system_prompt_kv_cache"):
            # A captured prefix is matched by token ids alone; one holding media placeholders
            # would hand this image's KV to a later request with another image. Serve it uncaptured.
            with self.lora.active(spec.extras.get("lora")):
                yield from drive_alone(self, request, blocks=self._blocking_blocks, prefix=self.system_prompts)
            return
        yield from super().handle_request(spec, request)
