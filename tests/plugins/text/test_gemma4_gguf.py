"""Gemma 4 text GGUF files, as llama.cpp's converter writes them, are refused at load naming the field.

The converter converts the tiny ``Gemma4ForCausalLM`` once its tokenizer is of Gemma's kind
(``tests.models.gemma4.save_gemma_style_tokenizer`` says why); ifb does not read the result yet:
neither its tensors (``gemma4``: per-layer input tables, shared KV layers, ``layer_output_scale``)
nor its SentencePiece-style vocabulary (``tokenizer.ggml.model`` ``gemma4``). The directory is
served (test_gemma4.py).
"""

from __future__ import annotations

import gguf
import pytest

from ifb import LLM
from ifb_plugins.common.loading.checkpoint import load_checkpoint


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_the_converters_gemma4_file_is_refused_naming_its_architecture(llama_cpp_families, outtype):
    path = llama_cpp_families["gemma4"].ggufs[outtype]
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["general.architecture"].contents() == "gemma4"
    assert fields["tokenizer.ggml.model"].contents() == "gemma4"
    with pytest.raises(ValueError, match="general.architecture 'gemma4'.*serve the Hugging Face directory"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="general.architecture 'gemma4'"):
        LLM(model=str(path), plugin="text")
