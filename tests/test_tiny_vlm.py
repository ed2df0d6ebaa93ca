"""``build_tiny_vlm``: a local Qwen2-VL folder mlx-vlm loads with no download, whose greedy
answer depends on the prompt and on the image."""

from __future__ import annotations

import os

import mlx_vlm
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image, ImageDraw

from mlxcache.tiny_models import build_tiny_vlm


def _image(colour, shape):
    im = Image.new("RGB", (112, 112), colour)
    ImageDraw.Draw(im).rectangle(shape, fill=(220, 0, 0))
    return im


def test_tiny_vlm_loads_offline_and_answers_depend_on_prompt_and_image(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_vlm(tmp_path / "vlm")
    assert sorted(os.listdir(path)) == [
        "chat_template.json",
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    again = build_tiny_vlm(tmp_path / "again")
    assert (path / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    model, processor = mlx_vlm.load(str(path))
    images = [_image((255, 255, 255), [20, 20, 70, 70]), _image((0, 0, 128), [0, 50, 111, 60])]
    answers = {}
    for question in ("Describe this image.", "What colour is the square?"):
        prompt = apply_chat_template(processor, model.config, question, num_images=1)
        for i, im in enumerate(images):
            out = mlx_vlm.generate(
                model, processor, prompt, image=[im], max_tokens=8, temperature=0.0
            )
            assert out.text.isascii() and out.generation_tokens == 8
            answers[question, i] = out.text
    assert len(set(answers.values())) == 4, answers
