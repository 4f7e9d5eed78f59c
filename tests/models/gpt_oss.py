"""Test helpers: a tiny random gpt-oss built with transformers' ``GptOssForCausalLM`` and saved with
``save_pretrained``: alternating sliding-window (16 tokens) and full layers with sinks, 8 experts
(2 per token), YaRN RoPE as the released checkpoints configure it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.models.text import CHATML_TEMPLATE, SPECIAL_TOKENS, train_tiny_tokenizer

VOCAB_SIZE = 320
SLIDING_WINDOW = 16


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("bias", "_bias")):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:  # [E, in, out]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def save_tiny_gpt_oss(directory: str | Path, seed: int = 0, chat_template: str = CHATML_TEMPLATE,
                      **overrides) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    fields = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW, max_position_embeddings=4096, bos_token_id=0, eos_token_id=2, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**fields, **overrides})).float().eval()
    _redraw(model, seed)
    directory = Path(directory)
    model.save_pretrained(str(directory))
    tok = train_tiny_tokenizer(vocab_size=300)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template,
        "bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": 4096}, indent=2))
    return directory


#: the harmony format's markers, special tokens of the tiny tokenizer as of o200k_harmony
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
#: the released checkpoints' chat template, as llama.cpp keeps it
HARMONY_TEMPLATE = "openai-gpt-oss-120b"


def save_tiny_harmony_gpt_oss(directory: str | Path, seed: int = 0, **overrides) -> Path:
    """The tiny gpt-oss with the released chat template and the harmony markers as special tokens;
    ``<|return|>`` and ``<|call|>`` end a sequence, as in the released generation config."""
    from tokenizers import AddedToken

    from tests.models.llama_cpp import chat_template

    tok = train_tiny_tokenizer(vocab_size=300)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    ends = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    directory = save_tiny_gpt_oss(directory, seed=seed, chat_template=chat_template(HARMONY_TEMPLATE),
                                  eos_token_id=ends, **overrides)
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|return|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def _date_variants(prompt: str, count: int) -> list[str]:
    """The prompt as rendered on other days (the template writes today's date into it)."""
    import re

    gen = torch.Generator().manual_seed(7)
    out = [prompt]
    for _ in range(count):
        y, m, d = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((2025, 2031), (1, 13), (1, 29)))
        out.append(re.sub(r"Current date: \d{4}-\d{2}-\d{2}", f"Current date: {y}-{m:02d}-{d:02d}", prompt))
    return out


def fit_head_to_answer(directory: str | Path, pairs: list[tuple[str, str]], steps: int = 3000) -> None:
    """Refit the saved model's output head so that greedy decoding of each prompt writes its completion
    (text with the special tokens spelled out, ending in an end-of-sequence marker); save it again.

    Everything but ``lm_head`` stays random (the head is not tied to the embeddings), so the final hidden
    states are the random model's own: a linear head over them is fitted by cross-entropy, with each
    prompt also rendered on other dates (the system message has today's), so the answers hold any day.
    """
    from transformers import AutoTokenizer, GptOssForCausalLM

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    features, labels = [], []
    with torch.no_grad():
        for prompt, completion in pairs:
            target = tokenizer.encode(completion, add_special_tokens=False)
            for variant in _date_variants(prompt, 1):
                prompt_ids = tokenizer.encode(variant, add_special_tokens=False)
                hidden = model.model(torch.tensor([prompt_ids + target])).last_hidden_state[0]
                features.append(hidden[len(prompt_ids) - 1:-1])
                labels.append(torch.tensor(target))
    x, y = torch.cat(features), torch.cat(labels)
    head = torch.zeros_like(model.lm_head.weight, requires_grad=True)
    optim = torch.optim.Adam([head], lr=0.05)
    for _ in range(steps):
        optim.zero_grad()
        logits = x @ head.T
        right = logits.gather(1, y[:, None])[:, 0]
        wrong = logits.scatter(1, y[:, None], float("-inf")).max(-1).values
        # a wide margin: the engine's float32 arithmetic differs from transformers' in the last bits
        if bool((right - wrong > 4.0).all()):
            break
        loss = torch.nn.functional.cross_entropy(logits, y)
        loss.backward()
        optim.step()
    else:
        raise AssertionError("the head could not be fitted with a wide margin")
    with torch.no_grad():
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)


#: the expert matrices of a gpt-oss GGUF, which the released files keep in MXFP4
EXPERT_MATRICES = r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight"


def mxfp4_experts(src: str | Path, dst: str | Path) -> Path:
    """A float32 gpt-oss GGUF from llama.cpp's converter (``src``) with its expert matrices rewritten
    block by block in MXFP4 by ``gguf.quants.quantize`` (llama.cpp's own Python quantizer), every other
    tensor and metadata key as the converter wrote them.

    The converter writes MXFP4 only from a checkpoint already quantized so, and transformers'
    ``Mxfp4HfQuantizer`` quantizes only with the ``kernels`` package, which fetches its Triton kernels
    from the Hugging Face Hub at run time: the tests quantize the converter's float32 file instead."""
    import gguf

    from tests.models.kquant_moe import requantize

    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    return requantize(Path(src), Path(dst), {EXPERT_MATRICES: mxfp4},
                      lambda rows, qtype: gguf.quants.quantize(rows, qtype))
