"""The examples of README.md and docs/*.md as a reader finds them, and a session that runs a page's examples in
its order against live servers (tests/test_docs_examples.py says what each must give).

A fenced block is an example by its language: `sh` (each command, its continuation lines joined, with the
comment above it), `console` (each `$ ` command, `> ` or a trailing backslash continuing it, and the lines it
prints), `python` and `ts` (the whole snippet). Other blocks (`text`, none) show output or formats.

The pages speak of a server on 127.0.0.1:50051 and metrics on port 9090; a session runs every command against
its own addresses (and writes them back as the page's in what it shows), and replaces the placeholders a test
names (a page's `~/models/my-model.gguf`). `tokenspout serve` starts a server that the page's later commands
talk to, as a reader's second terminal would.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

from tests.harness.servers import ROOT
from tests.harness.typescript import TYPESCRIPT, build_typescript_client

PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
PAGE_ADDRESS = "127.0.0.1:50051"
PAGE_METRICS_PORT = "9090"
_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)
_SERVING = re.compile(r"tokenspout serving \S+ on (\S+:\d+)")


@dataclasses.dataclass(frozen=True)
class Example:
    page: str
    """The page's path from the repository root."""
    line: int
    kind: str
    """sh, console, python or ts."""
    code: str
    comment: str = ""
    prints: tuple[str, ...] = ()
    """console: the lines the page shows the command printing (`…` stands for any text)."""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.code.splitlines()[0][:90]}"


@dataclasses.dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def examples(page: pathlib.Path) -> list[Example]:
    text = page.read_text()
    name = str(page.relative_to(ROOT))
    found: list[Example] = []
    for block in _FENCE.finditer(text):
        indent, language, body = block.groups()
        line = text.count("\n", 0, block.start()) + 2  # the block's first line
        body = "\n".join(row[len(indent):] for row in body.splitlines())
        if language == "sh":
            found += [Example(name, at, "sh", code, comment) for at, code, comment in _sh_commands(body, line)]
        elif language == "console":
            found += [Example(name, at, "console", code, prints=shown) for at, code, shown in _console(body, line)]
        elif language in ("python", "ts"):
            found.append(Example(name, line, language, body + "\n"))
    return found


def _sh_commands(body: str, first_line: int) -> list[tuple[int, str, str]]:
    """Each command (continuations and open quotes joined) with the comment lines above it."""
    commands: list[tuple[int, str, str]] = []
    comment: list[str] = []
    pending: list[str] = []
    start = first_line
    after_command = False
    for number, row in enumerate(body.splitlines(), first_line):
        if not pending:
            if not row.strip():
                continue
            if row.lstrip().startswith("#"):  # a comment after commands starts the next group's
                comment = [] if after_command else comment
                comment.append(row.strip().lstrip("#").strip())
                after_command = False
                continue
            start, after_command = number, True
        pending.append(row)
        joined = "\n".join(pending)
        if not row.endswith("\\") and _complete(joined):
            commands.append((start, joined, " ".join(comment)))
            pending = []
    assert not pending, f"an unfinished command at line {start}"
    return commands


def _complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # an open quote: the command goes on
        return False
    return True


def _console(body: str, first_line: int) -> list[tuple[int, str, tuple[str, ...]]]:
    found: list[tuple[int, list[str], list[str]]] = []
    for number, row in enumerate(body.splitlines(), first_line):
        if row.startswith("$ "):
            found.append((number, [row[2:]], []))
        elif found and not found[-1][2] and (row.startswith("> ") or found[-1][1][-1].endswith("\\")):
            found[-1][1].append(row[2:] if row.startswith("> ") else row)
        elif found:
            found[-1][2].append(row)
    return [(number, "\n".join(code), tuple(shown)) for number, code, shown in found]


def shown_in(prints: tuple[str, ...], output: str) -> str:
    """"" when every shown line is an output line, in the page's order (other lines may come between);
    else what is missing. `…` in a shown line stands for any text."""
    lines = output.splitlines()
    position = 0
    for shown in prints:
        pattern = re.compile(".*".join(re.escape(part) for part in shown.rstrip().split("…")))
        while position < len(lines) and not pattern.fullmatch(lines[position].rstrip()):
            position += 1
        if position == len(lines):
            return f"the page shows {shown!r}, not printed in that order; printed:\n{output}"
        position += 1
    return ""


