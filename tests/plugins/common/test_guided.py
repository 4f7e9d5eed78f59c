"""Guided decoding in the text runtime, on a tiny random-weight checkpoint through the real engine."""

from __future__ import annotations

import json
import re
import time
import types

import pytest
import torch

import attrs

from ifb import LLM, SamplingParams
from ifb.capabilities import Support
from ifb.engine import check_options
from ifb.options import BUILTIN_OPTIONS
from ifb.params import InvalidRequest, RequestSpec
from ifb.runtime import Seat
from ifb_plugins.common.runtime.caps import text_options
from ifb_plugins.common.decoding.guided import GuidedDecoder
from ifb_plugins.common.runtime.text import TextRequestState
from tests.helpers import submit_staggered
from tests.models.text import save_tiny_checkpoint
from ifb_plugins.common.chat.tokenizer import TextTokenizer

CODE = r"[0-9]{3}-[a-z]{2,5}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def regex(pattern: str) -> dict:
    return {"type": "regex", "regex": pattern}


def person_errors(value) -> list[str]:
    """PERSON's constraints checked by hand."""
    if not isinstance(value, dict):
        return ["not an object"]
    errors = [] if set(value) == {"name", "age", "role"} else [f"keys {sorted(value)}"]
    name, age = value.get("name"), value.get("age")
    if not (isinstance(name, str) and len(name) <= 12):
        errors.append(f"name {name!r}")
    if not (isinstance(age, int) and not isinstance(age, bool) and 0 <= age <= 120):
        errors.append(f"age {age!r}")
    if value.get("role") not in ("admin", "user"):
        errors.append(f"role {value.get('role')!r}")
    return errors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("guided"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    model = LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=4, max_num_batched_tokens=16)
    yield model
    model.close()


def submit(llm, ids, params, request_id=None, **extras):
    spec = RequestSpec(prompt_token_ids=tuple(ids), params=params, extras=extras, request_id=request_id)
    return llm.engine.submit(spec, wait=True)


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_matches_the_regex(llm, seed):
    # Random weights rarely end on their own: the forced EOS ends each output once the regex is complete.
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30)
    out = llm.generate("Code:", params, response_format=regex(CODE))[0]
    assert re.fullmatch(CODE, out.text), out.text
    assert out.finish_reason == "stop"


def test_json_schema_output_parses_and_validates(llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        out = llm.generate("Person:", SamplingParams(temperature=1.0, seed=seed, max_tokens=80),
                           response_format=fmt)[0]
        assert out.finish_reason == "stop", out.text
        assert person_errors(json.loads(out.text)) == [], out.text


def test_json_object_through_chat_is_an_object(llm):
    out = llm.chat([{"role": "user", "content": "Answer in JSON."}],
                   SamplingParams(temperature=1.0, seed=7, max_tokens=60), response_format={"type": "json_object"})
    if out.finish_reason == "stop":  # a random model may still be inside a string at max_tokens
        assert isinstance(json.loads(out.text), dict), out.text
    assert out.text.startswith("{")


@pytest.mark.parametrize("grammar", ['start: "yes" | "no" | "maybe"', 'root ::= "yes" | "no" | "maybe"'],
                         ids=["lark", "gbnf"])
def test_grammar_output_is_in_the_language(llm, grammar):
    texts = {llm.generate("Q:", SamplingParams(temperature=1.0, seed=s, max_tokens=10),
                          response_format={"type": "grammar", "grammar": grammar})[0].text for s in range(4)}
    assert texts <= {"yes", "no", "maybe"}, texts


@pytest.mark.parametrize(("fmt", "reason"), [
    (regex("(ab"), "unclosed group"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "wat"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "JSON Schema object"),
    ({"type": "json_schema"}, "needs a json_schema object"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"type": "regex"}, "non-empty string 'regex'"),
    ({"type": "yaml"}, "unknown response_format type 'yaml'"),
    ("json", "must be an object with a type"),
])
def test_invalid_formats_are_refused_at_submit(llm, fmt, reason):
    with pytest.raises(InvalidRequest, match=re.escape(reason)):
        submit(llm, [5, 6, 7], SamplingParams(max_tokens=4), response_format=fmt)


def test_text_format_is_unguided():
    guided = next(o for o in BUILTIN_OPTIONS if o.name == "guided_decoding")
    assert not guided.uses(RequestSpec(prompt="hi", extras={"response_format": {"type": "text"}}))
    assert guided.uses(RequestSpec(prompt="hi", extras={"response_format": {"type": "json_object"}}))
    assert guided.uses(RequestSpec(prompt="hi", extras={"response_format": regex("a+")}))
    assert text_options()["guided_decoding"].support is Support.SERVED


