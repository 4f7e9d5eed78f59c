"""The multimodal runtime: the text runtime plus media encoders that run at admission.

``prepare`` decodes the media parts, renders the chat with the checkpoint's
template (one placeholder token per media item), and asks the family's encoder
for each item's tokens and embeddings (``families``), so the step loop never
runs an encoder. ``step_embeddings`` scatters those embeddings over their rows
in whatever prefill chunk a step carries, so a media request joins a running
batch like any other.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from ifb.capabilities import DeployConfig, DeploymentCaps
from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Prepared, ScheduledStep, Seat
from ifb.transcription import Transcript
from ifb_plugins.common.runtime.lora import LoraSet
from ifb_plugins.common.runtime.syscache import common_prefix_length, system_messages
from ifb_plugins.common.runtime.text import TextRuntime
from ifb_plugins.vlm.interface import EncodedMedia, LoadedVlm
from ifb_plugins.common.media.parts import MediaItem, parse_messages
from ifb_plugins.common.media.prompt import MediaSpan, expand_media, media_step_positions, splice_embeddings
from ifb_plugins.vlm.pruning import prune

#: audio arrives resampled to this rate unless an encoder asks for another
DEFAULT_SAMPLING_RATE = 16000


class VlmRuntime(TextRuntime):
    def __init__(self, *, loaded: LoadedVlm, caps: DeploymentCaps, config: DeployConfig, model_name: str,
                 pruner_ratio: float | None = None, lora: LoraSet | None = None):
        super().__init__(model=loaded.text_model, tokenizer=loaded.tokenizer, caps=caps, config=config,
                         model_name=model_name, lora=lora)
        self.loaded = loaded
        self.embed = loaded.embed or self.model.model.embed_tokens
        self.encoders = dict(loaded.encoders)
        self.placeholder_kinds = {enc.placeholder_id: kind for kind, enc in self.encoders.items()}
        audio = self.encoders.get("audio")
        self.sampling_rate = int(getattr(audio, "sampling_rate", DEFAULT_SAMPLING_RATE))
        self.pruner_ratio = pruner_ratio
        allowed = config.options.get("allowed_local_media_path")
        self.allowed_media_dir = Path(allowed) if allowed else None

    # ---- admission ----
    def prepare(self, spec: RequestSpec) -> Prepared:
        media: tuple[MediaItem, ...] = ()
        if spec.messages is not None:
            parsed = parse_messages(spec.messages, modalities=set(self.encoders), sampling_rate=self.sampling_rate,
                                    allowed_dir=self.allowed_media_dir,
                                    allow_hint="start the server with --allowed-local-media-path DIR")
            media = parsed.media
            text = self._render(list(parsed.messages), spec.chat_template_kwargs)
            if spec.transcription is not None and self.loaded.transcription is not None:
                text += self.loaded.transcription.prompt_suffix(spec.transcription)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            pinned = self._system_prefix_length(parsed.messages, spec, ids)
            spec = attrs.evolve(spec, messages=None, prompt=None, prompt_token_ids=tuple(ids))
            prepared = attrs.evolve(super().prepare(spec), num_pinned_tokens=pinned)
        else:
            prepared = super().prepare(spec)
        ids = list(prepared.prompt_token_ids)
        found = [(i, self.placeholder_kinds[t]) for i, t in enumerate(ids) if t in self.placeholder_kinds]
        if [kind for _, kind in found] != [m.kind for m in media]:
            raise InvalidRequest(self._mismatch(found, media))
        if not media:
            return prepared
        return expand_media(prepared, found, media, self._span, max_model_len=self.max_model_len,
                            device=self.device, dtype=self.model.model.embed_tokens.weight.dtype)

    def read_transcript(self, text: str, is_final: bool) -> Transcript:
        """A transcription's output as its family reads it (the text itself for most)."""
        transcription = self.loaded.transcription
        return transcription.read(text, is_final) if transcription is not None else Transcript(text)

    def _span(self, item: MediaItem) -> MediaSpan:
        encoded = self.encode(item)
        rows = [j for j, t in enumerate(encoded.token_ids) if t == encoded.embed_token_id]
        return MediaSpan(encoded.token_ids, torch.tensor(rows, dtype=torch.long), encoded.embeds,
                         encoded.position_ids)

    def _system_prefix_length(self, messages, spec: RequestSpec, ids: list[int]) -> int:
        """A capture's prompt tokens (``save_system_prompt_kv_cache``): the system messages rendered alone
        with the checkpoint's template, as far as they agree with the whole prompt (0 without a capture)."""
        system = system_messages(messages)
        if not spec.extras.get("save_system_prompt_kv_cache") or not system:
            return 0
        rendered = self._render(system, spec.chat_template_kwargs, add_generation_prompt=False)
        return common_prefix_length(self.tokenizer.encode(rendered, add_special_tokens=False), ids)

    def _render(self, messages: list[dict], template_kwargs: dict | None = None, *,
                add_generation_prompt: bool = True) -> str:
        template = self.tokenizer.chat_template or ""
        if any(t in template for t in ("'type'", '"type"', ".type")):
            # A template written for content parts renders a string content as nothing at all (llava-1.5's
            # filters the parts by type): a string is one text part, as OpenAI's API defines it.
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m.get("content"), str) else m for m in messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      **(template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - the template's own error is the message
            raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc

    def _mismatch(self, found: list[tuple[int, str]], media: tuple[MediaItem, ...]) -> str:
        if not media:
            kind = found[0][1]
            token = self.tokenizer.id_to_token(self.encoders[kind].placeholder_id)
            return (f"the prompt contains the {kind} placeholder {token!r} but no {kind}: "
                    f"send media as content parts")
        tokens = ", ".join(repr(self.tokenizer.id_to_token(e.placeholder_id)) for e in self.encoders.values())
        return (f"the prompt has {len(found)} media placeholders for {len(media)} media parts: "
                f"remove {tokens} from the message text")

    def encode(self, item: MediaItem) -> EncodedMedia:
        """One media item through its family's encoder (and the pruner, for images)."""
        encoded = self.encoders[item.kind].encode(item)
        if item.kind == "image" and self.pruner_ratio is not None:
            encoded = prune(encoded, self.pruner_ratio)
        return encoded

    # ---- stepped execution ----
    def step_positions(self, step: ScheduledStep, seats: list[Seat]) -> torch.Tensor:
        """M-RoPE decoders take ``[3, T]`` ids, each sequence's from its own prompt (text alone: its index)."""
        if getattr(self.model.config, "mrope_section", None) is None:  # Gemma 4's config has no M-RoPE field
            return super().step_positions(step, seats)
        return media_step_positions(step, seats).to(self.device)

    def step_embeddings(self, step: ScheduledStep, seats: list[Seat], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with each chunk's media rows replaced by their media embeddings.

        A prefill chunk covers prompt positions ``start_pos .. start_pos + n``;
        it may hold only part of a media item's rows, so each is clipped to it.
        """
        return splice_embeddings(step, seats, input_ids, self.embed)
