"""mlx-vlm 0.7's automatic prefix cache (APC) against ``PrefixCache``, same model, same prompts.

The tiny random-weight Qwen2-VL of ``mlxcache.tiny_models`` with one image (16 image tokens).
APC is driven through mlx-vlm's own ``stream_generate(..., apc_manager=APCManager(...,
disk=DiskBlockStore(...)))`` with its defaults (16-token blocks); ours through
``mlxcache.integrations.mlx_vlm.generate_tokens`` on a ``PrefixCache`` (default 256-token
blocks) over ``memory://`` and ``file://``. Both generate one token (``max_tokens=1``).

Measured for each prompt length:

- uncached TTFT of each (reference), the cold request (empty store: prefill plus storing;
  for APC plus the flush of its background disk writer) and the warm one in the same process;
- the warm request from a **new process** (a child that builds the same model, opens the store
  and warms the kernels on another prompt, untimed, then asks);
- bytes on disk per prompt token;
- a **flipped byte**: one bit of the first value of the largest tensor in every stored file is
  flipped, then a new process asks again: does it reuse the damaged KV, and how far are its
  first-token logits from an uncached run in the same child (max |difference|)?
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats, have

SECTION = "peers"
FAMILY = "qwen2_vl"
APC_NAMESPACE = "bench"


class _Processor:
    """What mlx-vlm's ``stream_generate`` needs of a processor when given ``input_ids``."""

    def __init__(self) -> None:
        from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
        from mlx_vlm.utils import StoppingCriteria

        class _Tok:
            all_special_ids: list[int] = []

            def decode(self, ids: Any, **_: Any) -> str:
                return " ".join(str(int(i)) for i in ids)

        self.tokenizer = _Tok()
        self.tokenizer.stopping_criteria = StoppingCriteria([-1], None)  # never stops early
        self.detokenizer = NaiveStreamingDetokenizer(self.tokenizer)


def _inputs(n: int, seed: int = 1) -> tuple[Any, ...]:
    from benchmarks.ttft_engines import ENGINES

    return ENGINES[FAMILY].inputs(n, seed)


def apc_request(model: Any, proc: Any, inputs: Any, manager: Any) -> dict[str, Any]:
    """One mlx-vlm ``stream_generate`` request (APC when ``manager``): times, reuse, logprobs."""
    import mlx.core as mx
    from mlx_vlm.generate.dispatch import stream_generate

    ids, pixels, kw = inputs
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for r in stream_generate(
        model,
        proc,
        "",
        input_ids=ids,
        pixel_values=pixels,
        apc_manager=manager,
        max_tokens=1,
        **kw,
    ):
        if "ttft" not in out:
            out.update(ttft=time.perf_counter() - t0, cached=int(r.cached_tokens))
            out["logits"] = mx.array(r.logprobs).astype(mx.float32)
    out["total"] = time.perf_counter() - t0
    return out


def ours_request(model: Any, cache: Any, inputs: Any) -> dict[str, Any]:
    """One ``generate_tokens`` request on a ``PrefixCache`` (None: uncached)."""
    import mlx.core as mx

    from mlxcache.integrations.mlx_vlm import stream_generate_tokens

    ids, pixels, kw = inputs
    t0 = time.perf_counter()
    steps = list(stream_generate_tokens(model, ids, pixels, cache=cache, max_tokens=1, **kw))
    total = time.perf_counter() - t0
    r = steps[-1].result
    logits = steps[0].logprobs.astype(mx.float32).reshape(-1)
    return {
        "ttft": r.time_to_first_token,
        "cached": r.cached_tokens,
        "total": total,
        "logits": logits,
    }


def _diff(a: Any, b: Any) -> float:
    import mlx.core as mx

    return float(mx.max(mx.abs(a.reshape(-1) - b.reshape(-1))).item())


def open_apc(root: Path) -> Any:
    from mlx_vlm import apc

    disk = apc.DiskBlockStore(root, namespace=APC_NAMESPACE)
    return apc.APCManager(block_size=apc.DEFAULT_BLOCK_SIZE, disk=disk)


def open_ours(backend: Any, model: Any, salt: str) -> Any:
    """A ``PrefixCache`` on a backend or URI, named by the model's identity."""
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity

    return PrefixCache(backend, model=model_identity(model), salt=salt, hot_bytes=0)


def _child(system: str, store: str, n: int, salt: str) -> dict[str, Any]:
    """In a new process: build the model, open the store, warm up, ask once, compare logits."""
    from mlxcache.tiny_models import build_model

    model, _ = build_model(FAMILY, 0)
    inputs, other = _inputs(n), _inputs(n, seed=7)
    t0 = time.perf_counter()
    if system == "apc":
        proc = _Processor()
        manager = open_apc(Path(store))
        opened = time.perf_counter() - t0
        apc_request(model, proc, other, None)  # kernels warm, untimed, APC untouched
        got = apc_request(model, proc, inputs, manager)
        ref = apc_request(model, proc, inputs, None)
        manager.disk.flush()
    else:
        cache = open_ours(store, model, salt)
        opened = time.perf_counter() - t0
        ours_request(model, None, other)
        got = ours_request(model, cache, inputs)
        ref = ours_request(model, None, inputs)
    return {
        "ttft": got["ttft"],
        "cached": got["cached"],
        "open": opened,
        "diff": _diff(got["logits"], ref["logits"]),
    }


