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
        system = [m for m in spec.messages if m.get("role") == "system"]
        rendered = tokenizer.apply_chat_template(system, add_generation_prompt=False) if system else ""
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = list(prompt_ids[:-1])  # a plain prompt: everything but the token that is sampled from
    n = 0
    while n < len(ids) and n < len(prompt_ids) - 1 and ids[n] == prompt_ids[n]:
        n += 1
    return n


class SystemPromptCache:
    def __init__(self, blocks: BlockManager, runtime):
        self.blocks = blocks
        self.runtime = runtime
        self.captured: dict[tuple[int, ...], list[int]] = {}  # prefix ids -> pinned blocks
        self.num_hit_tokens = 0

    def system_prefix(self, spec: RequestSpec, prompt_ids: list[int]) -> list[int]:
        """The block-aligned token prefix covered by the request's system message(s)."""
        n = system_prefix_length(self.runtime.tokenizer, spec, prompt_ids)
        n -= n % self.blocks.block_size
        return list(prompt_ids[:n])

    def capture(self, spec: RequestSpec, prompt_ids: list[int]) -> None:
        prefix = tuple(self.system_prefix(spec, prompt_ids))
        if not prefix or prefix in self.captured:
            return
        block_ids = self.blocks.allocate(self.blocks.blocks_for(len(prefix)))
        self.runtime.prefill_only(list(prefix), block_ids)
        self.captured[prefix] = block_ids  # pinned: their count never drops to zero

    # -- PrefixMatcher --
    def match(self, request: Request) -> tuple[list[int], int]:
        state = request.state
        if state is not None and state.is_capturing_system_prompt:
            self.capture(request.spec, request.prompt_token_ids)
        prompt = request.prompt_token_ids
        best: tuple[int, ...] = ()
        for prefix in self.captured:
            if len(prefix) > len(best) and len(prefix) < len(prompt) and tuple(prompt[:len(prefix)]) == prefix:
                best = prefix
        if not best:
            return [], 0
        block_ids = self.captured[best]
        self.blocks.incref(block_ids)
        self.num_hit_tokens += len(best)
        return list(block_ids), len(best)

    def commit(self, step, requests) -> None:
        pass

    def forget(self, request) -> None:
        pass
