"""The servers of the agent workload over HTTP (benchmarks/agents_servers.py): each engine's stock
server and ``mlxcache serve --engine ...``, the tiny model folders they load, and their tokenizers.

- mlx-lm: ``mlx_lm.server`` (its ``LRUPromptCache``) against ``mlxcache serve --engine mlx-lm``
  (its ``SharedPromptCache``) on tiny random-weight folders of mlx-lm's own test dimensions
  (``tests/families/mlx_lm_configs.json``: glm, olmo3 with a 128-token window, llama4 chunked
  at 128 tokens, qwen3_5) with the tiny llama's tokenizer;
- mlx-vlm: ``mlx_vlm.server`` with its APC on (``APC_ENABLED=1``, its disk tier in a folder the
  servers of one side share) against ``mlxcache serve --engine mlx-vlm`` on the tiny VLM folders
  of ``mlxcache.tiny_models`` (qwen2_vl, gemma3, qwen3_5), text prompts;
- vllm-mlx: ``vllm-mlx serve`` as shipped (its prefix cache on) against ``mlxcache serve
  --engine vllm-mlx``, in the vllm-mlx venv, with ``--continuous-batching`` and in its default
  mode, on the mlx-lm folders.

Every server prefills in steps of one block (``--prefill-step-size``; vllm-mlx's default mode has
no such option: 2,048), so a hit on a block boundary resumes on the stock server's own splits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.http_server import launch

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "families" / "mlx_lm_configs.json"
VLLM_PYTHON = os.environ.get("MLXCACHE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
NAME = "tiny"  # the served model name (vllm-mlx requires "model" in every request)
LM_GROUPS = {"dense": "glm", "sliding": "olmo3", "chunked": "llama4", "recurrent": "qwen3_5"}
# the cache class that makes a model a member of its group (mlx-lm 0.32's llama4_text makes
# plain KVCache layers: llama4's are chunked), checked on every model the benchmarks build
GROUP_CACHE = {"dense": "KVCache", "sliding": "RotatingKVCache", "chunked": "ChunkedKVCache",
               "recurrent": "ArraysCache"}  # fmt: skip
# llama4's chunked layers at 128 tokens (the test configs' 8 would be a quarter block): a
# conversation's prompt crosses chunk ends
CHUNK = 128
SCALE = 4.0
VLM_GROUPS = {"dense": "qwen2_vl", "sliding": "gemma3", "recurrent": "qwen3_5"}


def lm_config(family: str) -> dict[str, Any]:
    """mlx-lm's test config of ``family`` (tests/families/mlx_lm_configs.json), with llama4's
    chunked layers at ``CHUNK`` tokens: the one place the benchmarks' tiny configs are made."""
    cfg: dict[str, Any] = json.loads(CONFIGS.read_text())[family]
    if "attention_chunk_size" in cfg.get("text_config", {}):
        cfg["text_config"]["attention_chunk_size"] = CHUNK
    return cfg


def cache_layers(group: str, model: Any) -> list[str]:
    """The class names of ``model``'s cache layers; raises unless they make it a member of
    ``group`` (``GROUP_CACHE``: dense holds KVCache only), so a row cannot be mislabelled."""
    from mlx_lm.models.cache import make_prompt_cache

    names = [type(c).__name__ for c in make_prompt_cache(model)]
    want = GROUP_CACHE[group]
    if not (set(names) == {want} if group == "dense" else want in names):
        raise ValueError(f"the {group} group needs {want} layers; this model makes {names}")
    return names


def lm_model(cfg: dict[str, Any]) -> Any:
    """A seeded random-weight mlx-lm model of ``cfg``, its group's cache layers checked when
    its family is one of ``LM_GROUPS``."""
    import importlib

    import mlx.core as mx

    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    for group, family in LM_GROUPS.items():
        if family == cfg["model_type"]:
            cache_layers(group, model)
    return model


