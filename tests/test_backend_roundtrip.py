"""Every cache class, through each backend, written by one process and read by another.

The child process rebuilds each case from its seed (real forward passes of the tiny models
included), dumps it and puts it; this process gets it back, loads it and compares it with
the same case built here: class, plain attributes and stored bits.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cache_cases import ALL_CASES, assert_same, build_case

import mlxcache
from mlxcache.serializers import dump_prompt_cache, load_prompt_cache

TESTS_DIR = str(Path(__file__).parent)


def check_all(backend) -> None:
    for case_id in ALL_CASES:
        record = backend.get(case_id)
        assert record is not None, case_id
        restored, meta = load_prompt_cache(record, return_metadata=True)
        assert meta == {"case": case_id}
        expected = build_case(case_id)
        assert len(restored) == len(expected), case_id
        for a, b in zip(expected, restored, strict=True):
            assert_same(a, b)


def test_every_class_through_memory():
    with mlxcache.open_backend("memory://") as backend:
        for case_id in ALL_CASES:
            backend.put(case_id, dump_prompt_cache(build_case(case_id), meta={"case": case_id}))
        check_all(backend)


@pytest.fixture(params=["file", "redis"])
def shared_uri(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'cache'}"
    return request.getfixturevalue("redis_url")


def test_every_class_through_a_shared_backend_in_another_process(shared_uri):
    child = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        import mlxcache
        from cache_cases import ALL_CASES, build_case
        from mlxcache.serializers import dump_prompt_cache
        with mlxcache.open_backend({shared_uri!r}) as backend:
            for case_id in ALL_CASES:
                record = dump_prompt_cache(build_case(case_id), meta={{"case": case_id}})
                backend.put(case_id, record)
            assert backend.stats()["errors"] == 0
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=180)
    with mlxcache.open_backend(shared_uri) as backend:
        assert len(backend) == len(ALL_CASES)
        check_all(backend)
        assert backend.stats()["errors"] == 0
