"""Speech deployments through the real loader and engines: the Omni bundle on both paths, the TTS model."""

from __future__ import annotations

import base64
import io
import math
import time
import wave

import pytest
from click.testing import CliRunner

from ifb import LLM, SamplingParams
from ifb.capabilities import DeployConfig
from ifb.deploy import load_deployment
from ifb.engine import RequestRejected
from ifb.gate import UnsupportedDeployment
from ifb.matrix import build
from ifb.params import InvalidRequest, RequestSpec
from ifb.plugins import PluginHost
from ifb.server.cli import serve
from ifb_plugins.speech import SPEAK_PROMPT, generate_audio
from ifb_plugins.speech import loader as speech_loader
from ifb_plugins.speech.testing import TINY_CODE2WAV, save_tiny_omni_checkpoint

from tests.helpers import submit_staggered

HOP = 480  # samples per code of the tiny decoder: 8 * 5 * 4 * 3
assert math.prod(TINY_CODE2WAV["upsample_rates"]) == HOP
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return save_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni"), seed=0)


@pytest.fixture(scope="module")
def tts_dir(tmp_path_factory):
    return save_tiny_omni_checkpoint(tmp_path_factory.mktemp("tts"), seed=1, with_thinker=False)


@pytest.fixture(scope="module")
def omni(omni_dir):
    with LLM(str(omni_dir), plugin="omni") as llm:
        yield llm


