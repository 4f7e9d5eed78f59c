"""The speech plugin's parts on tiny random-weight checkpoints: config, loader, Talker, decoder, containers."""

from __future__ import annotations

import io
import json
import wave

import pytest
import torch
from safetensors.torch import load_file, save_file

from ifb.params import InvalidRequest
from ifb_plugins.speech import audio
from ifb_plugins.speech.code2wav import Code2Wav
from ifb_plugins.speech.config import Code2WavConfig, SpeechConfigError
from ifb_plugins.speech.loader import build_code2wav, build_talker, build_thinker, read_checkpoint
from ifb_plugins.speech.testing import save_tiny_omni_checkpoint


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return save_tiny_omni_checkpoint(tmp_path_factory.mktemp("omni"), seed=3)


@pytest.fixture(scope="module")
def tts_dir(tmp_path_factory):
    return save_tiny_omni_checkpoint(tmp_path_factory.mktemp("tts"), seed=4, with_thinker=False)


def test_loader_builds_every_part_with_the_saved_weights(omni_dir):
    ckpt = read_checkpoint(omni_dir)
    saved = load_file(str(omni_dir / "model.safetensors"))
    for part, module in (("thinker", build_thinker(ckpt)), ("talker", build_talker(ckpt)),
                         ("code2wav", build_code2wav(ckpt))):
        state = module.state_dict()
        names = {k[len(part) + 1:] for k in saved if k.startswith(part + ".")}
        if part == "thinker" and ckpt.config.thinker.tie_word_embeddings:
            names.discard("lm_head.weight")
        assert set(state) == names
        for name in names:
            assert torch.equal(state[name], saved[f"{part}.{name}"]), name
    assert build_talker(ckpt).thinker_proj is not None


def test_tts_checkpoint_has_no_thinker_but_a_tokenizer(tts_dir):
    ckpt = read_checkpoint(tts_dir)
    assert not ckpt.has_thinker and ckpt.config.talker.thinker_hidden_size is None
    assert ckpt.tokenizer.encode("hello", add_special_tokens=False)
    assert build_talker(ckpt).thinker_proj is None
    with pytest.raises(ValueError, match="standalone TTS"):
        build_thinker(ckpt)


def test_loader_names_what_is_wrong(tmp_path, omni_dir):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        read_checkpoint(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SpeechConfigError, match="talker_config"):
        read_checkpoint(bad)
    # weights that do not match the config: one talker tensor dropped
    broken = save_tiny_omni_checkpoint(tmp_path / "broken", seed=0)
    state = load_file(str(broken / "model.safetensors"))
    state.pop("talker.text_embed.weight")
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="talker weights do not match.*text_embed"):
        build_talker(read_checkpoint(broken))


@pytest.mark.parametrize("rates", [(8, 5, 4, 3), (2, 3), (7,)])
def test_decoder_gives_exactly_hop_samples_per_code(rates):
    cfg = Code2WavConfig(codebook_size=16, channels=(8,) * (len(rates) + 1), upsample_rates=rates)
    decoder = Code2Wav(cfg).eval()
    for n in (0, 1, 5, 13):
        wav = decoder(torch.randint(0, 16, (n,)))
        assert wav.shape == (n * cfg.hop_length,)
        assert wav.abs().max() <= 1.0 if n else True


def test_talker_code_count_follows_the_text_and_the_voice_matters(omni_dir):
    ckpt = read_checkpoint(omni_dir)
    talker = build_talker(ckpt)
    cfg = talker.talker_config
    hidden = torch.randn(4, ckpt.config.thinker.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = [10, 11, 12, 13]
    codes = talker.generate_codes(ids, 0, thinker_hidden=hidden, seed=1)
    assert cfg.min_codes_per_token * 4 <= len(codes) <= cfg.max_codes_per_token * 4
    assert all(0 <= c < cfg.codebook_size for c in codes)
    assert talker.generate_codes(ids, 0, thinker_hidden=hidden, seed=1) == codes  # seeded: reproducible
    assert talker.generate_codes(ids, 1, thinker_hidden=hidden, seed=1) != codes
    # the Thinker's hidden states enter the Talker's context beside the text rows
    prefix = talker.condition(ids, 0, hidden)
    assert prefix.shape == (4 + 2, cfg.hidden_size)
    assert not torch.equal(talker.condition(ids, 0, hidden * 2)[1:-1], prefix[1:-1])
    assert torch.equal(talker.condition(ids, 0, hidden * 2)[[0, -1]], prefix[[0, -1]])
    with pytest.raises(ValueError, match="hidden state"):
        talker.generate_codes(ids, 0, seed=1)


def test_long_text_is_spoken_in_segments_that_fit_the_context(tmp_path):
    # a 32-position Talker holds 6 text tokens (and their at most 24 codes) per segment
    small = save_tiny_omni_checkpoint(tmp_path, with_thinker=False, talker_overrides={"max_position_embeddings": 32})
    talker = build_talker(read_checkpoint(small))
    cfg = talker.talker_config
    assert cfg.max_text_tokens_per_segment == 6
    n = cfg.max_text_tokens_per_segment * 2 + 3
    codes = talker.generate_codes([5 + i % 200 for i in range(n)], 2, seed=0)
    assert cfg.min_codes_per_token * n <= len(codes) <= cfg.max_codes_per_token * n


def test_containers():
    wave_in = torch.sin(torch.arange(4800) / 7.0) * 0.5
    pcm = audio.encode(wave_in, "pcm", 24000)
    assert len(pcm) == 2 * 4800
    wav = audio.encode(wave_in, "wav", 24000)
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 4800)
        assert w.readframes(4800) == pcm
    assert audio.check_format("pcm16") == "pcm"
    with pytest.raises(InvalidRequest, match="supported formats: wav, pcm"):
        audio.check_format("flac")


def test_mp3_is_encoded_when_the_encoder_is_installed():
    pytest.importorskip("lameenc")
    data = audio.encode(torch.sin(torch.arange(24000) / 5.0) * 0.5, "mp3", 24000)
    assert data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)  # an MPEG frame sync


def test_mp3_without_an_encoder_is_a_400_naming_the_formats(monkeypatch):
    monkeypatch.setattr(audio, "mp3_available", lambda: False)
    with pytest.raises(InvalidRequest, match="mp3.*not installed.*supported formats: wav, pcm"):
        audio.check_format("mp3")
    assert audio.default_speech_format() == "wav"


def test_speed_resamples_the_codes():
    codes = list(range(10))
    assert audio.change_speed(codes, 1.0) == codes
    assert audio.change_speed(codes, 2.0) == [0, 2, 4, 6, 8]
    assert len(audio.change_speed(codes, 0.5)) == 20
    assert audio.change_speed([], 3.0) == []
