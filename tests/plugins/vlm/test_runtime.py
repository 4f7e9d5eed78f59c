"""The vlm runtime under the engine: media requests join mid-flight; under the pruner they found a batch."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ifb import LLM, SamplingParams
from ifb.params import InvalidRequest, RequestSpec
from tests.models.media import audio_part, image_part, png_bytes, wav_bytes

from tests.helpers import submit_staggered

from tests.plugins.vlm.compare import GREEDY, alone, chat, trace

NUM_IMAGE_TOKENS = 16  # the tiny checkpoint's 32x32 image in 8x8 patches, every token kept ("full")


def image_chat(seed: int, text: str = "What is in this picture?", params=GREEDY) -> RequestSpec:
    return chat([{"type": "text", "text": text}, image_part(png_bytes(seed))], params)


def two_image_chat(seed: int, params=GREEDY) -> RequestSpec:
    return chat([image_part(png_bytes(seed, 40, 20)), {"type": "text", "text": "versus"},
                 image_part(png_bytes(seed + 1, 20, 40))], params)


def text_chat(text: str, params=GREEDY) -> RequestSpec:
    return chat([{"type": "text", "text": text}], params)


@pytest.fixture(scope="module")
def llm(vlm_checkpoint):
    # A 16-token budget splits every media span across prefill chunks.
    model = LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16)
    yield model
    model.close()


@pytest.fixture(scope="module")
def pruned(vlm_checkpoint):
    model = LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, max_batch_size=4,
                max_num_batched_tokens=16, visual_token_pruner=0.25)
    yield model
    model.close()


def test_media_requests_join_mid_flight_and_match_their_output_alone(llm):
    long_text = text_chat("Tell me a long story about a paged KV cache.",
                          SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, logprobs=1))
    specs = [long_text, image_chat(1), two_image_chat(2), image_chat(3, "Describe it."), text_chat("Hi there.")]
    solo = [trace(alone(llm, s)) for s in specs]
    before = llm.health()["scheduling"]
    batched = submit_staggered(llm.engine, specs, gap_steps=2)
    after = llm.health()["scheduling"]
    assert [trace(r) for r in batched] == solo
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] >= 3
    assert after["stalls_incompatible"] == before["stalls_incompatible"]
    # the image changes the answer: its embeddings really reach the decoder
    assert solo[1] != trace(alone(llm, image_chat(4)))


def test_placeholders_expand_to_one_token_per_embedding(llm):
    runtime = llm.deployment.runtime
    text = runtime.prepare(chat([{"type": "text", "text": "What is in this picture?"}]))
    prepared = runtime.prepare(image_chat(1))
    spans = prepared.state.media.embeds
    assert len(spans) == 1 and spans[0][1].shape == (NUM_IMAGE_TOKENS, runtime.model.config.hidden_size)
    rows = spans[0][0].tolist()
    image_id = runtime.encoders["image"].placeholder_id
    assert rows == list(range(rows[0], rows[0] + NUM_IMAGE_TOKENS))
    assert [prepared.prompt_token_ids[r] for r in rows] == [image_id] * NUM_IMAGE_TOKENS
    # the template renders the placeholder and its newline; nothing else changes
    assert len(prepared.prompt_token_ids) - NUM_IMAGE_TOKENS - len(text.prompt_token_ids) in (0, 1)
    assert [len(r) for r, _ in runtime.prepare(two_image_chat(2)).state.media.embeds] == [NUM_IMAGE_TOKENS] * 2


def test_different_media_get_different_kv_salts(llm):
    prepare = llm.deployment.runtime.prepare
    salts = [prepare(spec).kv_salt for spec in (image_chat(1), image_chat(1), image_chat(2), two_image_chat(1))]
    assert salts[0] == salts[1]
    assert len({salts[0], salts[2], salts[3]}) == 3
    assert prepare(text_chat("no media")).kv_salt is None


def test_bad_media_is_refused_at_submit(llm):
    submit = llm.engine.submit
    cases = {
        "not valid base64": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        "not an image": [image_part(b"definitely not a picture")],
        "at most 4096x4096": [image_part(png_bytes(0, width=4097, height=2))],
        "remote URLs": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
        "unknown content part type": [{"type": "video_url", "video_url": {"url": "x"}}],
        "takes no audio": [audio_part(wav_bytes(0))],
        "local files are not allowed": [{"type": "image_url", "image_url": {"url": "file:///nonexistent/cat.png"}}],
        "--allowed-local-media-path DIR": [{"type": "image_url", "image_url": {"url": "/nonexistent/cat.png"}}],
        "placeholder": [{"type": "text", "text": "look: <image>"}],
    }
    before = llm.health()["scheduling"]["submitted"]
    for message, content in cases.items():
        with pytest.raises(InvalidRequest, match=message):
            submit(chat(content))
    with pytest.raises(InvalidRequest, match="larger than 20 MB"):
        submit(chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 28_000_000}}]))
    with pytest.raises(InvalidRequest, match="placeholder"):
        submit(RequestSpec(prompt="<image> what did you see?"))
    assert llm.health()["scheduling"]["submitted"] == before  # refused before queuing


def test_local_image_files_are_read_only_inside_the_allowed_directory(llm, tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    path = allowed / "picture.png"
    path.write_bytes(png_bytes(1))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(1))
    runtime = llm.deployment.runtime
    prepare = runtime.prepare
    inline = prepare(image_chat(1))
    runtime.allowed_media_dir = allowed  # as --allowed-local-media-path sets it
    try:
        for url in (str(path), path.as_uri()):
            local = prepare(chat([{"type": "text", "text": "What is in this picture?"},
                                  {"type": "image_url", "image_url": {"url": url}}]))
            assert local.prompt_token_ids == inline.prompt_token_ids
            assert local.kv_salt == inline.kv_salt
        for url in (str(outside), str(allowed / ".." / "secret.png")):
            with pytest.raises(InvalidRequest, match="under the allowed media directory"):
                prepare(chat([{"type": "image_url", "image_url": {"url": url}}]))
        with pytest.raises(InvalidRequest, match="no such file"):
            prepare(chat([{"type": "image_url", "image_url": {"url": str(allowed / "missing.png")}}]))
    finally:
        runtime.allowed_media_dir = None


def test_pruner_keeps_the_ratio_of_visual_tokens(llm, pruned):
    full = llm.deployment.runtime.prepare(image_chat(1))
    kept = pruned.deployment.runtime.prepare(image_chat(1))
    assert len(full.prompt_token_ids) - len(kept.prompt_token_ids) == NUM_IMAGE_TOKENS - NUM_IMAGE_TOKENS // 4
    (_, full_rows), = full.state.media.embeds
    (_, kept_rows), = kept.state.media.embeds
    # the kept rows are rows of the unpruned embedding, in their original order
    matches = [int((full_rows == row).all(dim=1).nonzero()[0]) for row in kept_rows]
    assert matches == sorted(matches) and len(set(matches)) == NUM_IMAGE_TOKENS // 4
    # the engine prefills the pruned prompt
    result = alone(pruned, image_chat(1))
    assert result.num_prompt_tokens == len(kept.prompt_token_ids) == alone(llm, image_chat(1)).num_prompt_tokens - 12


def test_under_the_pruner_media_founds_a_batch_while_text_joins(pruned):
    # long enough to still be running when the media request is prepared (a decode step is ~2 ms here; under
    # load the image's preprocessing and encoding in submit() took longer than 128 of them)
    long_text = text_chat("Tell me a long story.", SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True))
    joiner = text_chat("Short question?", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    media = image_chat(5)
    media_alone = trace(alone(pruned, media))
    before = pruned.health()["scheduling"]
    results = submit_staggered(pruned.engine, [long_text, joiner, media], gap_steps=2)
    after = pruned.health()["scheduling"]
    assert after["admitted_mid_flight"] - before["admitted_mid_flight"] == 1  # the text joiner only
    assert after["stalls_incompatible"] > before["stalls_incompatible"]  # the media head waited
    assert trace(results[2]) == media_alone
    caps = pruned.deployment.caps.options["media_under_pruner"]
    assert caps.support.value == "founder-only"


def test_blocking_path_serves_media_with_the_same_output(vlm_checkpoint, llm):
    spec = image_chat(7)
    with LLM(str(vlm_checkpoint), plugin="vlm") as blocking:
        assert not blocking.engine.is_in_flight
        assert trace(blocking.engine.submit(spec).result()) == trace(alone(llm, spec))


def test_context_reuse_never_shares_kv_between_different_images(vlm_checkpoint):
    specs = [image_chat(1), image_chat(2)]
    with LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True) as plain:
        expected = [trace(alone(plain, s)) for s in specs]
    with LLM(str(vlm_checkpoint), plugin="vlm", enable_in_flight_batching=True, enable_context_reuse=True) as cached:
        first = trace(alone(cached, specs[0]))
        other = trace(alone(cached, specs[1]))  # same tokens, different image: must not lease image 1's blocks
        again = trace(alone(cached, specs[0]))
        hits = cached.health()["prefix_cache"]["hits"]
    assert [first, other] == expected and again == expected[0]
    assert hits >= 1  # the repeated image did reuse its own blocks


def test_server_answers_bad_media_with_400(llm):
    from ifb.server import app as app_module
    app = app_module.build_app(llm.deployment)

    async def post(content):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post("/v1/chat/completions", json={
                "model": llm.deployment.runtime.model_name, "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "user", "content": content}]})

    bad = asyncio.run(post([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]))
    assert bad.status_code == 400 and "not an image" in bad.text
    good = asyncio.run(post([{"type": "text", "text": "Hi"}, image_part(png_bytes(1))]))
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["prompt_tokens"] > NUM_IMAGE_TOKENS


def test_guided_media_and_plain_requests_share_steps(llm):
    """A guided request with an image and plain ones join one running batch; the guided output is in the
    language and equals the same request alone."""
    import re

    import attrs

    fmt = {"type": "regex", "regex": "[a-z]{3,8}( [a-z]{2,6}){2}"}
    guided = attrs.evolve(image_chat(3), extras={**image_chat(3).extras, "response_format": fmt},
                          params=SamplingParams(temperature=0.0, max_tokens=30))
    alone = llm.engine.submit(guided, wait=True).result()
    stalls = llm.health()["scheduling"]["stalls_guided"]
    results = submit_staggered(llm.engine, [text_chat("one"), guided, image_chat(4), text_chat("two")], gap_steps=1)
    assert re.fullmatch(fmt["regex"], results[1].text) and results[1].token_ids == alone.token_ids
    assert llm.health()["scheduling"]["stalls_guided"] == stalls