def lm_folder(family: str, path: Path) -> Path:
    """A model folder ``mlx_lm.load`` opens offline: the tiny llama's tokenizer and seeded random
    weights of ``family`` at mlx-lm's test dimensions (``lm_config``), an untied head and the
    embeddings scaled (as ``build_tiny_vlm``'s) so the greedy answer depends on the prompt; the
    head never picks a special token or a non-ASCII byte, so an answer's text re-tokenizes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer

    from mlxcache.tiny_models import build_tiny_lm
    from mlxcache.tiny_models.tokenizer import never_ids

    out = build_tiny_lm(path)
    base = json.loads((out / "config.json").read_text())
    cfg = lm_config(family)
    cfg.update({k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id")})
    if "text_config" in cfg:
        cfg["text_config"].update(vocab_size=base["vocab_size"])
    weights = dict(tree_flatten(lm_model(cfg).parameters()))
    never = never_ids(Tokenizer.from_file(str(out / "tokenizer.json")))
    keep = mx.ones((int(cfg["vocab_size"]), 1)).at[mx.array(never)].multiply(0.0)
    heads = [k for k in weights if k.endswith("lm_head.weight")]
    for k in weights:  # an untied head and embeddings scaled as build_tiny_vlm's
        if k.endswith("embed_tokens.weight"):
            weights[k] = weights[k] * SCALE if heads else weights[k] * keep
        elif k in heads:
            weights[k] = weights[k] * SCALE * keep
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def vlm_folder(family: str, path: Path) -> Path:
    from mlxcache.tiny_models import build_tiny_vlm

    return build_tiny_vlm(path, family=family)


class LmTokens:
    """Prompt ids as mlx-lm's server (and vllm-mlx's) builds them: the chat template applied."""

    def __init__(self, folder: Path) -> None:
        from mlx_lm.tokenizer_utils import load

        self.tok = load(folder)

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


class VlmTokens:
    """Prompt ids as mlx-vlm's server builds them for a text-only request."""

    def __init__(self, folder: Path) -> None:
        from mlx_vlm.utils import load_config, load_processor

        self.processor = load_processor(folder)
        self.config = load_config(folder)
        self.tok = getattr(self.processor, "tokenizer", self.processor)

    def prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        from mlx_vlm.prompt_utils import apply_chat_template
        from mlx_vlm.utils import prepare_inputs

        text = apply_chat_template(self.processor, self.config, messages, num_images=0)
        return [int(t) for t in prepare_inputs(self.processor, prompts=text)["input_ids"][0]]

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


class HttpServer:
    """One server subprocess on a free loopback port (its own ``$HOME``), log to a file."""

    def __init__(self, args: list[str], log: Path, home: Path, env: dict[str, str],
                 model: str | None) -> None:  # fmt: skip
        self.model = model
        home.mkdir(parents=True, exist_ok=True)  # vllm-mlx's own disk cache lives under ~
        full = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(home))
        full["PYTHONPATH"] = str(ROOT)  # this checkout's mlxcache, in the vllm-mlx venv too
        full.pop("APC_ENABLED", None)
        full.update(env)
        self.log_path, self._read = log, log.stat().st_size if log.exists() else 0
        self.proc, self.port, self._log = launch(args, full, log, cwd=ROOT)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def chat(self, messages: list[dict[str, Any]], max_tokens: int, salt: str | None,
             stream: bool = False) -> tuple[str, int, int | None]:  # fmt: skip
        """(text, prompt_tokens, cached_tokens or None) of one greedy chat completion; with
        ``stream``, over server-sent events with the usage chunk at the end."""
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens,
                                "temperature": 0.0}  # fmt: skip
        body.update({} if self.model is None else {"model": self.model})
        body.update({} if salt is None else {"cache_salt": salt})
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        req = urllib.request.Request(self.url("/v1/chat/completions"), json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        parts, usage = [], None
        with urllib.request.urlopen(req, timeout=600) as r:
            if not stream:
                out = json.load(r)
                parts, usage = [out["choices"][0]["message"]["content"] or ""], out["usage"]
            for raw in r if stream else ():
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[len("data: ") :])
                    for choice in chunk.get("choices") or ():
                        parts.append((choice.get("delta") or {}).get("content") or "")
                    usage = chunk.get("usage") or usage
        assert usage is not None, "no usage in the answer"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return "".join(parts), int(usage["prompt_tokens"]), None if cached is None else int(cached)

    def saved(self) -> int:
        """``tokens_saved`` of vllm-mlx's own ``GET /v1/cache/stats`` so far."""
        with urllib.request.urlopen(self.url("/v1/cache/stats"), timeout=30) as r:
            stats = json.load(r).get("engine_cache") or {}
        return int(stats.get("tokens_saved") or 0)

    def system_hits(self) -> int:
        """Tokens vllm-mlx's default mode reused from its own system-prompt KV snapshots since
        the last call, as its log says (``System KV cache HIT``: in no usage and no stats)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._read)
            text = f.read().decode(errors="replace")
        self._read += len(text.encode(errors="replace"))
        return sum(int(n) for n in re.findall(r"System KV cache HIT[^:]*: reusing (\d+)", text))

    def kill(self) -> None:
        """SIGKILL: nothing flushes, nothing is saved at shutdown."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


