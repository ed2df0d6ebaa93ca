"""``python -m benchmarks.sizing``: KV cache bytes per token of common models, from their configs.

bytes/token = layers x kv_heads x head_dim x 2 (keys and values) x bytes per element. The
config fields below are copied from the models' published ``config.json`` (text part for the
VLMs); nothing is downloaded. 8-bit and 4-bit rows are mlx-lm's QuantizedKVCache (group 64:
one bf16 scale and one bf16 bias per 64 elements). The table goes in docs/operations.md.
"""

from __future__ import annotations

# name: (num_hidden_layers, num_key_value_heads, head_dim, sliding-window note)
MODELS: dict[str, tuple[int, int, int, str]] = {
    "Llama-3.2-1B": (16, 8, 64, ""),
    "Llama-3.2-3B": (28, 8, 128, ""),
    "Llama-3.1-8B / Mistral-7B": (32, 8, 128, ""),
    "Llama-3.1-70B": (80, 8, 128, ""),
    "Qwen2-VL-2B": (28, 2, 128, ""),
    "Qwen2.5-VL-3B": (36, 2, 128, ""),
    "Qwen2-VL-7B / Qwen2.5-VL-7B": (28, 4, 128, ""),
    "Qwen3-8B": (36, 8, 128, ""),
    "Gemma-3-4B": (34, 4, 256, "5 of 6 layers keep 1024 tokens"),
    "Gemma-3-12B": (48, 8, 256, "5 of 6 layers keep 1024 tokens"),
    "Gemma-3-27B": (62, 16, 128, "5 of 6 layers keep 1024 tokens"),
}
GROUP = 64


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, bits: int = 16) -> float:
    elems = layers * kv_heads * head_dim * 2
    if bits == 16:
        return elems * 2.0
    return elems * (bits / 8 + 4 / GROUP)  # + bf16 scale and bias per group


def _mib(n: float) -> str:
    return f"{n / 1024**2:,.0f} MiB" if n >= 1024**3 else f"{n / 1024**2:,.1f} MiB"


def table() -> str:
    lines = [
        "| model | layers x kv heads x head dim | bf16 / token | 8-bit / token "
        "| 4096 tokens bf16 | 256-token block bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for name, (layers, kv, hd, note) in MODELS.items():
        bf16 = bytes_per_token(layers, kv, hd)
        q8 = bytes_per_token(layers, kv, hd, 8)
        shape = f"{layers} x {kv} x {hd}" + (f" ({note})" if note else "")
        lines.append(
            f"| {name} | {shape} | {bf16 / 1024:,.0f} KiB | {q8 / 1024:,.0f} KiB "
            f"| {_mib(bf16 * 4096)} | {_mib(bf16 * 256)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
