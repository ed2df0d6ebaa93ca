"""A tiny random-weight Qwen2-VL model folder, built here, that mlx-vlm opens with no download.

``mlx_vlm.load(path)`` and ``python -m mlx_vlm.server --model PATH`` (``HF_HUB_OFFLINE=1``)
load it: weights, config, a locally trained tokenizer, the image processor's config and a
chat template. Used by the server tests and benchmarks (issue 18) and by vllm-mlx's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcache.tiny_models.tokenizer import never_ids, train_bpe

VLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2-VL's layout: one <|vision_start|><|image_pad|><|vision_end|> per image part, which the
# processor widens to one <|image_pad|> per merged patch
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_VLM_TEXT = """\
The cache keeps what the model has already computed, so a repeated prompt skips its prefill.
A prompt is split into blocks of tokens; each block is named by a hash of every token before it.
Two servers that share a store find each other's blocks, and a restarted server finds its own.
Describe this image. What colour is the square? Is there a red circle or a blue line here?
A picture of a cat, a dog and a bird on the hills by the sea, under a green sky at night.
Hello, how are you today? I am fine, thank you. What is in the picture? Count the shapes.
Compare the two images. Which one came first? user assistant system
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > . , ; : ! ? ' " # @ & % $
"""
# the image processor: 56x56 to 112x112 pixels, so an image is 4 to 16 merged-patch tokens
_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def vlm_config(ids: dict[str, int], vocab_size: int, **text: Any) -> dict[str, Any]:
    """The ``config.json`` of the tiny Qwen2-VL (text sizes overridable)."""
    cfg: dict[str, Any] = {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {
            "type": "mrope",
            "mrope_section": [4, 6, 6],
        },  # sums to head_dim/2
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 128,  # the projector's output: the text width
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        "text_config": {},
    }
    cfg.update(text)
    cfg["vision_config"]["hidden_size"] = cfg["hidden_size"]
    return cfg


def build_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    scale: float = 4.0,
    **text: Any,
) -> Path:
    """Write a random-weight Qwen2-VL folder at ``path`` and return its path.

    Files: ``config.json``, ``model.safetensors`` (from ``mx.random.seed(seed)``), a byte-level
    BPE ``tokenizer.json`` trained on a built-in text with Qwen2-VL's special tokens,
    ``tokenizer_config.json``, ``chat_template.json`` and ``preprocessor_config.json``.
    The same arguments give the same bytes. Default init answers nearly the same tokens for
    every input, so the token embeddings and the output head are scaled by ``scale`` and the
    vision tower's matrices doubled: the greedy answer then depends on the prompt and on the
    image. The head's rows of special tokens and non-ASCII bytes are zero, so generation runs
    to ``max_tokens`` in printable ASCII. ``text`` overrides text sizes (``hidden_size``, ...).
    """
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(_VLM_TEXT, VLM_SPECIAL_TOKENS, vocab_size, unk=None)
    vocab = tokenizer.get_vocab_size()
    ids = {t: tokenizer.token_to_id(t) for t in VLM_SPECIAL_TOKENS}
    cfg = vlm_config(ids, vocab, **text)
    built = json.loads(json.dumps(cfg))  # from_dict fills in the dict it is given
    arch, _ = get_model_and_args(built)
    model_config = update_module_configs(
        arch.ModelConfig.from_dict(built), arch, built, ["text", "vision"]
    )
    mx.random.seed(seed)
    weights = dict(tree_flatten(arch.Model(model_config).parameters()))
    keep = mx.ones((vocab, 1)).at[mx.array(never_ids(tokenizer))].multiply(0.0)
    for k, v in weights.items():
        if k.endswith("embed_tokens.weight"):
            weights[k] = v * scale
        elif k.startswith("vision_tower") and k.endswith(".weight") and v.ndim >= 2:
            weights[k] = v * 2.0
    head = "language_model.lm_head.weight"
    weights[head] = weights[head] * keep * scale
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", cfg)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "processor_class": "Qwen2VLProcessor",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": False,
            "model_max_length": 32768,
            "chat_template": VLM_CHAT_TEMPLATE,
        },
    )
    _write_json(out / "chat_template.json", {"chat_template": VLM_CHAT_TEMPLATE})
    _write_json(out / "preprocessor_config.json", _PREPROCESSOR)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
