"""``mlxcache import`` / ``export``: mlx-lm prompt-cache files to records and back.

The exported file is read by mlx-lm itself (``load_prompt_cache`` and ``mlx_lm generate
--prompt-cache-file``) and continues exactly as the original file does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    QuantizedKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

from mlxcache import Record, open_backend
from mlxcache.cli import main
from mlxcache.tiny_models import build_tiny_lm


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = str(build_tiny_lm(tmp_path_factory.mktemp("lm") / "tiny", hidden_size=128))
    model, tokenizer = mlx_lm.load(path)
    return path, model, tokenizer


def prompt_file(lm, folder, quantized=False):
    """What ``mlx_lm.cache_prompt`` writes: the prefilled cache plus model/tokenizer metadata."""
    path, model, tokenizer = lm
    ids = tokenizer.encode("The cache keeps what the model has already computed.")
    cache = make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    if quantized:
        cache = [c.to_quantized(group_size=32, bits=8) for c in cache]
    mx.eval([c.state for c in cache])
    out = str(folder / ("q.safetensors" if quantized else "prompt.safetensors"))
    save_prompt_cache(out, cache, {"model": path, "tokenizer_config": json.dumps({})})
    return out, cache


def bits(x):
    return x.view(mx.uint8)


def same_state(a, b):
    assert [type(c) for c in a] == [type(c) for c in b]
    for x, y in zip(a, b, strict=True):
        assert x.offset == y.offset
        n = x.offset
        for (_, u), (_, v) in zip(tree_flatten(x.state), tree_flatten(y.state), strict=True):
            assert isinstance(u, mx.array) == isinstance(v, mx.array)
            if isinstance(u, mx.array) and u.ndim == 4:
                assert mx.array_equal(bits(u[..., :n, :]), bits(v[..., :n, :]))


@pytest.mark.parametrize("quantized", [False, True])
def test_import_export_round_trip(lm, tmp_path, capsys, quantized):
    original, cache = prompt_file(lm, tmp_path, quantized)
    uri = f"file://{tmp_path}/c"
    assert main(["import", original, uri]) == 0
    key = "mlx-lm/" + os.path.basename(original)[: -len(".safetensors")]
    assert key in capsys.readouterr().out
    out = str(tmp_path / "back.safetensors")
    assert main(["export", uri, key, out]) == 0
    back, metadata = load_prompt_cache(out, return_metadata=True)
    _, meta0 = load_prompt_cache(original, return_metadata=True)
    assert metadata == meta0
    same_state(cache, back)
    if quantized:
        assert isinstance(back[0], QuantizedKVCache)
    else:  # the exported cache continues exactly as the original does
        _, model, _ = lm
        a = model(mx.array([[5, 6]]), cache=load_prompt_cache(original))
        b = model(mx.array([[5, 6]]), cache=back)
        assert mx.array_equal(a, b)


def test_mlx_lm_generate_reads_the_exported_file(lm, tmp_path):
    original, _ = prompt_file(lm, tmp_path)
    uri = f"file://{tmp_path}/c"
    assert main(["import", original, uri, "--key", "team/prompt"]) == 0
    out = str(tmp_path / "exported.safetensors")
    assert main(["export", uri, "team/prompt", out]) == 0
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    def generate(cache_file):
        args = [sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file", cache_file]
        args += ["--prompt", " Then", "--max-tokens", "6", "--ignore-chat-template"]
        run = subprocess.run(args, env=env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.split("==========")[1]

    text = generate(out)
    assert text.strip() and text == generate(original)


def test_errors_are_one_line(lm, tmp_path, capsys):
    uri = f"file://{tmp_path}/c"
    assert main(["import", str(tmp_path / "missing.safetensors"), uri]) == 1
    assert "no such file" in capsys.readouterr().err
    junk = str(tmp_path / "junk.safetensors")
    mx.save_safetensors(junk, {"x": mx.zeros((2,))})
    assert main(["import", junk, uri]) == 1
    err = capsys.readouterr().err
    assert "not an mlx-lm prompt-cache file" in err and len(err.strip().splitlines()) == 1
    assert main(["export", uri, "nope", str(tmp_path / "o.safetensors")]) == 1
    assert "no such key: nope" in capsys.readouterr().err
    with open_backend(uri) as b:
        b.put("plain", Record({"x": mx.zeros((3,))}, {}))
    assert main(["export", uri, "plain", str(tmp_path / "o.safetensors")]) == 1
    assert "holds no prompt cache" in capsys.readouterr().err
    original, _ = prompt_file(lm, tmp_path)
    assert main(["import", original, uri]) == 0
    assert main(["export", uri, "mlx-lm/prompt", str(tmp_path / "o.bin")]) == 1
    assert "end in .safetensors" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_a_backend_that_refuses_is_an_error(lm, tmp_path, capsys):
    original, _ = prompt_file(lm, tmp_path)
    assert main(["import", original, "memory://?max_bytes=100"]) == 1
    assert "did not keep" in capsys.readouterr().err