@pytest.fixture(scope="module")
def omni_ifb(omni_dir):
    with LLM(str(omni_dir), plugin="omni", enable_in_flight_batching=True, max_batch_size=4,
             max_num_batched_tokens=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def tts(tts_dir):
    with LLM(str(tts_dir), plugin="tts") as llm:
        yield llm


def speak(llm, text, **audio):
    spec = RequestSpec(prompt=text, params=SamplingParams(max_tokens=1),
                       extras={"generate_audio": True, SPEAK_PROMPT: True, "audio": audio})
    return llm.engine.submit(spec, wait=True).result().extras["speech"]


def read_wav(data: bytes) -> tuple[tuple[int, int, int], int, bytes]:
    with wave.open(io.BytesIO(data)) as w:
        return (w.getframerate(), w.getnchannels(), w.getsampwidth()), w.getnframes(), w.readframes(w.getnframes())


@pytest.mark.parametrize("which", ["omni", "tts"])
def test_speech_is_a_valid_24khz_wav_whose_length_follows_the_codes(which, request):
    llm = request.getfixturevalue(which)
    speech = speak(llm, "The quick brown fox jumps over the lazy dog.")
    header, num_frames, _ = read_wav(speech["data"])
    assert header == (24000, 1, 2)
    assert speech["num_codes"] > 0 and num_frames == speech["num_codes"] * HOP
    assert num_frames / 24000 == pytest.approx(speech["num_codes"] * HOP / 24000)
    # generate_audio is the same request: seeded, so the same audio
    assert generate_audio(llm, "The quick brown fox jumps over the lazy dog.") == speech["data"]


def test_voice_speed_and_formats(omni):
    text = "A paged KV cache stores keys and values."
    base = speak(omni, text)
    other_voice = speak(omni, text, voice="onyx")
    assert other_voice["voice"] == "onyx" and other_voice["data"] != base["data"]
    fast = speak(omni, text, speed=2.0)
    assert fast["num_codes"] == round(base["num_codes"] / 2)
    assert read_wav(fast["data"])[1] == fast["num_codes"] * HOP
    pcm = speak(omni, text, format="pcm")
    assert pcm["data"] == read_wav(base["data"])[2]
    with pytest.raises(InvalidRequest, match="unknown voice 'nobody'.*alloy"):
        speak(omni, text, voice="nobody")
    with pytest.raises(InvalidRequest, match="speed"):
        speak(omni, text, speed=9)
    with pytest.raises(InvalidRequest, match="supported formats"):
        speak(omni, text, format="flac")


def test_chat_with_audio_on_the_default_path(omni):
    before = time.time()
    out = omni.chat([{"role": "user", "content": "Say hello"}], GREEDY, generate_audio=True,
                    audio={"voice": "nova", "format": "wav"})
    assert out.text and out.num_output_tokens == 8
    message_audio = out.extras["audio"]
    assert set(message_audio) == {"id", "data", "expires_at", "transcript"}
    assert message_audio["transcript"] == out.text and message_audio["expires_at"] > before
    data = base64.b64decode(message_audio["data"])
    assert data == out.extras["speech"]["data"]
    assert read_wav(data)[1] == out.extras["speech"]["num_codes"] * HOP
    # the text is the Thinker's own: the same as without audio
    assert omni.chat([{"role": "user", "content": "Say hello"}], GREEDY).text == out.text
    with pytest.raises(InvalidRequest, match="n must be 1"):
        omni.chat([{"role": "user", "content": "x"}], SamplingParams(n=2, max_tokens=2), generate_audio=True)


def test_under_the_flag_the_bundle_is_text_only(omni_dir, monkeypatch):
    parts = []
    real = speech_loader.load_part
    monkeypatch.setattr(speech_loader, "load_part", lambda path, part, *a: parts.append(part) or real(path, part, *a))
    with LLM(str(omni_dir), plugin="omni", enable_in_flight_batching=True) as llm:
        runtime = llm.deployment.runtime
        assert llm.engine.is_in_flight
        assert runtime.talker is None and runtime.code2wav is None and runtime.speaker is None
        counts = runtime.num_parameters()
        assert counts["talker"] == counts["code2wav"] == 0 and counts["thinker"] > 0
        assert counts["thinker"] == sum(p.numel() for p in runtime.model.parameters())
    assert parts == ["thinker"]  # the Talker's and decoder's weights were never read


def test_under_the_flag_text_is_served_and_speech_rejected(omni_ifb, omni):
    out = omni_ifb.generate("Hello there", GREEDY)[0]
    assert out.num_output_tokens == 8
    assert out.token_ids == omni.generate("Hello there", GREEDY)[0].token_ids
    submitted = omni_ifb.engine.counters.snapshot()["submitted"]
    with pytest.raises(RequestRejected, match="generateAudio.*in-flight batching.*blocking path"):
        generate_audio(omni_ifb, "hello")
    with pytest.raises(RequestRejected, match="blocking path"):
        omni_ifb.chat([{"role": "user", "content": "hi"}], GREEDY, generate_audio=True)
    assert omni_ifb.engine.counters.snapshot()["submitted"] == submitted  # refused at submit, never queued


def test_under_the_flag_batched_greedy_equals_alone(omni_ifb):
    prompts = [tuple(range(5 + i, 5 + i + n)) for i, n in enumerate((4, 19, 7))]
    alone = [omni_ifb.engine.submit(RequestSpec(prompt_token_ids=p, params=GREEDY), wait=True).result().token_ids
             for p in prompts]
    batched = submit_staggered(omni_ifb.engine, [RequestSpec(prompt_token_ids=p, params=GREEDY) for p in prompts])
    assert [r.token_ids for r in batched] == alone


def test_tts_refuses_the_flag_at_start_up_naming_stepped_execution(tts_dir, monkeypatch):
    monkeypatch.setattr(speech_loader, "load_part", lambda *a: pytest.fail("weights read before the gate"))
    with pytest.raises(UnsupportedDeployment, match="stepped execution.*TTS-only"):
        load_deployment(DeployConfig(model=str(tts_dir), plugin="tts", enable_in_flight_batching=True))
    result = CliRunner().invoke(serve, [str(tts_dir), "--plugin", "tts", "--enable-in-flight-batching"])
    assert result.exit_code == 1
    assert "cannot enable in-flight batching" in result.output and "stepped execution" in result.output


def test_tts_serves_one_utterance_per_request(tts):
    assert tts.deployment.blocking_reason and "stepped execution" in tts.deployment.blocking_reason
    counts = tts.deployment.runtime.num_parameters()
    assert counts["thinker"] == 0 and counts["talker"] > 0 and counts["code2wav"] > 0
    with pytest.raises(InvalidRequest, match="send the text to speak"):
        tts.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(RequestRejected, match="More than one sequence"):
        tts.generate("hi", SamplingParams(n=2))
    # every prompt is spoken, with or without generate_audio
    assert tts.generate("hi there")[0].extras["speech"]["num_codes"] > 0


def test_omni_and_tts_checkpoints_are_not_interchangeable(omni_dir, tts_dir):
    with pytest.raises(ValueError, match="--plugin tts"):
        LLM(str(tts_dir), plugin="omni")
    with pytest.raises(ValueError, match="--plugin omni"):
        LLM(str(omni_dir), plugin="tts")
    with pytest.raises(FileNotFoundError, match="no default model"):
        LLM(None, plugin="tts")


def test_plugin_names_resolve_to_the_kinds():
    host = PluginHost()
    assert host.kind("speech").name == "omni"
    assert host.kind("omni").title == "Speech output, Omni bundle"
    assert host.kind("tts").title == "Speech output, standalone TTS model"


def test_matrix_rows_come_from_the_declarations():
    deployments, requests = build(PluginHost())
    rows = {r.deployment: r for r in deployments if r.plugin == "speech"}
    assert rows["Speech output, Omni bundle"].status == "text-only"
    assert "audio.speech refused per request" in rows["Speech output, Omni bundle"].note
    assert rows["Speech output, standalone TTS model"].status == "blocking path"
    assert "stepped execution" in rows["Speech output, standalone TTS model"].note
    audio_rows = {r.deployment: r for r in requests if r.option == "generateAudio (speech output)"}
    assert audio_rows["Speech output, Omni bundle"].status == "rejected"
    assert "blocking path" in audio_rows["Speech output, Omni bundle"].note
    assert audio_rows["Speech output, standalone TTS model"].status == "blocking path"
    plain = [r for r in requests if r.deployment == "Speech output, Omni bundle" and r.option.startswith("Plain")]
    assert plain[0].status == "served"
