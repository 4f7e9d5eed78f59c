"""What the vlm plugin adds to ``ifb serve`` and ``LLM(...)``, and its request option.

Light on purpose (no torch): ``ifb serve --help`` and ``ifb matrix`` import it.
"""

from __future__ import annotations

from pathlib import Path

import click

from ifb import hookimpl
from ifb.capabilities import DeploySetting, OptionSupport, RequestOption, Support
from ifb.options import has_media


MEDIA_UNDER_PRUNER = RequestOption(
    name="media_under_pruner", title="Media under an active visual-token pruner", uses=has_media, order=30,
    default=OptionSupport(
        Support.FOUNDER_ONLY, reason="Pruning runs only in the founding prefill; a seated prefill would skip it."))

SETTINGS = (
    DeploySetting(
        name="visual_token_pruner", type=click.FloatRange(0.0, 1.0, min_open=True), metavar="RATIO",
        help="Keep this fraction of the visual tokens; media requests become founder-only."),
    DeploySetting(
        name="allowed_local_media_path", type=click.Path(exists=True, file_okay=False, path_type=Path),
        to_option=lambda path: str(path.resolve()),
        help="A directory whose files image/audio URLs may name; local files are refused otherwise."),
)


@hookimpl
def ifb_deploy_settings():
    return list(SETTINGS)


@hookimpl
def ifb_request_options():
    return [MEDIA_UNDER_PRUNER]
