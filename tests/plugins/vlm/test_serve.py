"""``ifb serve --plugin vlm DIR`` on a checkpoint transformers saved, driven by the official ``openai`` client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import transformers

from tests.models.media import image_part, png_bytes

from tests.plugins.vlm import tiny
from tests.plugins.vlm.compare import hf_content, pil, reference_greedy, reference_inputs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_served_answer_equals_transformers_greedy(tmp_path):
    path = tiny.llava(tmp_path / "llava", tower="clip", layout="hub", seed=11)
    model, processor = tiny.reference(path, transformers.LlavaForConditionalGeneration)
    image = png_bytes(21, 40, 30)
    parts = [("image", image), ("text", "What is this?")]
    inputs = reference_inputs(processor, [{"role": "user", "content": hf_content(parts)}], images=[pil(image)])
    expected = processor.tokenizer.decode(reference_greedy(model, inputs, 6), skip_special_tokens=True)

    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "ifb", "serve", str(path), "--plugin", "vlm", "--enable-in-flight-batching",
         "--max-batch-size", "2", "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model=path.name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [image_part(image), {"type": "text", "text": "What is this?"}]}])
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
        with pytest.raises(openai.BadRequestError, match="not an image"):
            client.chat.completions.create(model=path.name, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}])
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
