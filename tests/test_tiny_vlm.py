"""``build_tiny_vlm``: a local Qwen2-VL, Qwen3-VL, Qwen3.5 or Gemma 3 folder mlx-vlm loads with no
download, whose greedy answer depends on the prompt and on the image."""

from __future__ import annotations

import json
import os

import mlx_vlm
import pytest
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image, ImageDraw

from mlxcache.tiny_models import build_tiny_vlm


def _image(colour, shape):
    im = Image.new("RGB", (112, 112), colour)
    ImageDraw.Draw(im).rectangle(shape, fill=(220, 0, 0))
    return im


FILES = [
    "chat_template.json",
    "config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
# what mlx-vlm's processor for the family reads besides (processing_gemma3.py)
EXTRA_FILES = {
    "qwen2_vl": [],
    "qwen3_vl": [],
    "qwen3_5": [],
    "gemma3": ["processor_config.json"],
}


@pytest.mark.parametrize("family", sorted(EXTRA_FILES))
def test_tiny_vlm_loads_offline_and_answers_depend_on_prompt_and_image(
    family, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_vlm(tmp_path / "vlm", family=family)
    assert sorted(os.listdir(path)) == sorted(FILES + EXTRA_FILES[family])
    again = build_tiny_vlm(tmp_path / "again", family=family)
    assert (path / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    model, processor = mlx_vlm.load(str(path))
    images = [_image((255, 255, 255), [20, 20, 70, 70]), _image((0, 0, 128), [0, 50, 111, 60])]
    prompt = apply_chat_template(processor, model.config, "Describe this image.", num_images=1)
    ids = processor(text=[prompt], images=[images[0]])["input_ids"].tolist()[0]
    config = json.loads((path / "config.json").read_text())  # the id the model replaces
    assert ids.count(config.get("image_token_index", config.get("image_token_id"))) == 16
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


def test_unknown_family_is_a_clear_error_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="unknown VLM family 'llava'; choose one of qwen2_vl"):
        build_tiny_vlm(tmp_path / "x", family="llava")
    assert not (tmp_path / "x").exists()