def _run_child(system: str, store: str, n: int, salt: str = "") -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "benchmarks.peers_vlm", system, store, str(n), salt]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"peers child {system} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _dir_bytes(path: Path, suffix: str = "") -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name.endswith(suffix))


def flip_files(path: Path) -> int:
    """Flip a high bit of the first value of the largest float tensor in every safetensors file
    under ``path`` (the KV bytes themselves, not the header); returns the number of files."""
    count = 0
    for f in sorted(path.rglob("*.safetensors")):
        with open(f, "r+b") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            tensors = [
                (v["data_offsets"][1] - v["data_offsets"][0], v["data_offsets"][0], v["dtype"])
                for k, v in header.items()
                if k != "__metadata__" and v["dtype"] in ("BF16", "F16", "F32")
            ]
            if not tensors:
                continue
            size, begin, dtype = max(tensors)
            if size == 0:
                continue
            pos = 8 + n + begin + {"BF16": 1, "F16": 1, "F32": 3}[dtype]  # sign/exponent byte
            fh.seek(pos)
            byte = fh.read(1)[0]
            fh.seek(pos)
            fh.write(bytes([byte ^ 0x40]))
            count += 1
    return count


def _row(name: str, n: int, st: Stats, **kw: Any) -> Row:
    return Row(SECTION, name, n, None, kw.pop("unit", "s"), st, **kw)


def _ratio_row(name: str, n: int, st: Stats, base_name: str, base: Stats, **kw: Any) -> Row:
    return _row(
        name,
        n,
        st,
        baseline=base_name,
        ratio=base.median / st.median,
        ratio_kind="baseline / ours (>1 = ours faster)",
        **kw,
    )


