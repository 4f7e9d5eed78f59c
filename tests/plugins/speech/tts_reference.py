"""A tiny random Qwen3-TTS (CustomVoice) built with Qwen's own classes (the ``qwen-tts`` package), as a checkpoint.

Under transformers 5 the reference is the ``qwen-tts-compat`` build of
``qwen-tts`` 0.1.1 (installed with ``--no-deps``). Two things make it run here:

- PyPI's torchaudio is a CUDA build that does not load with the CPU torch:
  the package imports ``torchaudio.compliance.kaldi`` only for its 25 Hz
  tokenizer, so an empty stand-in module is registered when torchaudio is
  absent (nothing the 12 Hz path runs touches it);
- transformers 5 passes and reads the KV cache as ``cache`` where the
  package's models say ``past_key_values``: without mapping it both ways
  the code predictor would run every step without its cache, and the codes
  would be wrong.

The package's ``save_pretrained`` / ``from_pretrained`` do not work under
transformers 5.24, so the checkpoint is written from the reference model's own
``state_dict()`` and ``config.to_dict()``, in the layout of the published
checkpoints: ``config.json``, ``generation_config.json``, ``model.safetensors``,
the text tokenizer, and ``speech_tokenizer/`` (``config.json``,
``model.safetensors``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

CODEBOOK = 32  # codes 0..31; the talker's codec vocabulary is 1024 ids larger (its control ids live there)
TALKER_VOCAB = CODEBOOK + 1024
SPEAKERS = {"vivian": 1050, "dylan": 1051}
LANGUAGES = {"english": 1040, "chinese": 1041, "beijing_dialect": 1042}
GENERATE_DEFAULTS = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9, "repetition_penalty": 1.05,
                     "subtalker_dosample": True, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
                     "subtalker_temperature": 0.9, "max_new_tokens": 12}
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>"]


def import_reference():
    """The ``qwen_tts`` package's modules; a test failure naming why (and the transformers version the
    shims meet) when they are not installed or do not import: a missing reference is never a skip."""
    import transformers

    if importlib.util.find_spec("qwen_tts") is None:
        pytest.fail("the Qwen3-TTS reference is not installed (scripts/setup installs it: "
                    "pip install --no-deps qwen-tts-compat==0.1.1.post1)", pytrace=False)
    from transformers.utils import import_utils

    import_utils.is_torchaudio_available()  # decided (False) before the stand-in exists, and cached
    transformers.AutoConfig  # noqa: B018 - finish transformers' lazy start-up first, for the same reason
    stand_ins = {}
    if importlib.util.find_spec("torchaudio") is None:
        kaldi = types.ModuleType("torchaudio.compliance.kaldi")
        compliance = types.ModuleType("torchaudio.compliance")
        compliance.kaldi = kaldi
        root = types.ModuleType("torchaudio")
        root.compliance = compliance
        stand_ins = {"torchaudio": root, "torchaudio.compliance": compliance, "torchaudio.compliance.kaldi": kaldi}
    sys.modules.update(stand_ins)
    try:
        from qwen_tts.core.models import modeling_qwen3_tts as modeling
        from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as tokenizer_modeling
        from qwen_tts.inference import qwen3_tts_model, qwen3_tts_tokenizer
    except Exception as exc:  # noqa: BLE001 - whatever broke, the run must say so
        pytest.fail(f"the Qwen3-TTS reference does not import with transformers {transformers.__version__} "
                    f"(its shims here target the range pyproject.toml's test extra allows): "
                    f"{type(exc).__name__}: {exc}", pytrace=False)
    finally:
        for name in stand_ins:  # nothing else in the process may see the stand-in
            sys.modules.pop(name, None)
    for cls in (modeling.Qwen3TTSTalkerForConditionalGeneration,
                modeling.Qwen3TTSTalkerCodePredictorModelForConditionalGeneration):
        _map_cache(cls)
    for cls in (modeling.Qwen3TTSTalkerOutputWithPast, modeling.Qwen3TTSTalkerCodePredictorOutputWithPast):
        _accept_cache(cls)
    return types.SimpleNamespace(modeling=modeling, tokenizer_modeling=tokenizer_modeling,
                                 wrapper=qwen3_tts_model, speech_tokenizer=qwen3_tts_tokenizer)


def _accept_cache(output_cls) -> None:
    """Let an output class be built with ``cache=`` (transformers 5 renames ``past_key_values`` to it)."""
    if getattr(output_cls, "_cache_accepted", False):
        return
    dataclass_init = output_cls.__init__.__wrapped__  # under transformers' renaming wrapper

    def init(self, *args, cache=None, **kwargs):
        dataclass_init(self, *args, past_key_values=cache, **kwargs)

    output_cls.__init__ = init  # transformers wraps it again: past_key_values= arrives here as cache=
    output_cls._cache_accepted = True


def _map_cache(cls) -> None:
    """The model's forward takes ``cache`` as its ``past_key_values`` and returns it as ``cache`` too."""
    if getattr(cls, "_cache_mapped", False):
        return
    forward = cls.forward

    @functools.wraps(forward)  # generate() validates its kwargs against the forward's signature
    def mapped(self, *args, cache=None, **kwargs):
        if cache is not None and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = cache
        out = forward(self, *args, **kwargs)
        # generate() creates the cache and passes it in; the models update it in place
        out["cache"] = kwargs.get("past_key_values")
        return out

    cls.forward = mapped
    cls._cache_mapped = True


