"""The TypeScript client package (clients/typescript) built once for every test that runs it: under a file
lock, so test processes running side by side (pytest-xdist) never rewrite dist/ while another reads it."""

from __future__ import annotations

import fcntl
import subprocess

from tests.harness.servers import ROOT

TYPESCRIPT = ROOT / "clients" / "typescript"
_LOCK = ROOT / "build" / "typescript-client.lock"


def build_typescript_client() -> None:
    """`npm run build` when dist/ is missing or older than a source or the build's settings, else nothing."""
    assert (TYPESCRIPT / "node_modules").is_dir(), "run `make tools` (npm ci in clients/typescript)"
    _LOCK.parent.mkdir(exist_ok=True)
    with open(_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = TYPESCRIPT / "dist" / "index.js"
        sources = [*(TYPESCRIPT / "src").rglob("*.ts"), TYPESCRIPT / "tsconfig.json", TYPESCRIPT / "package.json"]
        if built.exists() and max(f.stat().st_mtime for f in sources) <= built.stat().st_mtime:
            return
        build = subprocess.run(["npm", "run", "--silent", "build"], cwd=TYPESCRIPT, capture_output=True, text=True,
                               timeout=300)
        assert build.returncode == 0, build.stdout + build.stderr
