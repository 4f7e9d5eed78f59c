"""The types a vlm model family implements; ``families`` documents the interface and lists the families."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Protocol

import attrs
import torch

from ifb.transcription import Transcript, Transcription
from ifb_plugins.common.models.decoder import TextModel
from ifb_plugins.common.chat.tokenizer import TextTokenizer
from ifb_plugins.common.media.parts import MediaItem


@attrs.frozen
class EncodedMedia:
    """One media item as the prompt sees it: the ids replacing its placeholder and the rows to scatter."""

    token_ids: tuple[int, ...]
    embed_token_id: int
    embeds: torch.Tensor = attrs.field(eq=False, repr=False)  # [N, H], N == token_ids.count(embed_token_id)
    importance: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)  # [N]
    position_ids: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)  # [3, len(token_ids)]

    def __attrs_post_init__(self) -> None:
        n = sum(1 for t in self.token_ids if t == self.embed_token_id)
        if n != self.embeds.shape[0]:
            raise ValueError(f"{n} media tokens for {self.embeds.shape[0]} embeddings")


class MediaEncoder(Protocol):
    """Preprocesses and encodes one media item of one modality (see the module docstring)."""

    #: the token the chat template renders once per media item
    placeholder_id: int

    def encode(self, item: MediaItem) -> EncodedMedia: ...


class TranscriptionFormat(Protocol):
    """A model trained on its own transcription prompt: what follows the generation prompt, and how its
    output reads as a transcript (``ifb.runtime.Runtime.read_transcript``)."""

    def prompt_suffix(self, task: Transcription) -> str:
        """The assistant turn's prefill for ``task``; InvalidRequest for a task the model cannot do."""

    def read(self, text: str, is_final: bool) -> Transcript: ...


@attrs.frozen
class LoadedVlm:
    """What a family's loader returns: the decoder, the tokenizer and an encoder per modality."""

    family: str
    text_model: TextModel = attrs.field(eq=False, repr=False)
    tokenizer: TextTokenizer = attrs.field(eq=False, repr=False)
    encoders: Mapping[str, MediaEncoder] = attrs.field(eq=False, repr=False)  # "image" / "audio" -> encoder
    #: None: a transcription is the chat the route sends (an instruction in words)
    transcription: TranscriptionFormat | None = attrs.field(default=None, eq=False, repr=False)
    #: the decoder's first-layer rows for token ids, which media rows replace (None: its token embedding)
    embed: Callable[[torch.Tensor], torch.Tensor] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class Family:
    name: str
    architectures: tuple[str, ...]
    load: Callable[[Path, torch.device], LoadedVlm] = attrs.field(eq=False, repr=False)
    #: ``model_type`` values that pick this family when ``config.json`` lists no architectures
    model_types: tuple[str, ...] = ()
