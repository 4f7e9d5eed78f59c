"""Qwen3-Omni's Talker on the Thinker's states, against transformers' ``Qwen3OmniMoeForConditionalGeneration.generate``."""

from __future__ import annotations

import pytest
import torch

from ifb_plugins.speech.omni import load_code2wav
from ifb_plugins.speech.omni_talker import ThinkerStates, load_talker
from ifb_plugins.speech.tts_model import Sampling

from .omni_reference import omni_tokenizer

TOKENIZER = omni_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
PROMPT = TOKENIZER.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)


def reference_run(model, speaker: str):
    """transformers' greedy Thinker + Talker + Code2Wav; returns the Thinker's result, the codes and the waveform."""
    captured = {}
    talker_generate, thinker_generate = model.talker.generate, model.thinker.generate

    def talker(*args, **kwargs):
        captured["talker"] = result = talker_generate(*args, **kwargs)
        return result

    def thinker(*args, **kwargs):
        captured["thinker"] = result = thinker_generate(*args, **kwargs)
        return result

    model.talker.generate, model.thinker.generate = talker, thinker
    try:
        _, wav = model.generate(input_ids=torch.tensor([PROMPT]), speaker=speaker, thinker_do_sample=False,
                                talker_do_sample=False, thinker_max_new_tokens=6, talker_max_new_tokens=9,
                                thinker_eos_token_id=IM_END)
    finally:
        model.talker.generate, model.thinker.generate = talker_generate, thinker_generate
    codes = [h[-1] for h in captured["talker"].hidden_states if h[-1] is not None]
    return captured["thinker"], torch.stack(codes, 1)[0], wav


@pytest.mark.parametrize("speaker", ["Ethan", "chelsie"])
def test_talker_codes_equal_the_reference_for_the_same_thinker_states(omni_reference_model, speaker):
    path, model = omni_reference_model
    thinker, expected, wav = reference_run(model, speaker)
    layer = model.config.talker_config.accept_hidden_layer
    talker, special = load_talker(path)
    states = ThinkerStates(
        prompt_ids=tuple(PROMPT), sequence_ids=tuple(thinker.sequences[0].tolist()),
        embeds=torch.cat([h[0] for h in thinker.hidden_states], 1)[0],
        hidden=torch.cat([h[layer] for h in thinker.hidden_states], 1)[0], special_embeds=special)
    frames = list(talker.generate(states, speaker, max_new_tokens=9, sampling=Sampling(False),
                                  sub_sampling=Sampling(False), repetition_penalty=1.05, thinker_eos_ids=(IM_END,)))
    assert len(frames) >= 2 and torch.equal(torch.stack(frames), expected)
    # and Code2Wav makes the reference's waveform of them
    ours = load_code2wav(path).chunked_decode(torch.stack(frames).T[None])
    assert ours.shape == wav.shape and (ours - wav).abs().max().item() <= 1e-4


def test_the_speaker_changes_the_codes(omni_reference_model):
    _, model = omni_reference_model
    assert not torch.equal(reference_run(model, "ethan")[1], reference_run(model, "chelsie")[1])