def text_tokenizer():
    """A small byte-level BPE as transformers' ``Qwen2Tokenizer`` builds one, with Qwen's chat and TTS tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["assistant", "user", "Hello there, how are you today?", "Speak slowly and warmly.",
              "The quick brown fox jumps over the lazy dog.", "你好，世界"] * 4
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|tts_pad|>")
    tokenizer.add_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS], special_tokens=True)
    return tokenizer, model["vocab"], merges


def tiny_config(modeling_cfg, tokenizer, model_type: str = "custom_voice"):
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6)
    talker = dict(
        vocab_size=TALKER_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, **head,
        text_vocab_size=len(tokenizer), text_hidden_size=48, num_code_groups=4,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
        codec_eos_token_id=1030, codec_pad_id=1028, codec_bos_id=1029, codec_think_id=1032,
        codec_nothink_id=1033, codec_think_bos_id=1034, codec_think_eos_id=1035,
        spk_id=dict(SPEAKERS), spk_is_dialect={"vivian": False, "dylan": "beijing_dialect"},
        codec_language_id=dict(LANGUAGES),
        code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=24, intermediate_size=48,
                                   num_hidden_layers=2, num_code_groups=4, pad_token_id=None, **head))
    return modeling_cfg.Qwen3TTSConfig(
        talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="1b7",
        tts_model_type=model_type, im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"], tts_bos_token_id=ids["<|tts_text_bos|>"],
        tts_eos_token_id=ids["<|tts_text_eod|>"])


def tiny_speech_tokenizer_config(config_module):
    encoder = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                   intermediate_size=32, codebook_size=CODEBOOK, codebook_dim=16, num_filters=4,
                   upsampling_ratios=[2, 2], num_quantizers=4, num_semantic_quantizers=1,
                   vector_quantization_hidden_dimension=16, sliding_window=8, upsample_groups=16)
    decoder = dict(codebook_size=CODEBOOK, hidden_size=32, latent_dim=24, codebook_dim=16, num_attention_heads=2,
                   num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2, num_quantizers=4,
                   sliding_window=4, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=16)
    return config_module.Qwen3TTSTokenizerV2Config(encoder_config=encoder, decoder_config=decoder,
                                                   encoder_valid_num_quantizers=4, decode_upsample_rate=8,
                                                   encode_downsample_rate=8)


def build(path: Path, seed: int = 0, model_type: str = "custom_voice"):
    """Build the reference, write its checkpoint to ``path``; returns the reference ``Qwen3TTSModel`` wrapper."""
    ref = import_reference()
    from qwen_tts.core.models import configuration_qwen3_tts as cfg_mod
    from qwen_tts.core.models.processing_qwen3_tts import Qwen3TTSProcessor
    from qwen_tts.core.tokenizer_12hz import configuration_qwen3_tts_tokenizer_v2 as tok_cfg_mod

    from .omni_reference import liven

    tokenizer, vocab, merges = text_tokenizer()
    torch.manual_seed(seed)
    config = tiny_config(cfg_mod, tokenizer, model_type)
    model = ref.modeling.Qwen3TTSForConditionalGeneration(config).eval()
    with torch.no_grad():  # the init leaves near-identity norms: give every parameter some spread
        gen = torch.Generator().manual_seed(seed)
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    st_config = tiny_speech_tokenizer_config(tok_cfg_mod)
    # The tokenizer's encoder (a Mimi subclass) does not build under transformers 5.24, and decoding never
    # runs it: the speech tokenizer is built without it, and its checkpoint holds the decoder.* weights.
    encoder_cls = ref.tokenizer_modeling.Qwen3TTSTokenizerV2Encoder
    with mock.patch.object(encoder_cls, "_from_config", classmethod(lambda cls, cfg: None)):
        speech_model = ref.tokenizer_modeling.Qwen3TTSTokenizerV2Model(st_config).eval()
    liven(speech_model.decoder, seed)

    path.mkdir(parents=True, exist_ok=True)
    raw = config.to_dict()
    raw["model_type"] = "qwen3_tts"
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    (path / "generation_config.json").write_text(json.dumps(GENERATE_DEFAULTS))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    tokenizer.save_pretrained(path)  # tokenizer.json and tokenizer_config.json
    # and the BPE files the published checkpoints carry (some carry only these)
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    # transformers 4 (which wrote the published checkpoints) lists the added tokens in tokenizer_config.json
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in tokenizer.added_tokens_decoder.items()}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    st_dir = path / "speech_tokenizer"
    st_dir.mkdir(exist_ok=True)
    st_raw = st_config.to_dict()
    st_raw["model_type"] = "qwen3_tts_tokenizer_12hz"
    (st_dir / "config.json").write_text(json.dumps(st_raw, indent=1))
    save_file({k: v.contiguous() for k, v in speech_model.state_dict().items()}, str(st_dir / "model.safetensors"))

    speech_tokenizer = ref.speech_tokenizer.Qwen3TTSTokenizer()
    speech_tokenizer.model, speech_tokenizer.config = speech_model, speech_model.config
    speech_tokenizer.device = torch.device("cpu")
    model.load_speech_tokenizer(speech_tokenizer)
    model.load_generate_config(dict(GENERATE_DEFAULTS))
    return ref.wrapper.Qwen3TTSModel(model, Qwen3TTSProcessor(tokenizer=tokenizer), dict(GENERATE_DEFAULTS))
