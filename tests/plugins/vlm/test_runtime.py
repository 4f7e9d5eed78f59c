"""The vlm runtime under the engine: media requests join mid-flight; under the pruner they found a batch."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ifb import LLM, SamplingParams
from ifb.params import InvalidRequest, RequestSpec
from ifb_plugins.vlm.testing import audio_part, image_part, png_bytes, wav_bytes

from tests.helpers import submit_staggered

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
NUM_PATCHES = 16  # the tiny checkpoint's 32x32 image in 8x8 patches


def chat(content, params=GREEDY) -> RequestSpec:
    return RequestSpec(messages=({"role": "user", "content": content},), params=params)


def image_chat(seed: int, text: str = "What is in this picture?", params=GREEDY) -> RequestSpec:
    return chat([{"type": "text", "text": text}, image_part(png_bytes(seed))], params)


def audio_chat(seed: int, params=GREEDY) -> RequestSpec:
    return chat([audio_part(wav_bytes(seed, seconds=0.4)), {"type": "text", "text": "Transcribe it."}], params)


def text_chat(text: str, params=GREEDY) -> RequestSpec:
    return chat(text, params)


class trace:
    """Tokens and their log-probabilities; equal when the tokens are and the log-probabilities agree to 1e-4."""

    def __init__(self, result):
        self.token_ids = tuple(result.token_ids)
        self.logprobs = tuple(lp.logprob for lp in result.logprobs)

    def __eq__(self, other) -> bool:
        return self.token_ids == other.token_ids and self.logprobs == pytest.approx(other.logprobs, abs=1e-4)

    def __repr__(self) -> str:
        return f"trace({self.token_ids})"


def alone(llm, spec):
    return llm.engine.submit(spec, wait=True).result()


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
                          SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1))
    specs = [long_text, image_chat(1), audio_chat(2), image_chat(3, "Describe it."), text_chat("Hi there.")]
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
    spans = prepared.extras["media_embeds"]
    assert len(spans) == 1 and spans[0][1].shape == (NUM_PATCHES, runtime.model.config.hidden_size)
    start = spans[0][0]
    image_id = runtime.vlm_config.image_token_id
    assert prepared.prompt_token_ids[start:start + NUM_PATCHES] == (image_id,) * NUM_PATCHES
    # the template renders the text and the placeholder (plus a separator); nothing else changes
    assert len(prepared.prompt_token_ids) - NUM_PATCHES - len(text.prompt_token_ids) in (0, 1)
    audio = runtime.prepare(audio_chat(2)).extras["media_embeds"]
    assert audio[0][1].shape[0] == 20  # 0.4 s: 40 mel frames, halved by the strided conv


def test_different_media_get_different_kv_salts(llm):
    prepare = llm.deployment.runtime.prepare
    salts = [prepare(spec).extras["kv_salt"] for spec in (image_chat(1), image_chat(1), image_chat(2), audio_chat(1))]
    assert salts[0] == salts[1]
    assert len({salts[0], salts[2], salts[3]}) == 3
    assert "kv_salt" not in prepare(text_chat("no media")).extras


def test_bad_media_is_refused_at_submit(llm):
    submit = llm.engine.submit
    cases = {
        "not valid base64": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        "not an image": [image_part(b"definitely not a picture")],
        "at most 4096x4096": [image_part(png_bytes(0, width=4097, height=2))],
        "remote URLs": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
        "unknown content part type": [{"type": "video_url", "video_url": {"url": "x"}}],
        "at most 30 s": [audio_part(wav_bytes(0, seconds=31, rate=8000, sample_width=1))],
        "format 'mp3'": [audio_part(b"ID3", fmt="mp3")],
        "not a PCM WAV": [audio_part(b"RIFF....WAVEjunk")],
        "local files are not allowed": [{"type": "image_url", "image_url": {"url": "file:///nonexistent/cat.png"}}],
        "placeholder": [{"type": "text", "text": "look: <image>"}],
    }
    before = llm.health()["scheduling"]["submitted"]
    for message, content in cases.items():
        with pytest.raises(InvalidRequest, match=message):
            submit(chat(content))
    with pytest.raises(InvalidRequest, match="larger than 20 MB"):
        submit(chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 28_000_000}}]))
    with pytest.raises(InvalidRequest, match="placeholder"):
        submit(RequestSpec(prompt="<audio> what did you hear?"))
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
            assert local.extras["kv_salt"] == inline.extras["kv_salt"]
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
    assert len(full.prompt_token_ids) - len(kept.prompt_token_ids) == NUM_PATCHES - NUM_PATCHES // 4
    (_, full_rows), = full.extras["media_embeds"]
    (_, kept_rows), = kept.extras["media_embeds"]
    # the kept rows are rows of the unpruned embedding, in their original order
    matches = [int((full_rows == row).all(dim=1).nonzero()[0]) for row in kept_rows]
    assert matches == sorted(matches) and len(set(matches)) == NUM_PATCHES // 4
    # the engine prefills the pruned prompt
    result = alone(pruned, image_chat(1))
    assert result.num_prompt_tokens == len(kept.prompt_token_ids) == alone(llm, image_chat(1)).num_prompt_tokens - 12
    assert len(pruned.deployment.runtime.prepare(audio_chat(2)).extras["media_embeds"][0][1]) == 20  # audio unpruned


def test_under_the_pruner_media_founds_a_batch_while_text_joins(pruned):
    long_text = text_chat("Tell me a long story.", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
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
    app_module = pytest.importorskip("ifb.server.app")
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
    assert good.json()["usage"]["prompt_tokens"] > NUM_PATCHES
