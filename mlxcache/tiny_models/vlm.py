"""A tiny random-weight VLM folder (Qwen2-VL, Qwen3-VL, Gemma 3), built here, no download.

``mlx_vlm.load(path)`` and ``python -m mlx_vlm.server --model PATH`` (``HF_HUB_OFFLINE=1``)
load it: weights, config, a locally trained tokenizer, the processor's configs and a chat
template. Used by the server tests and benchmarks (issues 18, 25) and by vllm-mlx's.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcache.tiny_models.tokenizer import never_ids, train_bpe
from mlxcache.tiny_models.vlm_families import FAMILIES, QWEN2_VL

VLM_SPECIAL_TOKENS = QWEN2_VL.special_tokens  # the default family's
VLM_CHAT_TEMPLATE = QWEN2_VL.chat_template

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


def build_tiny_vlm(
    path: str | os.PathLike[str],
    *,
    family: str = "qwen2_vl",
    seed: int = 0,
    vocab_size: int = 512,
    scale: float = 4.0,
    **text: Any,
) -> Path:
    """Write a random-weight VLM folder of ``family`` at ``path`` and return its path.

    Families: ``qwen2_vl`` (2 layers, width 128), ``qwen3_vl``, ``qwen3_5`` (gated-delta hybrid)
    and ``gemma3`` (sliding window; the sizes of the family matrix; ``vlm_families.py``).
    Files: ``config.json``, ``model.safetensors`` (from ``mx.random.seed(seed)``), a byte-level
    BPE ``tokenizer.json`` trained on a built-in text with the family's special tokens,
    ``tokenizer_config.json``, ``chat_template.json`` and the processor configs mlx-vlm reads
    for the family. The same arguments give the same bytes.
    ``text`` overrides text sizes (``hidden_size``, ...); see ``scaled_weights`` for why the
    greedy answer depends on the prompt and on the image.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; choose one of {', '.join(FAMILIES)}")
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale!r}")
    spec = FAMILIES[family]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(_VLM_TEXT, spec.special_tokens, vocab_size, unk=None)
    vocab = tokenizer.get_vocab_size()
    ids = {t: tokenizer.token_to_id(t) for t in spec.special_tokens}
    cfg = spec.config(ids, vocab, text)
    weights = scaled_weights(cfg, never_ids(tokenizer), seed, scale, tied_head=spec.tied_head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", cfg)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json", {**spec.tokenizer, "chat_template": spec.chat_template}
    )
    _write_json(out / "chat_template.json", {"chat_template": spec.chat_template})
    for name, content in spec.files.items():
        _write_json(out / name, content)
    return out


def scaled_weights(
    cfg: dict[str, Any], never: list[int], seed: int, scale: float, *, tied_head: bool = False
) -> dict[str, mx.array]:
    """The random weights of the model ``cfg`` describes (``mx.random.seed(seed)``), rescaled.

    Default init answers nearly the same tokens for every input, so the token embeddings and
    the output head are scaled by ``scale`` and the vision tower's matrices doubled: the greedy
    answer then depends on the prompt and on the image. The head's rows ``never`` (special
    tokens, non-ASCII bytes) are zero, so generation runs to ``max_tokens`` in printable ASCII.
    With ``tied_head`` (the loader makes the head the embedding table, and the model multiplies
    its inputs by sqrt(width): Gemma 3) the table gets the zero rows and ``scale / sqrt(width)``.
    """
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    built = json.loads(json.dumps(cfg))  # from_dict fills in the dict it is given
    arch, _ = get_model_and_args(built)
    model_config = update_module_configs(
        arch.ModelConfig.from_dict(built), arch, built, ["text", "vision"]
    )
    mx.random.seed(seed)
    weights = dict(tree_flatten(arch.Model(model_config).parameters()))
    for k, v in weights.items():
        if k.endswith("embed_tokens.weight"):
            weights[k] = v * scale
        elif k.startswith("vision_tower") and k.endswith(".weight") and v.ndim >= 2:
            weights[k] = v * 2.0
    head = "language_model.lm_head.weight"
    keep = mx.ones((weights[head].shape[0], 1)).at[mx.array(never)].multiply(0.0)
    if tied_head:
        embed = "language_model.model.embed_tokens.weight"
        table = weights[embed] * keep / math.sqrt(weights[embed].shape[1])
        weights[embed] = weights[head] = table
    else:
        weights[head] = weights[head] * keep * scale
    return weights


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
