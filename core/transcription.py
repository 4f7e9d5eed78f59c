"""What a transcription request asks for, and how a model's transcript is read back.

``/v1/audio/transcriptions`` (and ``/translations``) ask any audio model in
words: a chat whose system message is the request's ``prompt`` and whose user
message holds the clip and an instruction. They also set
``RequestSpec.transcription``, for a model trained on its own transcription
prompt (Qwen3-ASR: the forced language prefilled in the assistant turn), and
read the output through the runtime's optional ``read_transcript`` (the
header such a model writes before the text, e.g. the language it heard).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Transcription:
    """A request to write down (``translate``: in English) what is said in its one audio clip.

    ``language``: the language spoken, as the client named it (an ISO-639-1 code or a name), or None
    (the model detects it); ``prompt``: text to condition on (context, spellings, the previous segment).
    """

    language: str | None = None
    prompt: str | None = None
    translate: bool = False


@attrs.frozen
class Transcript:
    """A model's output read as a transcript: the text, and the language the model says it heard."""

    text: str
    language: str | None = None
