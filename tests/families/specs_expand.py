"""Families whose ``get_input_embeddings`` expands one image placeholder into the image's rows.

The KV cache then holds more positions than the prompt has ids: mlxcache keys and resumes
these prompts in embedding positions (``integrations/mlx_vlm/expanded.py``). Tiny configs from
the dimensions of mlx-vlm's own tests (``test_llava_next_input_embeddings``,
``test_phi4mm_input_embeddings``), vocabulary 1000 with the placeholder at 999.
"""

from __future__ import annotations

from families.harness import Spec
from families.specs_guards import IMAGE_TOKEN, VOCAB, _image, _text, _vision

EXPANDS = {"encoder": False, "expands": True}

LLAVA_NEXT = {
    "model_type": "llava_next",
    "text_config": _text("llama"),
    "vision_config": _vision("clip_vision_model"),
    "image_token_index": IMAGE_TOKEN,
    "vocab_size": VOCAB,
    "vision_feature_layer": -1,
}

SPECS = [
    # one crop of 56 px: 16 patch features for one placeholder (the newline row is unused)
    Spec("llava_next", LLAVA_NEXT, _image((1, 1, 3, 56, 56), 1), extra=EXPANDS),
]

PHI4MM = {
    "model_type": "phi4mm",
    "text_config": {"model_type": "phi4mm", "max_position_embeddings": 2048},
    "vision_config": {
        "model_type": "siglip2_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,  # the tower reads the second-to-last layer
        "patch_size": 14,
        "image_size": 56,
    },
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mm_hidden_size": 32,
    "image_token_index": -200,  # phi4mm's placeholder id is negative
    "audio_token_index": 200,
    "audio_processor": {  # the test's small conformer (the default one has 440M weights)
        "config": {
            "attention_dim": 32,
            "attention_heads": 4,
            "num_blocks": 2,
            "linear_units": 64,
            "input_size": 80,
            "time_reduction": 8,
            "kernel_size": 3,
            "conv_channels": 32,
            "ext_pw_out_channel": 32,
            "depthwise_seperable_out_channel": 32,
        }
    },
}


def _phi4mm_image(seed: int):
    """One 56 px image as 16 NaFlex patches of 588 values: 16 rows for its one placeholder."""
    pixels, kwargs, _ = _image(
        (1, 16, 588), 1, spatial_shapes=[[4, 4]], pixel_attention_mask=[[1] * 16]
    )(seed)
    return pixels, kwargs, [PHI4MM["image_token_index"]]


SPECS += [Spec("phi4mm", PHI4MM, _phi4mm_image, extra=EXPANDS)]
