"""TextTokenizer: built from GGUF metadata (the real default model) and from a tiny HF directory."""

from __future__ import annotations

from pathlib import Path

import gguf
import jinja2
import pytest

from ifb.runtime import Tokenizer
from ifb_plugins.text.default_model import resolve_model
from ifb_plugins.common.loading.gguf import read_metadata
from tests.models.text import save_tiny_checkpoint
from ifb_plugins.common.chat.tokenizer import TextTokenizer

MULTIBYTE = "naïve café, 日本語のテキスト, Ελληνικά 🙂🚀"


@pytest.fixture(scope="module")
def smol() -> TextTokenizer:
    return TextTokenizer.from_gguf_metadata(read_metadata(gguf.GGUFReader(str(resolve_model(None)))))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tok"), "llama")


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_hf_dir(tiny_dir)


@pytest.mark.e2e
def test_gguf_tokenizer_splits_digits_and_round_trips(smol: TextTokenizer) -> None:
    assert isinstance(smol, Tokenizer)
    assert (smol.vocab_size, smol.eos_token_ids, smol.bos_token_id) == (49152, (2,), 1)
    digits = smol.encode("12345")
    assert [smol.decode([i]) for i in digits] == ["1", "2", "3", "4", "5"]
    ids = smol.encode("What is the capital of France?")
    assert [smol.id_to_token(i) for i in ids] == ["What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?"]
    for text in ("What is the capital of France?", "Year 2024: 3.14 apples\n\n  indented", MULTIBYTE):
        assert smol.decode(smol.encode(text)) == text


@pytest.mark.e2e
def test_gguf_tokenizer_special_tokens_and_chat_template(smol: TextTokenizer) -> None:
    prompt = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smol.encode(prompt)
    assert ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> is one id
    assert ids.count(2) == 2  # <|im_end|> is one token, never split
    assert smol.decode(ids, skip_special_tokens=False) == prompt
    assert "<|im_start|>" not in smol.decode(ids)
    assert not smol.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_tiny_tokenizer_decodes_multibyte_utf8(tiny: TextTokenizer) -> None:
    ids = tiny.encode(MULTIBYTE)
    assert tiny.decode(ids) == MULTIBYTE
    # Byte-level tokens concatenate to the exact UTF-8 bytes, even where a token splits a character.
    assert b"".join(tiny.token_to_bytes(i) for i in ids) == MULTIBYTE.encode("utf-8")
    split = next(n for n in range(1, len(ids)) if tiny.decode(ids[:n]).endswith("\ufffd"))
    assert tiny.decode(ids[:split]).endswith("\ufffd")  # an incomplete character shows as U+FFFD


def test_tiny_tokenizer_matches_transformers(tiny: TextTokenizer, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = ? 🙂"}]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tiny.apply_chat_template(messages) == expected
    text = tiny.apply_chat_template(messages)
    assert tiny.encode(text) == ref(text)["input_ids"]
    assert tiny.eos_token_ids == (2,) and tiny.eos_token == "<|im_end|>"


def test_chat_template_is_sandboxed_and_can_raise(tiny: TextTokenizer) -> None:
    strict = TextTokenizer(
        tiny.tokenizer,
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
        eos_token_ids=tiny.eos_token_ids,
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(jinja2.TemplateError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    unsafe = TextTokenizer(tiny.tokenizer, chat_template="{{ ''.__class__.__mro__ }}", eos_token_ids=())
    with pytest.raises(jinja2.exceptions.SecurityError):
        unsafe.apply_chat_template([])


def test_long_texts_tokenize_as_short_ones(tiny: TextTokenizer, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    from ifb_plugins.common.chat import tokenizer as module
    text = "Der Zug fährt um 12:30 ab. 🙂 " * (module.LONG_TEXT_CHARS // 10)
    assert len(text) > module.LONG_TEXT_CHARS  # the GIL-free batch path
    assert tiny.encode(text) == AutoTokenizer.from_pretrained(tiny_dir)(text)["input_ids"]


def test_tools_reach_a_template_that_reads_them(tiny: TextTokenizer) -> None:
    from ifb.params import RequestSpec
    from ifb_plugins.common.chat.prompt import prompt_token_ids, render_chat

    reads = TextTokenizer(tiny.tokenizer, eos_token_ids=tiny.eos_token_ids, chat_template=(
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "x"}]
    assert render_chat(reads, messages, tools=tools) == "[get_weather]user:x;"
    assert render_chat(reads, messages) == "user:x;"
    spec = RequestSpec(messages=tuple(messages), extras={"tools": tools})
    assert reads.decode(prompt_token_ids(reads, reads.vocab_size, spec)) == "[get_weather]user:x;"


def test_tojson_takes_the_arguments_hub_templates_pass(tiny: TextTokenizer) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
                "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}|{{ messages[0] | tojson(ensure_ascii=true) }}")
    ours = TextTokenizer(tiny.tokenizer, chat_template=template, eos_token_ids=())
    messages = [{"role": "user", "content": "Grüße <b>&"}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == render_jinja_template([messages], chat_template=template, add_generation_prompt=True)[0][0]
    assert '{"content":"Grüße <b>&","role":"user"}' in rendered and "\\u00fc" in rendered
