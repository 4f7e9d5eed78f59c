"""The speech plugin's request option: speech output (``generate_audio``).

Light on purpose (no torch): ``ifb matrix`` imports it.
"""

from __future__ import annotations

from ifb import hookimpl
from ifb.capabilities import OptionSupport, RequestOption, Support
from ifb.options import BLOCKING

#: a request that asks for audio (``modalities: ["audio"]`` on chat, ``/v1/audio/speech``)
GENERATE_AUDIO = RequestOption(
    name="generate_audio", title="generateAudio (speech output)",
    uses=lambda spec: bool(spec.extras.get("generate_audio")), order=40,
    default=OptionSupport(
        Support.REJECTED, reason="Speech output is assembled only on the blocking path.", alternative=BLOCKING))


@hookimpl
def ifb_request_options():
    return [GENERATE_AUDIO]