class PageSession:
    """One page's examples run in its order: a shell whose variables carry from one command to the next, the
    server the page last started (else the shared one), its working folder and its placeholders."""

    def __init__(self, folder: pathlib.Path, address: str, placeholders: dict[str, str], metrics_port: int) -> None:
        self.folder = folder
        self.shared_address = self.address = address
        self.placeholders = placeholders
        self.metrics_port = str(metrics_port)
        self._server: subprocess.Popen[str] | None = None
        self._state = folder / ".shell-state"
        self._bin = pathlib.Path(sys.executable).parent

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{self._bin}:{os.environ.get('PATH', '')}", "TOKENSPOUT_ADDRESS": self.address}

    def localize(self, code: str) -> str:
        """The page's addresses and placeholders as this session's."""
        for placeholder, value in self.placeholders.items():
            code = code.replace(placeholder, value)
        code = code.replace(PAGE_ADDRESS, self.address)
        return re.sub(rf"\b{PAGE_METRICS_PORT}\b", self.metrics_port, code)

    def as_the_page_says(self, text: str) -> str:
        """Output with this session's addresses written back as the page's."""
        for address in {self.address, self.shared_address}:
            text = text.replace(address, PAGE_ADDRESS)
        return text.replace(f":{self.metrics_port}", f":{PAGE_METRICS_PORT}")

    def run(self, example: Example, keep_state: bool = True) -> Ran:
        """`keep_state=False` for runs side by side (a sampled example's): they leave the shell's variables be."""
        command = example.code
        if example.kind == "python":
            return self._finished(subprocess.run([sys.executable, "-"], input=self.localize(command), cwd=self.folder,
                                                 env=self.environment(), capture_output=True, text=True, timeout=180))
        if re.match(r"(\w+=\S+ )*tokenspout serve\b", command):
            return self.serve(command)
        return self.shell(command, keep_state)

    def shell(self, command: str, keep_state: bool = True) -> Ran:
        """The command in bash, after the variables earlier commands set (every assignment is kept)."""
        state = shlex.quote(str(self._state))
        script = (f"set -a\n[ -f {state} ] && . {state}\nexport TOKENSPOUT_ADDRESS={shlex.quote(self.address)}\n"
                  f"{self.localize(command)}\nstatus=$?\n{f'export -p > {state}' if keep_state else ''}\n"
                  "exit $status\n")
        return self._finished(subprocess.run(["bash", "-c", script], cwd=self.folder, env=self.environment(),
                                             capture_output=True, text=True, timeout=180))

    def serve(self, command: str, timeout_s: float = 120) -> Ran:
        """Starts the page's server (on a free port where the page says 50051 or nothing), stopping the one
        before; its output until it serves (or exits) is what it printed. Later commands talk to it."""
        self.stop()
        command = self.localize(command).replace("0.0.0.0:50051", "127.0.0.1:0")
        log = self.folder / f"server-{time.monotonic_ns()}.log"
        with open(log, "w") as out:
            self._server = subprocess.Popen(
                ["bash", "-c", f"set -a; [ -f .shell-state ] && . ./.shell-state; exec env {command}"], cwd=self.folder,
                env={**self.environment(), "TOKENSPOUT_LISTEN": "127.0.0.1:0"}, stdout=out, stderr=subprocess.STDOUT,
                text=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            printed = log.read_text()
            if match := _SERVING.search(printed):
                self.address = match.group(1)
                return Ran(0, self.as_the_page_says(printed), "")
            if self._server.poll() is not None:
                returncode, self._server = self._server.returncode, None
                return Ran(returncode, self.as_the_page_says(printed), "")
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"`{command}` did not serve within {timeout_s} s:\n{log.read_text()}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.terminate()
            assert self._server.wait(timeout=60) == 0
            self._server = None
        self.address = self.shared_address

    def _finished(self, result: subprocess.CompletedProcess[str]) -> Ran:
        return Ran(result.returncode, self.as_the_page_says(result.stdout), self.as_the_page_says(result.stderr))


def compile_typescript(snippets: list[str], folder: pathlib.Path) -> list[pathlib.Path]:
    """The snippets as a reader's project of their own would build them, importing the client package by name
    (clients/typescript, its dist built): type-checked by tsc (strict), and the JavaScript to run."""
    package = TYPESCRIPT
    build_typescript_client()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "node_modules" / "@tokenspout").mkdir(parents=True, exist_ok=True)
    link = folder / "node_modules" / "@tokenspout" / "client"
    if not link.exists():
        link.symlink_to(package)
    (folder / "package.json").write_text('{"type": "module"}\n')
    (folder / "tsconfig.json").write_text(
        '{"compilerOptions": {"target": "ES2022", "module": "NodeNext", "moduleResolution": "NodeNext", '
        f'"strict": true, "skipLibCheck": true, "outDir": "out", "typeRoots": ["{package}/node_modules/@types"], '
        '"types": ["node"]}, "include": ["*.ts"]}\n')
    for index, snippet in enumerate(snippets):
        (folder / f"snippet{index}.ts").write_text(snippet)
    result = subprocess.run([str(package / "node_modules" / ".bin" / "tsc"), "-p", "tsconfig.json"], cwd=folder,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"the pages' TypeScript does not compile:\n{result.stdout}{result.stderr}"
    return [folder / "out" / f"snippet{index}.js" for index in range(len(snippets))]
