"""JSON-schema guided decoding on the real default model (SmolLM2-135M-Instruct) under in-flight batching."""

from __future__ import annotations

import json
import time

import pytest

from ifb import LLM, SamplingParams
from ifb.params import RequestSpec

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired teacher from Lyon", "a young footballer", "the author of a cookbook", "a ship captain",
    "a nurse working night shifts", "a ten-year-old chess champion", "a jazz pianist", "a software engineer",
    "a farmer who grows apples", "a famous painter", "a mountain guide", "an astronaut",
    "a baker in Vienna", "a marathon runner", "a librarian", "a firefighter", "a university student",
    "a fisherman", "a grandmother who knits", "a startup founder",
]


def schema_errors(value) -> list[str]:
    """SCHEMA's constraints, checked by hand."""
    if not isinstance(value, dict):
        return [f"not an object: {value!r}"]
    errors = [] if set(value) == {"name", "age"} else [f"keys {sorted(value)}"]
    name, age = value.get("name"), value.get("age")
    if not (isinstance(name, str) and len(name) <= 20):
        errors.append(f"name {name!r}")
    if not (isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 120):
        errors.append(f"age {age!r}")
    return errors


@pytest.fixture(scope="module")
def llm():
    model = LLM(enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=64)
    yield model
    model.close()


def test_every_output_follows_the_json_schema(llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    params = SamplingParams(temperature=0.0, max_tokens=60)
    specs = [RequestSpec(messages=({"role": "user", "content": f"Describe {who} as JSON with a name and an age."},),
                         params=params, extras={"response_format": fmt}) for who in PEOPLE]
    stats = llm.deployment.runtime.guided.stats
    before_tokens, before_ns = stats.num_tokens, stats.mask_ns + stats.advance_ns
    before_stalls = llm.health()["scheduling"]["stalls_guided"]
    start = time.perf_counter()
    handles = [llm.engine.submit(spec, wait=True) for spec in specs]
    results = [h.result() for h in handles]
    elapsed = time.perf_counter() - start
    for out in results:
        assert out.finish_reason == "stop", out.text
        assert schema_errors(json.loads(out.text)) == [], out.text
    # submitted together, the guided requests share the running batch: none waits for another
    assert llm.health()["scheduling"]["stalls_guided"] == before_stalls
    num_tokens = stats.num_tokens - before_tokens
    print(f"\nguided: {len(results)} outputs, {num_tokens} tokens in {elapsed:.1f} s; mask + advance "
          f"{(stats.mask_ns + stats.advance_ns - before_ns) / num_tokens / 1e3:.0f} us per token; "
          f"e.g. {results[0].text}")