def test_text_format_has_no_matcher(llm):
    prepared = llm.deployment.runtime.prepare(RequestSpec(prompt="hi", extras={"response_format": {"type": "text"}}))
    assert prepared.state.grammar is None


@pytest.fixture
def runs_alone(checkpoint):
    """A fixture deployment of the text runtime that declares the spec's runs-alone guided decoding."""
    from ifb.capabilities import DeployConfig, OptionSupport
    from ifb.engine import RequestEngine
    from ifb.plugins import default_host
    from ifb_plugins.text import declare
    from ifb_plugins.text.build import load_text_runtime

    config = DeployConfig(model=str(checkpoint), max_batch_size=4, enable_in_flight_batching=True,
                          max_num_batched_tokens=16)
    caps = declare(config)
    caps = attrs.evolve(caps, options={**caps.options, "guided_decoding": OptionSupport(
        Support.RUNS_ALONE, reason="This fixture runs a guided request alone.", stall_counter="stalls_guided")})
    runtime = load_text_runtime(config, caps)
    engine = RequestEngine(runtime, config, default_host().request_options())
    yield engine
    engine.shutdown()


def test_runs_alone_policy_waits_for_the_batch_then_runs_alone(runs_alone, monkeypatch):
    """A plugin that declares runs-alone guided decoding keeps the spec's policy."""
    engine = runs_alone
    runtime = engine.runtime

    llm = types.SimpleNamespace(engine=engine, health=engine.health)  # what the body below reads of an LLM
    runtime.guided.compile(regex("a"))  # build the guided vocabulary before timing matters
    log = []  # per step: the requests in it, the queue, and why each queued request waits
    execute = runtime.execute

    def recording(step):
        log.append(([s.request_id for s in step.seqs], [r.request_id for r in engine.scheduler.waiting],
                    dict(engine.scheduler.exclusions)))
        return execute(step)

    monkeypatch.setattr(runtime, "execute", recording)
    before = dict(llm.health()["scheduling"])
    plain = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    first = submit(llm, [5, 6, 7, 8], plain, request_id="alone-A")
    deadline = time.monotonic() + 30
    while sum("alone-A" in ids for ids, _, _ in log) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    guided = submit(llm, [9, 10, 11], SamplingParams(temperature=1.0, seed=1, max_tokens=30), "alone-G",
                    response_format=regex(CODE))
    later = submit(llm, [12, 13], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), "alone-P")
    results = [h.result() for h in (first, guided, later)]
    assert re.fullmatch(CODE, results[1].text)

    def steps_of(rid):
        return [i for i, (ids, _, _) in enumerate(log) if rid in ids]

    a_steps, g_steps, p_steps = steps_of("alone-A"), steps_of("alone-G"), steps_of("alone-P")
    assert all(log[i][0] == ["alone-G"] for i in g_steps), "the guided request ran with company"
    assert min(g_steps) > max(a_steps), "the guided request joined the running batch"
    assert min(p_steps) > max(g_steps), "a later request joined the guided request's batch"
    waited = [i for i in a_steps if "alone-G" in log[i][1]]
    assert waited, "the guided request did not arrive while the batch ran"
    for i in waited:
        assert log[i][2]["alone-G"] == "stalls_guided"
    for i in g_steps:
        if "alone-P" in log[i][1]:
            assert log[i][2]["alone-P"] == "stalls_guided"
    # one stall per boundary at which the queue head could not join
    num_stalled = sum(1 for _, waiting, _ in log if waiting)
    after = llm.health()["scheduling"]
    assert after["stalls_guided"] - before["stalls_guided"] == num_stalled
    assert after["stalls_incompatible"] == before["stalls_incompatible"]
    assert runtime.guided.matchers == {}


def _schema(i: int) -> dict:
    """Eight different schemas: PERSON, and objects with an enum, a bounded integer and a short string."""
    if i == 0:
        return PERSON
    return {"type": "object", "properties": {
        f"k{i}": {"enum": [f"v{i}", f"w{i}"]}, "n": {"type": "integer", "minimum": i, "maximum": 10 * i},
        "s": {"type": "string", "maxLength": i}}, "required": [f"k{i}", "n", "s"], "additionalProperties": False}


def _schema_errors(i: int, value) -> list[str]:
    if i == 0:
        return person_errors(value)
    if not isinstance(value, dict) or set(value) != {f"k{i}", "n", "s"}:
        return [f"keys of {value!r}"]
    errors = []
    if value[f"k{i}"] not in (f"v{i}", f"w{i}"):
        errors.append("enum")
    if not (isinstance(value["n"], int) and i <= value["n"] <= 10 * i):
        errors.append("n")
    if not (isinstance(value["s"], str) and len(value["s"]) <= i):
        errors.append("s")
    return errors


