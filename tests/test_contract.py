"""The contract: buf lint, generated stubs in sync with protos/, and request parity."""

from __future__ import annotations

import filecmp
import os
import pathlib
import subprocess
import sys

from tests.harness.servers import ROOT
from tokenspout.v1 import generation_pb2 as pb

BUF = ROOT / "node_modules" / ".bin" / "buf"
GENERATED = ROOT / "clients" / "python"


def run_buf(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(BUF), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_buf_lint_passes():
    result = run_buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_stubs_match_the_protos(tmp_path):
    result = run_buf("generate", "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr
    fresh = sorted(p.relative_to(tmp_path / "clients" / "python") for p in tmp_path.rglob("*.py*"))
    assert fresh, "buf generated nothing"
    for relative in fresh:
        committed = GENERATED / relative
        assert committed.exists(), f"{relative} is not committed: run `make proto`"
        assert filecmp.cmp(committed, tmp_path / "clients" / "python" / relative, shallow=False), (
            f"{relative} is stale: run `make proto`"
        )
    committed_files = sorted(
        p.relative_to(GENERATED) for p in GENERATED.rglob("*_pb2*.py*")
    )
    assert committed_files == fresh, "generated files without a .proto source"


def fields(message) -> list[tuple]:
    return [
        (
            f.name,
            f.number,
            f.type,
            f.is_repeated,
            f.containing_oneof and f.containing_oneof.name,
            f.message_type and f.message_type.full_name,
        )
        for f in message.fields
    ]


def test_unary_and_stream_requests_share_every_field():
    assert fields(pb.GenerateRequest.DESCRIPTOR) == fields(pb.GenerateStreamRequest.DESCRIPTOR)


def test_unary_and_stream_responses_share_every_field():
    assert fields(pb.GenerateResponse.DESCRIPTOR) == fields(pb.GenerateStreamResponse.DESCRIPTOR)


def test_every_package_ships_in_the_distribution():
    import tomllib

    from setuptools import find_packages

    found_by = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    listed = set(find_packages(str(ROOT), include=found_by["include"]))
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("backend", "service")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found and found <= listed, f"not shipped: {sorted(found - listed)}"
