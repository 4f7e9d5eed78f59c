"""The legacy system-prompt KV capture.

A request with ``save_system_prompt_kv_cache`` has its system prompt's KV kept
for later requests that start with it. On the blocking path (``SystemPromptCache``)
the system prompt is prefilled once into pinned blocks when the request takes
its seat (``match``, before its first step); it and later requests whose prompt
starts with a captured prefix lease those blocks instead of recomputing them.
Under in-flight batching the context cache does it: the request's prepared
``num_pinned_tokens`` (``system_prefix_length``) makes the cache keep the
prefix's blocks once they are computed; without the context cache the option
is rejected.
"""

from __future__ import annotations

from ifb.kv import BlockManager
from ifb.params import RequestSpec
from ifb.request import Request


def system_prefix_length(tokenizer, spec: RequestSpec, prompt_ids: list[int]) -> int:
    """How many leading prompt tokens are the request's system message(s) (a plain prompt: all but the last)."""
    if spec.messages:
        system = system_messages(spec.messages)
        rendered = tokenizer.apply_chat_template(system, add_generation_prompt=False) if system else ""
        return common_prefix_length(tokenizer.encode(rendered, add_special_tokens=False), prompt_ids)
    return common_prefix_length(prompt_ids[:-1], prompt_ids)  # a plain prompt: all but the token sampled from


def system_messages(messages) -> list[dict]:
    """The system messages of OpenAI-style ``messages``, in order (what a capture keeps)."""
    return [m for m in messages if m.get("role") == "system"]


def common_prefix_length(system_ids, prompt_ids) -> int:
    """How many leading ``prompt_ids`` the system messages rendered alone (``system_ids``) share with them,
    leaving at least the prompt's last token to compute."""
    n = 0
    while n < len(system_ids) and n < len(prompt_ids) - 1 and system_ids[n] == prompt_ids[n]:
        n += 1
    return n


class SystemPromptCache:
    def __init__(self, blocks: BlockManager, runtime):
        self.blocks = blocks
        self.runtime = runtime
        self.captured: dict[tuple[int, ...], list[int]] = {}  # prefix ids -> pinned blocks
        #: prefix ids -> per sliding-window KV group, its pinned blocks (the whole prefix: a capture is
        #: leased from its start, and the leaseholders free what slides out of their window)
        self.captured_windows: dict[tuple[int, ...], list[list[int]]] = {}
        self.num_hit_tokens = 0

    def system_prefix(self, request: Request) -> list[int]:
        """The block-aligned token prefix covered by the request's system message(s) (``num_pinned_tokens``,
        which its runtime's ``prepare`` counted: never past the prompt's first media item)."""
        n = request.num_pinned_tokens
        n -= n % self.blocks.block_size
        return list(request.prompt_token_ids[:n])

    def capture(self, request: Request) -> None:
        prefix = tuple(self.system_prefix(request))
        if not prefix or prefix in self.captured:
            return
        num_blocks = self.blocks.blocks_for(len(prefix))
        block_ids = self.blocks.allocate(num_blocks)
        windows = [group.blocks.allocate(num_blocks) for group in self.blocks.window_groups]
        self.runtime.prefill_only(list(prefix), block_ids, windows)
        self.captured[prefix] = block_ids  # pinned: their count never drops to zero
        self.captured_windows[prefix] = windows

    # -- PrefixMatcher --
    def match(self, request: Request) -> tuple[list[int], int]:
        state = request.state
        if state is not None and state.is_capturing_system_prompt:
            self.capture(request)
        prompt = request.prompt_token_ids
        best: tuple[int, ...] = ()
        for prefix in self.captured:
            if len(prefix) > len(best) and len(prefix) < len(prompt) and tuple(prompt[:len(prefix)]) == prefix:
                best = prefix
        if not best:
            return [], 0
        block_ids = self.captured[best]
        self.blocks.incref(block_ids)
        for group, table, captured in zip(self.blocks.window_groups, request.window_tables,
                                          self.captured_windows[best]):
            table.block_ids = list(captured)
            group.blocks.incref(table.block_ids)
        self.num_hit_tokens += len(best)
        return list(block_ids), len(best)

    def commit(self, step, requests) -> None:
        pass

    def forget(self, request) -> None:
        pass