def run(lengths: list[int], ctx: Any) -> list[Row]:
    if not have("mlx_vlm.apc") or not have("mlxcache.integrations.mlx_vlm"):
        ctx.note("mlx-vlm's APC or mlxcache.integrations.mlx_vlm is missing: APC rows left out.")
        return []
    from mlxcache import open_backend
    from mlxcache.tiny_models import build_model

    model, _ = build_model(FAMILY, 0)
    proc = _Processor()
    runs = 1 if ctx.smoke else max(2, min(ctx.repeat, 3))
    rows: list[Row] = []
    for li, n in enumerate(lengths):
        inputs = _inputs(n)
        apc_request(model, proc, _inputs(n, seed=7), None)  # warm kernels, untimed
        file_uri = f"file://{ctx.tmpdir / f'ours-{n}'}"
        backends = {"memory://": open_backend("memory://"), "file://": open_backend(file_uri)}
        t: dict[str, list[float]] = {}
        reuse: dict[str, list[int]] = {}

        def add(key: str, value: float, cached: int | None = None, t=t, reuse=reuse) -> None:
            t.setdefault(key, []).append(value)
            if cached is not None:
                reuse.setdefault(key, []).append(cached)

        apc_root, salt, disk_bytes = ctx.tmpdir, "", 0
        for r in range(runs):  # each run: both uncached, then every cold/warm pair, paired
            u_apc = apc_request(model, proc, inputs, None)["total"]
            u_ours = ours_request(model, None, inputs)["total"]
            add("apc uncached", u_apc)
            add("ours uncached", u_ours)
            apc_root = ctx.tmpdir / f"apc-{n}-{r}"
            manager = open_apc(apc_root)
            c = apc_request(model, proc, inputs, manager)
            t0 = time.perf_counter()
            manager.disk.flush()  # APC writes in a background thread: wait for the bytes
            cold = c["total"] + time.perf_counter() - t0
            add("apc cold", cold)
            add("apc store", cold - u_apc)
            w = apc_request(model, proc, inputs, manager)
            add("apc warm", w["ttft"], w["cached"])
            manager.disk.close()
            disk_bytes = _dir_bytes(apc_root, ".safetensors")
            for label, backend in backends.items():
                salt = uuid.uuid4().hex  # a fresh, empty key space
                cache = open_ours(backend, model, salt)
                c = ours_request(model, cache, inputs)
                add(f"{label} cold", c["total"])
                add(f"{label} store", c["total"] - u_ours)
                w = ours_request(model, cache, inputs)
                add(f"{label} warm", w["ttft"], w["cached"])
        for b in backends.values():
            b.close()
        st = {k: Stats.of(v) for k, v in t.items()}
        rows.append(
            _row("mlx-vlm uncached", n, st["apc uncached"], note="stream_generate, no cache")
        )
        rows.append(
            _row("mlxcache uncached", n, st["ours uncached"], note="generate_tokens, no cache")
        )
        rows.append(
            _row(
                "APC cold request (+ disk flush)",
                n,
                st["apc cold"],
                note=f"store cost {st['apc store'].median * 1e3:.1f} ms over uncached",
                extra={"store_cost_s": st["apc store"].median},
            )
        )
        apc_warm = st["apc warm"]
        rows.append(
            _row(
                "APC warm, same process",
                n,
                apc_warm,
                baseline="mlx-vlm uncached",
                ratio=st["apc uncached"].median / apc_warm.median,
                ratio_kind="uncached / warm",
                note=f"reused {max(reuse['apc warm'])} of {n} tokens",
                extra={"cached_tokens": max(reuse["apc warm"])},
            )
        )
        rows.append(
            _row(
                "APC bytes on disk per token",
                n,
                Stats.of([disk_bytes / n]),
                unit="B",
                extra={"disk_bytes": disk_bytes},
            )
        )
        for label in backends:
            rows.append(
                _row(
                    f"mlxcache {label} cold request",
                    n,
                    st[f"{label} cold"],
                    note=f"store cost {st[f'{label} store'].median * 1e3:.1f} ms over uncached",
                    extra={"store_cost_s": st[f"{label} store"].median},
                )
            )
            got = min(reuse[f"{label} warm"])
            rows.append(
                _ratio_row(
                    f"mlxcache {label} warm, same process",
                    n,
                    st[f"{label} warm"],
                    "APC warm, same process",
                    apc_warm,
                    note=f"reused {got} of {n} tokens",
                    extra={"cached_tokens": got},
                )
            )
        ours_root = Path(file_uri[len("file://") :])
        ours_bytes = _dir_bytes(ours_root / "data", ".safetensors") // runs
        rows.append(
            _row(
                "mlxcache file:// bytes on disk per token",
                n,
                Stats.of([ours_bytes / n]),
                unit="B",
                extra={"disk_bytes": ours_bytes},
            )
        )

        # a new process, warm
        apc_new = [_run_child("apc", str(apc_root), n) for _ in range(runs)]
        ours_new = [_run_child("ours", file_uri, n, salt) for _ in range(runs)]
        a, o = Stats.of([x["ttft"] for x in apc_new]), Stats.of([x["ttft"] for x in ours_new])
        rows.append(
            _row(
                "APC warm, new process (disk)",
                n,
                a,
                note=f"reused {min(x['cached'] for x in apc_new)} tokens; store opened in "
                f"{min(x['open'] for x in apc_new) * 1e3:.0f} ms",
                extra={"cached_tokens": min(x["cached"] for x in apc_new)},
            )
        )
        rows.append(
            _ratio_row(
                "mlxcache file:// warm, new process",
                n,
                o,
                "APC warm, new process (disk)",
                a,
                note=f"reused {min(x['cached'] for x in ours_new)} tokens; store "
                f"opened in {min(x['open'] for x in ours_new) * 1e3:.0f} ms",
                extra={"cached_tokens": min(x["cached"] for x in ours_new)},
            )
        )
        if li == 0:
            rows += _flipped(n, apc_root, apc_new, ours_root, file_uri, ours_new, salt)
    return rows


def _flipped(
    n: int, apc_root: Path, apc_new: list, ours_root: Path, file_uri: str, ours_new: list, salt: str
) -> list[Row]:
    """Flip a byte in every stored file, ask from a new process: reuse and logit distance."""
    rows = []
    for name, root, clean, child in (
        ("APC", apc_root, apc_new, lambda: _run_child("apc", str(apc_root), n)),
        ("mlxcache file://", ours_root, ours_new, lambda: _run_child("ours", file_uri, n, salt)),
    ):
        files = flip_files(root)
        got = child()
        wrong = got["cached"] > 0 and got["diff"] > 100 * max(1e-4, clean[0]["diff"])
        verdict = (
            "served wrong KV"
            if wrong
            else "caught (miss)"
            if got["cached"] < clean[0]["cached"]
            else "reused intact"
        )
        rows.append(
            Row(
                SECTION,
                f"{name} flipped byte, new process",
                n,
                None,
                "max|dlogit|",
                Stats.of([got["diff"]]),
                target="miss, exact logits",
                met=not wrong,
                note=f"{files} file(s) flipped; reused {got['cached']} tokens; {verdict}; "
                f"clean run max|dlogit| {clean[0]['diff']:.2g}",
                extra={
                    "cached_tokens": got["cached"],
                    "clean_diff": clean[0]["diff"],
                    "verdict": verdict,
                },
            )
        )
    return rows


if __name__ == "__main__":
    system, store, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    salt = sys.argv[4] if len(sys.argv) > 4 else ""
    print(json.dumps(_child(system, store, n, salt)))
