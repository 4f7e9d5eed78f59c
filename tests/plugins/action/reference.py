"""The reference side of the pi0 tests: a tiny random pi0 built and saved by transformers, and what
transformers' own processor and ``sample_actions`` compute on it.

Run as a script (``python -m tests.plugins.action.reference build DIR [SIZES_JSON]``, ``... run DIR CASES OUT`` or both at once,
``... build-and-run DIR CASES OUT``)
in a process of its own: PI0's image processor is transformers' torchvision backend, and PyPI's
torchvision wheels are CUDA builds whose C extension does not load with the CPU build of torch. The
image transforms PI0 uses are plain torch ops; only the registration of two fake kernels
(``torchvision::nms`` / ``qnms``) fails without the extension, so this process declares those two
operator schemas first and imports torchvision from the directory ``scripts/setup`` installed it to
(never into the virtual environment, where it would change which backend every other processor picks).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

#: where ``scripts/setup`` installs torchvision for this process only
TORCHVISION_DIR = Path(__file__).resolve().parents[3] / ".venv" / "reference-torchvision"

CHUNK_SIZE = 5
MAX_STATE_DIM = 6
MAX_ACTION_DIM = 7
IMAGE_SIZE = 28
PATCH_SIZE = 7
STATE_MEAN = [0.1, -0.2, 0.3, 0.0]
STATE_STD = [1.5, 0.5, 2.0, 1.0]


def import_torchvision() -> None:
    if "torchvision" in sys.modules:
        return
    if not TORCHVISION_DIR.is_dir():
        raise RuntimeError(f"torchvision for the pi0 reference is not installed at {TORCHVISION_DIR}: "
                           "run scripts/setup")
    sys.path.insert(0, str(TORCHVISION_DIR))
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision  # noqa: F401


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Fan-in scaled weights and norms away from their init, so that a dropped term shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                # Gemma's norms scale by 1 + weight, SigLIP's LayerNorm by weight
                base = 0.0 if ("vlm.language_model" in name or "dit" in name) else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if "embed_tokens" in name or "position_embedding" in name else p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


#: the test checkpoint's sizes; ``build`` takes others (``benchmarks/action_batching.py`` builds a larger one)
TINY = dict(text_hidden=64, text_layers=2, text_intermediate=96, text_heads=4, text_head_dim=16, vision_hidden=32,
            vision_intermediate=48, vision_layers=2, vision_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
            expert_hidden=32, expert_layers=2, expert_intermediate=48, expert_heads=4, expert_head_dim=16,
            chunk_size=CHUNK_SIZE, max_state_dim=MAX_STATE_DIM, max_action_dim=MAX_ACTION_DIM, vocab=300)


def build(directory: Path, sizes: dict | None = None) -> None:
    """Save a random ``PI0ForConditionalGeneration`` (``TINY`` unless ``sizes`` overrides some) and its
    ``PI0Processor`` into ``directory``."""
    z = {**TINY, **(sizes or {})}
    import_torchvision()
    import transformers
    from tokenizers import AddedToken  # noqa: F401 - the processor adds its own tokens

    from tests.models.text import SPECIAL_TOKENS, train_tiny_tokenizer

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(z["vocab"]), bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2],
        pad_token=SPECIAL_TOKENS[1])
    image_processor = transformers.PI0ImageProcessor(
        size={"max_height": z["image_size"], "max_width": z["image_size"]},
        pad_size={"height": z["image_size"], "width": z["image_size"]},
        image_seq_length=(z["image_size"] // z["patch_size"]) ** 2)
    processor = transformers.PI0Processor(
        image_processor=image_processor, tokenizer=tok, state_mean=STATE_MEAN, state_std=STATE_STD,
        max_state_dim=z["max_state_dim"], chunk_size=z["chunk_size"])
    vocab_size = len(processor.tokenizer)
    config = transformers.PI0Config(
        vlm_config={
            "model_type": "paligemma",
            "text_config": {"model_type": "gemma", "hidden_size": z["text_hidden"],
                            "num_hidden_layers": z["text_layers"], "intermediate_size": z["text_intermediate"],
                            "num_attention_heads": z["text_heads"], "num_key_value_heads": 1,
                            "head_dim": z["text_head_dim"], "vocab_size": vocab_size, "rope_theta": 10000.0},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": z["vision_hidden"],
                              "intermediate_size": z["vision_intermediate"], "num_hidden_layers": z["vision_layers"],
                              "num_attention_heads": z["vision_heads"], "patch_size": z["patch_size"],
                              "image_size": z["image_size"], "vision_use_head": False},
            "projection_dim": z["text_hidden"],
            "image_token_id": processor.image_token_id,
        },
        dit_config={"model_type": "gemma", "hidden_size": z["expert_hidden"], "num_hidden_layers": z["expert_layers"],
                    "intermediate_size": z["expert_intermediate"], "num_attention_heads": z["expert_heads"],
                    "num_key_value_heads": 1, "head_dim": z["expert_head_dim"]},
        chunk_size=z["chunk_size"], max_state_dim=z["max_state_dim"], max_action_dim=z["max_action_dim"],
        num_inference_steps=10,
    )
    torch.manual_seed(0)
    model = transformers.PI0ForConditionalGeneration(config).eval()
    _redraw(model, seed=1)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)


def run(directory: Path, cases_path: Path, out_path: Path) -> None:
    """For each case (text, image files, state rows, noise seed): the processor's inputs, the prefix KV
    and ``sample_actions`` with the seed's noise, saved with ``torch.save``."""
    import_torchvision()
    import transformers
    from PIL import Image

    model = transformers.PI0ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    processor = transformers.PI0Processor.from_pretrained(directory)
    cfg = model.config
    results = []
    for case in json.loads(cases_path.read_text()):
        images = [Image.open(p) for p in case["images"]]
        inputs = processor(images=[images], text=case["text"], state=case["state"], return_tensors="pt")
        noise = torch.randn((cfg.chunk_size, cfg.max_action_dim),
                           generator=torch.Generator().manual_seed(case["noise_seed"]), dtype=torch.float32)
        with torch.no_grad():
            actions = model.sample_actions(
                state=inputs["state"], input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
                noise=noise[None], attention_mask=inputs["attention_mask"],
                pixel_attention_mask=inputs["pixel_attention_mask"])
            # the prefix KV, as sample_actions computes it
            embeds = model.model.embed_prefix(inputs["input_ids"], inputs["pixel_values"],
                                              inputs["pixel_attention_mask"])
            cache = model.model.vlm(
                inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                position_ids=inputs["attention_mask"].cumsum(-1) - 1,
                token_type_ids=torch.zeros_like(embeds)[:, :, 0], use_cache=True).cache
        num_real = int(inputs["attention_mask"].sum())
        kv = [(layer.keys[0, :, :num_real].clone(), layer.values[0, :, :num_real].clone()) for layer in cache.layers]
        results.append({"input_ids": inputs["input_ids"][0, :num_real].clone(),
                        "pixel_values": inputs["pixel_values"][0].clone(), "state": inputs["state"][0].clone(),
                        "actions": actions[0].clone(), "prefix_kv": kv})
    torch.save(results, out_path)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "build":  # build DIR [SIZES_JSON]
        build(Path(args[0]), json.loads(args[1]) if len(args) > 1 else None)
    elif command == "run":
        run(Path(args[0]), Path(args[1]), Path(args[2]))
    elif command == "build-and-run":  # one process: the imports cost more than either step
        build(Path(args[0]))
        run(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        raise SystemExit(f"unknown command {command!r} (build or run)")