def test_guided_and_plain_requests_share_steps(checkpoint, monkeypatch):
    """8 guided (JSON schema) and 8 plain requests arriving staggered share steps; every guided output validates,
    and each guided greedy output equals the same request alone (each matcher on its own row)."""
    with LLM(str(checkpoint), enable_in_flight_batching=True, max_batch_size=16, max_num_batched_tokens=64) as llm:
        engine, runtime = llm.engine, llm.deployment.runtime
        fmts = [{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": _schema(i)}} for i in range(8)]
        specs = []
        for i in range(8):
            specs.append(RequestSpec(prompt_token_ids=(5 + i, 6, 7), request_id=f"g{i}",
                                     params=SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=60),
                                     extras={"response_format": fmts[i]}))
            specs.append(RequestSpec(prompt_token_ids=(9, 10 + i), request_id=f"p{i}",
                                     params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
        alone = {s.request_id: engine.submit(s, wait=True).result() for s in specs if s.request_id.startswith("g")}
        steps = []
        execute = runtime.execute

        def recording(step):
            steps.append({s.request_id for s in step.seqs})
            return execute(step)

        monkeypatch.setattr(runtime, "execute", recording)
        before = llm.health()["scheduling"]
        results = dict(zip([s.request_id for s in specs], submit_staggered(engine, specs, gap_steps=1)))
        after = llm.health()["scheduling"]
        for i in range(8):
            out = results[f"g{i}"]
            assert _schema_errors(i, json.loads(out.text)) == [], out.text
            assert out.token_ids == alone[f"g{i}"].token_ids  # greedy or seeded: the same as alone
        shared = [ids for ids in steps if any(r.startswith("g") for r in ids) and any(r.startswith("p") for r in ids)]
        assert len(shared) >= 20, f"only {len(shared)} of {len(steps)} steps mixed guided and plain rows"
        assert max(sum(r.startswith("g") for r in ids) for ids in steps) >= 4  # several matchers in one step
        assert after["stalls_guided"] == before["stalls_guided"]
        assert after["admitted_mid_flight"] - before["admitted_mid_flight"] >= 14
        assert runtime.guided.matchers == {}


def test_masks_computed_during_the_forward_equal_masks_computed_after(checkpoint):
    tokenizer = TextTokenizer.from_hf_dir(checkpoint)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    prefixes = ['{"name": "Al', '{"name": "Bo", "age": 4', "", '{"name": "C", "age": 7, "role": "admin"}']
    masks = []
    for is_overlapped in (True, False):
        decoder = GuidedDecoder(tokenizer, 320)
        decoder.is_overlapped = is_overlapped
        grammar = decoder.compile(fmt)
        seats = [Seat(f"r{i}", i, SamplingParams(), 2, [5, 6, *tokenizer.encode(p, add_special_tokens=False)],
                      state=TextRequestState(grammar=grammar)) for i, p in enumerate(prefixes)]
        decoder.prefetch(seats)
        logits = torch.zeros(len(seats), 320)
        decoder.mask_logits(logits, list(enumerate(seats)))
        masks.append(torch.isinf(logits))
    assert torch.equal(masks[0], masks[1])
    allowed_last = (~masks[0][3]).nonzero().flatten().tolist()
    assert allowed_last == list(tokenizer.eos_token_ids)  # a complete value: only the end may follow


def test_cancelled_guided_request_drops_its_matcher(llm):
    handle = submit(llm, [5, 6], SamplingParams(temperature=1.0, seed=2, max_tokens=200),
                    response_format=regex("[a-z]{150}"))
    next(iter(handle))  # the first token: the matcher exists
    handle.cancel()
    assert handle.result().finish_reason == "cancelled"
    deadline = time.monotonic() + 10
    while llm.deployment.runtime.guided.matchers and time.monotonic() < deadline:
        time.sleep(0.001)
    assert llm.deployment.runtime.guided.matchers == {}


def test_blocking_path_guides_every_sequence(checkpoint):
    # n = 2 runs two guided sequences in one private batch: two matchers, one per row
    with LLM(str(checkpoint)) as blocking:
        spec = RequestSpec(prompt="Code:", params=SamplingParams(temperature=1.0, seed=5, max_tokens=30, n=2),
                           extras={"response_format": regex(CODE)})
        texts = ["", ""]
        for out in blocking.engine.submit(spec, wait=True):
            texts[out.index] += out.text
        assert all(re.fullmatch(CODE, t) for t in texts), texts
        assert blocking.deployment.runtime.guided.matchers == {}


def test_numpy_and_torch_masks_agree(checkpoint):
    tokenizer = TextTokenizer.from_hf_dir(checkpoint)
    decoder = GuidedDecoder(tokenizer, 320)
    grammar = decoder.compile({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    history = (5, 6) + tuple(tokenizer.encode('{"name": "Al', add_special_tokens=False))
    masked = []
    for dtype in (torch.float32, torch.float64):  # the in-place numpy path, then torch's masked_fill_
        seq = Seat(f"r-{dtype}", 0, SamplingParams(), 2, list(history), state=TextRequestState(grammar=grammar))
        logits = torch.zeros(1, 320, dtype=dtype)
        decoder.mask_logits(logits, [(0, seq)])
        masked.append(torch.isinf(logits[0]))
    assert torch.equal(masked[0], masked[1])
    allowed = [tokenizer.token_to_bytes(i) for i in (~masked[0]).nonzero().flatten().tolist()]
    assert b'"' in allowed and 0 < len(allowed) < 320  # inside a string: text or its closing quote
    assert tokenizer.eos_token_ids[0] < 320 and bool(masked[0][tokenizer.eos_token_ids[0]])


def test_gguf_vocabulary_reaches_the_matcher_as_raw_bytes(checkpoint, tmp_path):
    # The default model's tokenizer is rebuilt from GGUF metadata: the matcher must see each token's
    # bytes ("Ġ" is a space), the control tokens as special, and the GGUF end-of-sequence id.
    import gguf

    from ifb_plugins.common.loading.gguf import read_metadata
    from tests.models.text import save_tiny_gguf

    path = save_tiny_gguf(checkpoint, tmp_path / "tiny.gguf")
    tokenizer = TextTokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(path)))
    ll = GuidedDecoder(tokenizer, 320).ll_tokenizer
    assert ll.eos_tokens == list(tokenizer.eos_token_ids)
    special = set(tokenizer.tokenizer.get_added_tokens_decoder())
    for token_id in range(tokenizer.vocab_size):
        raw = tokenizer.token_to_bytes(token_id)
        if raw.startswith(b"\xff"):
            continue  # llguidance's own marker for special tokens; never valid UTF-8, so never generated
        assert ll.is_special_token(token_id) == (token_id in special)
        if token_id not in special:
            assert ll.decode_bytes([token_id]) == raw
    text = 'say "hi" to café 42'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ll.decode_bytes(ids) == text.encode()


CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
DICE_TOOL = {"type": "function", "function": {"name": "roll", "parameters": {
    "type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}},
    "required": ["sides"], "additionalProperties": False}}}


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_parse(llm, fmt, choice):
    """Random weights under the server's forcing grammar still answer with calls that parse and validate."""
    from ifb.server import tools

    plan = tools.ToolPlan(tools=(CLOCK_TOOL, DICE_TOOL), choice=choice,
                          forced_name="roll" if choice == "named" else None, parallel=False, fmt=fmt,
                          in_template=fmt != "hermes")
    fmt_ = {"type": "grammar", "grammar": tools.forcing_grammar(plan)}
    for seed in range(3):
        out = llm.generate("Call:", SamplingParams(temperature=1.0, seed=seed, max_tokens=120),
                           response_format=fmt_)[0]
        assert out.finish_reason == "stop", out.text
        _, calls = tools.parse(out.text, fmt)
        assert len(calls) == 1, out.text
        args = json.loads(calls[0].arguments)
        if calls[0].name == "roll":
            assert set(args) == {"sides"} and 2 <= args["sides"] <= 20
        else:
            assert choice == "required" and calls[0].name == "get_time" and args == {"zone": args["zone"]}
            assert args["zone"] in ("UTC", "CET")


def test_masks_applied_at_once_to_scattered_rows_equal_each_row_masked_alone(checkpoint):
    tokenizer = TextTokenizer.from_hf_dir(checkpoint)
    decoder = GuidedDecoder(tokenizer, 320)
    grammar = decoder.compile({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    prefixes = ['{"name": "Al', "", '{"name": "Bo", "age": 4']
    seats = [Seat(f"s{i}", i, SamplingParams(), 2, [5, 6, *tokenizer.encode(p, add_special_tokens=False)],
                  state=TextRequestState(grammar=grammar)) for i, p in enumerate(prefixes)]
    alone = []
    for seat in seats:
        one = torch.randn(1, 320, generator=torch.Generator().manual_seed(1))
        decoder.mask_logits(one, [(0, seat)])
        alone.append(one[0])
    for dtype in (torch.float32, torch.float64):  # numpy's path and torch's
        logits = torch.randn(1, 320, generator=torch.Generator().manual_seed(1)).expand(6, 320).to(dtype).clone()
        plain = logits.clone()
        rows = [(4, seats[0]), (1, seats[1]), (2, seats[2])]  # guided rows among plain ones, out of order
        decoder.mask_logits(logits, rows)
        for row, seat in rows:
            assert torch.equal(logits[row].float(), alone[seats.index(seat)])
        for row in (0, 3, 5):
            assert torch.equal(logits[row], plain[row])  # plain rows untouched
