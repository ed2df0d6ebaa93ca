"""A tiny random-weight llama-shaped mlx-lm model folder, built here (nothing downloaded)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx

from mlxcache.tiny_models.tokenizer import never_ids, train_bpe

LM_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
LM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_LM_TEXT = """\
The cache keeps what the model has already computed, so a repeated prompt skips its prefill.
A prompt is split into blocks of tokens; each block is named by a hash of every token before it.
Two servers that share a store find each other's blocks, and a restarted server finds its own.
Memory is fast and small, a disk is larger and survives a restart, and a network store is shared
by many machines. When a store fails, the request runs without it and answers the same text.
Hello, how are you today? I am fine, thank you. What is the weather like in the city tonight?
Tell me a story about a cat, a dog and a bird who travel over the hills to the sea.
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > . , ; : ! ? ' " # @ & % $
"""


def build_tiny_lm(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
) -> Path:
    """Write a random-weight llama-shaped mlx-lm model folder at ``path`` and return its path.

    ``mlx_lm.load(path)`` opens it with nothing downloaded: ``config.json``,
    ``model.safetensors`` (weights from ``mx.random.seed(seed)``), a byte-level BPE
    ``tokenizer.json`` trained on a built-in text and a ``tokenizer_config.json`` with a small
    chat template. The same arguments give the same bytes. The output head never picks a special
    token or a non-ASCII byte (their rows are zero), so greedy generation always runs to
    ``max_tokens`` and its text is printable ASCII.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe(_LM_TEXT, LM_SPECIAL_TOKENS, vocab_size, unk="<unk>")
    vocab_size = tokenizer.get_vocab_size()
    never = never_ids(tokenizer)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id("<s>"),
        "eos_token_id": tokenizer.token_to_id("</s>"),
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    keep = mx.ones((vocab_size, 1)).at[mx.array(never)].multiply(0.0)
    weights["lm_head.weight"] = weights["lm_head.weight"] * keep
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 32768,
        "chat_template": LM_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out