@dataclass
class Engine:
    """How to start one engine's stock server and ours on a model folder."""

    name: str
    groups: dict[str, str]
    folder: Callable[[str, Path], Path]
    tokens: Callable[[Path], Any]
    stock: Callable[[str, int], list[str]]  # (folder, block) -> command
    ours: Callable[[str, str, int], list[str]]  # (folder, cache URI, block) -> command
    stock_env: Callable[[Path], dict[str, str]] = lambda _: {}  # (the side's folder) -> env
    model: Callable[[str], str | None] = lambda _: None  # (folder) -> a request's "model"
    vllm: bool = False  # stock counts from vllm-mlx's own stats (it reports no cached_tokens)
    unserved: dict[str, str] = field(default_factory=dict)  # group -> why neither server runs it
    stream: bool = False  # requests streamed (vllm-mlx's default mode caches on that path only)


def _step(block: int) -> list[str]:
    return ["--prefill-step-size", str(block)]


def _ours(engine: str, folder: str, uri: str, block: int) -> list[str]:
    return [sys.executable, "-m", "mlxcache", "serve", "--engine", engine, "--model", folder,
            "--cache", uri, "--cache-block-size", str(block), *_step(block)]  # fmt: skip


def _vllm(batching: bool) -> tuple[Callable[..., list[str]], Callable[..., list[str]]]:
    def mode(block: int) -> list[str]:
        return ["--continuous-batching", *_step(block)] if batching else []

    def stock(folder: str, block: int) -> list[str]:
        return [VLLM_PYTHON, "-m", "vllm_mlx.cli", "serve", folder, *mode(block),
                "--served-model-name", NAME]  # fmt: skip

    def ours(folder: str, uri: str, block: int) -> list[str]:
        return [VLLM_PYTHON, "-m", "mlxcache", "serve", "--engine", "vllm-mlx", "--model", folder,
                *mode(block), "--cache", uri, "--cache-block-size", str(block),
                "--served-model-name", NAME]  # fmt: skip

    return stock, ours


# llama4 on vllm-mlx 0.6 (mlx-lm 0.31): the stock server fails as ours does
BATCHED_CHUNKS = (
    "mlx-lm 0.31's BatchGenerator raises 'ChunkedKVCache does not yet support batching with "
    "history' (the stock server answers 500)"
)
SIMPLE_CHUNKS = (
    "its uncached stream path (a model with ChunkedKVCache layers goes there) fails with "
    "'[broadcast_shapes] Shapes (1,0) and (1,4,1,67) cannot be broadcast' (the stock server "
    "streams an error)"
)


def engines(vllm: bool) -> list[Engine]:
    """mlx-lm, mlx-vlm and (``vllm``: its venv exists) vllm-mlx in both modes."""
    out = [
        Engine(
            "mlx-lm",
            LM_GROUPS,
            lm_folder,
            LmTokens,
            lambda f, b: [sys.executable, "-m", "mlx_lm.server", "--model", f, *_step(b)],
            lambda f, u, b: _ours("mlx-lm", f, u, b),
        ),
        Engine(
            "mlx-vlm",
            VLM_GROUPS,
            vlm_folder,
            VlmTokens,
            lambda f, b: [sys.executable, "-m", "mlx_vlm.server", "--model", f, *_step(b)],
            lambda f, u, b: _ours("mlx-vlm", f, u, b),
            stock_env=lambda d: {"APC_ENABLED": "1", "APC_DISK_PATH": str(d / "apc")},
            model=lambda f: f,
        ),
    ]
    for batching in (True, False) if vllm else ():
        stock, ours = _vllm(batching)
        label = "vllm-mlx --continuous-batching" if batching else "vllm-mlx default mode"
        unserved = {"chunked": BATCHED_CHUNKS if batching else SIMPLE_CHUNKS}
        out.append(Engine(label, LM_GROUPS, lm_folder, LmTokens, stock, ours, vllm=True,
                          model=lambda _: NAME, unserved=unserved,
                          stream=not batching))  # fmt: skip
    return out
