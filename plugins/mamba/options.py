"""What the mamba plugin adds to ``ifb serve`` and ``LLM(...)``.

Light on purpose (no torch): ``ifb serve --help`` and ``ifb matrix`` import it.
"""

from __future__ import annotations

import click

from ifb import hookimpl
from ifb.capabilities import DeploySetting

SETTINGS = (
    DeploySetting(
        name="hybrid_checkpoint_interval", type=click.IntRange(min=1), metavar="TOKENS",
        help="With --enable-context-reuse, keep the recurrent state every TOKENS tokens (a multiple of the KV "
             "block size) besides at each prompt's end.  [default: 256]"),
)


@hookimpl
def ifb_deploy_settings():
    return list(SETTINGS)
