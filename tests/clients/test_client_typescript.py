"""The TypeScript client (clients/typescript): its node --test suite against live servers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.harness.servers import REPORT, start_server, stop_server
from tests.harness.typescript import TYPESCRIPT, build_typescript_client


def test_typescript_client_against_live_servers(server, tmp_path):
    build_typescript_client()
    full = start_server(
        tmp_path, "--max-batch-size", "1", "--max-queued-requests", "0", "--context-length", "1024"
    )
    try:
        env = {
            **os.environ,
            "TOKENSPOUT_ADDRESS": server.address,
            "TOKENSPOUT_FULL_ADDRESS": full.address,
            "PYTHON": sys.executable,
        }
        test_files = sorted(str(path) for path in (TYPESCRIPT / "test").glob("*.test.mjs"))
        result = subprocess.run(["node", "--test", *test_files], cwd=TYPESCRIPT, env=env, capture_output=True,
                                text=True, timeout=240)
    finally:
        stop_server(full)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = re.search(r"^# pass (\d+)", result.stdout, re.MULTILINE)
    assert passed and int(passed.group(1)) >= 6, result.stdout
    REPORT.append(f"typescript client: {passed.group(1)} node tests passed")


def test_typescript_affinity_key_matches_the_shared_vectors():
    """No server: the TypeScript client's affinity key against clients/affinity-vectors.json."""
    build_typescript_client()
    result = subprocess.run(["node", "--test", "test/affinity.test.mjs"], cwd=TYPESCRIPT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^# pass 3$", result.stdout, re.MULTILINE), result.stdout
