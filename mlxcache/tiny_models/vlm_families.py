"""What a tiny VLM folder of each family holds besides its weights (mlx-vlm 0.7.10).

One ``VlmFamily`` per family: its special tokens, chat template, ``config.json`` (sizes from the
configs proven in the family matrix), tokenizer settings and the processor files mlx-vlm's
processor loader reads for it (``mlx_vlm/models/<family>/processing_*.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Ids = dict[str, int]


@dataclass(frozen=True)
class VlmFamily:
    """How to write one family's folder: tokens, template, config and processor files."""

    special_tokens: tuple[str, ...]
    chat_template: str
    config: Callable[[Ids, int, dict[str, Any]], dict[str, Any]]  # (ids, vocab, text sizes)
    tokenizer: dict[str, Any]  # tokenizer_config.json, less the chat template
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # processor configs
    # mlx-vlm's loader makes the output head the token embeddings (Gemma 3's sanitize)
    tied_head: bool = False


_QWEN_SPECIAL_TOKENS = (
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
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _qwen_tokens(ids: Ids) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _qwen_preprocessor(kind: str, patch: int) -> dict[str, Any]:
    """56x56 to 112x112 pixels (rounded to whole merged patches): 4 to 16 image tokens."""
    return {
        "image_processor_type": f"{kind}ImageProcessor",
        "processor_class": f"{kind}Processor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "rescale_factor": 1 / 255,
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112 if patch == 14 else 128 * 128,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def _qwen_tokenizer(processor: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": processor,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 32768,
    }


def qwen2_vl_config(ids: Ids, vocab_size: int, text: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-VL: 2 layers, width 128, M-RoPE; ``text`` overrides the text sizes."""
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
        **_qwen_tokens(ids),
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


# Qwen3-VL's text sizes in the family matrix (``tests/families/specs_qwen.py`` adds its vocabulary)
QWEN3_VL_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "head_dim": 16,
    "rope_theta": 1000,
    "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "mrope", "mrope_section": [4, 2, 2]},  # head_dim/2
}


def qwen3_vl_config(ids: Ids, vocab_size: int, text: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-VL as in the family matrix (``tests/families/specs_qwen.py``, from mlx-vlm's
    ``test_qwen3_vl``): 2 layers, width 64, deepstack at vision layer 0, 16-pixel patches."""
    text_config: dict[str, Any] = {
        "model_type": "qwen3_vl_text",
        **copy.deepcopy(QWEN3_VL_TEXT),
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        **text,
    }
    return {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|im_end|>"],
        **_qwen_tokens(ids),
        "text_config": text_config,
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "out_hidden_size": text_config["hidden_size"],
            "num_heads": 2,
            "patch_size": 16,
            "in_channels": 3,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
    }


# Qwen3.5's text sizes in the family matrix (``tests/families/specs_qwen.py`` adds its vocabulary)
QWEN3_5_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 3,
    "num_hidden_layers": 2,
    "full_attention_interval": 2,  # a gated-delta layer, then a full-attention one
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "type": "default",
        "mrope_section": [4, 2, 2],
        "rope_theta": 100000,
        "partial_rotary_factor": 0.5,
    },
}


def qwen3_5_config(ids: Ids, vocab_size: int, text: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 as in the family matrix (from mlx-vlm's
    ``test_qwen3_5_input_embeddings_owns_mrope_kwargs``): a gated-delta layer, then a
    full-attention one (a hybrid: mlx-vlm's APC runs in checkpoint mode); Qwen3-VL's vision
    tower without deepstack."""
    cfg = qwen3_vl_config(ids, vocab_size, {})
    cfg["model_type"] = "qwen3_5"
    cfg["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    cfg["text_config"] = {
        "model_type": "qwen3_5",
        **copy.deepcopy(QWEN3_5_TEXT),
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        **text,
    }
    cfg["vision_config"] = {
        **cfg["vision_config"],
        "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
    }
    return cfg


_GEMMA_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
# Gemma 3's layout: mlx-vlm puts <start_of_image> after the text (or a part says "image"); the
# processor widens it to "\n\n<start_of_image>" + 16 <image_soft_token> + "<end_of_image>\n\n"
_GEMMA_CHAT_TEMPLATE = (
    "<bos>{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_GEMMA_IMAGE_TOKENS = 16  # 112 px at 14 px a patch: 8x8 patches, pooled 2x2


def gemma3_config(ids: Ids, vocab_size: int, text: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 as ``mlxcache/data/tiny_models/gemma3.json``: 6 layers, width 128, a 64-token
    window every third layer; SigLIP 2 layers on 112 px, 16 image tokens."""
    return {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "vocab_size": vocab_size,
        "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 128,
            "num_hidden_layers": 6,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": vocab_size,
            "sliding_window": 64,
            "sliding_window_pattern": 3,
            "mm_tokens_per_image": _GEMMA_IMAGE_TOKENS,
            "query_pre_attn_scalar": 32,
            **text,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 112,
        },
    }


def _qwen_family(kind: str, patch: int, config: Any) -> VlmFamily:
    """A Qwen-VL family: its tokens and chat template, ``config``, ``<kind>Processor`` files."""
    return VlmFamily(
        _QWEN_SPECIAL_TOKENS,
        _QWEN_CHAT_TEMPLATE,
        config,
        _qwen_tokenizer(f"{kind}Processor"),
        {"preprocessor_config.json": _qwen_preprocessor(kind, patch)},
    )


QWEN2_VL = _qwen_family("Qwen2VL", 14, qwen2_vl_config)
QWEN3_VL = _qwen_family("Qwen3VL", 16, qwen3_vl_config)
QWEN3_5 = _qwen_family("Qwen3VL", 16, qwen3_5_config)
GEMMA3 = VlmFamily(
    _GEMMA_SPECIAL_TOKENS,
    _GEMMA_CHAT_TEMPLATE,
    gemma3_config,
    {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": "Gemma3Processor",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,  # the chat template writes <bos>
        "model_max_length": 32768,
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    },
    {
        "preprocessor_config.json": {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "do_convert_rgb": True,
            "do_pan_and_scan": False,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "rescale_factor": 1 / 255,
            "resample": 2,
            "size": {"height": 112, "width": 112},
            "image_seq_length": _GEMMA_IMAGE_TOKENS,
        },
        "processor_config.json": {
            "processor_class": "Gemma3Processor",
            "image_seq_length": _GEMMA_IMAGE_TOKENS,
        },
    },
    tied_head=True,
)
FAMILIES: dict[str, VlmFamily] = {
    "qwen2_vl": QWEN2_VL,
    "qwen3_vl": QWEN3_VL,
    "qwen3_5": QWEN3_5,
    "gemma3": GEMMA3,
}
