"""The contract as other languages see it: breaking changes against the released protos, generator
options, and the TypeScript code generated from protos/ in sync with it."""

from __future__ import annotations

import filecmp
import os
import pathlib
import shutil
import subprocess
import sys

from tests.harness.servers import ROOT
from tokenspout.v1 import generation_pb2 as pb

BUF = ROOT / "node_modules" / ".bin" / "buf"
RELEASED = ROOT / "protos" / "released" / "tokenspout-v1.json"
TYPESCRIPT = ROOT / "clients" / "typescript"


def run_buf(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(BUF), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_no_breaking_change_since_the_release():
    result = run_buf("breaking", "--against", str(RELEASED))
    assert result.returncode == 0, "breaking changes against protos/released:\n" + result.stdout + result.stderr


def test_the_breaking_check_catches_a_removed_field_and_a_changed_package_option(tmp_path):
    shutil.copy(ROOT / "buf.yaml", tmp_path)
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("released"))
    proto = tmp_path / "protos" / "tokenspout" / "v1" / "generation.proto"
    text = proto.read_text()
    edited = text.replace("  string constraint_message = 8;\n", "", 1).replace(
        'option java_package = "dev.tokenspout.v1";', 'option java_package = "dev.tokenspout.api";', 1
    )
    assert edited.count("constraint_message") == text.count("constraint_message") - 1
    proto.write_text(edited)
    result = run_buf("breaking", "--against", str(RELEASED), cwd=tmp_path)
    assert result.returncode != 0
    assert 'Previously present field "8" with name "constraint_message"' in result.stdout, result.stdout
    assert "java_package" in result.stdout


def test_generator_options_for_other_languages():
    options = pb.DESCRIPTOR.GetOptions()
    assert options.go_package.endswith(";tokenspoutv1")
    assert options.java_package == "dev.tokenspout.v1" and options.java_multiple_files
    assert options.csharp_namespace == "Tokenspout.V1"
    assert options.php_namespace == "Tokenspout\\V1" and options.ruby_package == "Tokenspout::V1"
    assert len(options.objc_class_prefix) >= 3


def test_typescript_code_matches_the_protos(tmp_path):
    result = run_buf("generate", str(ROOT / "protos"), "--template", "buf.gen.yaml", "--output", str(tmp_path),
                     cwd=TYPESCRIPT)
    assert result.returncode == 0, result.stderr
    fresh = tmp_path / "src" / "gen" / "tokenspout" / "v1" / "generation_pb.ts"
    committed = TYPESCRIPT / "src" / "gen" / "tokenspout" / "v1" / "generation_pb.ts"
    assert filecmp.cmp(fresh, committed, shallow=False), "clients/typescript/src/gen is stale: run `make proto`"
