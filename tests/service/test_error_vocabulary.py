"""One error vocabulary: every (status, reason) the server can send is built in service/errors.py,
stands in the README's table, and has a typed class and a Reason constant in both clients."""

from __future__ import annotations

import ast
import re

import grpc
import pytest

from tests.harness.servers import ROOT
from tokenspout import errors as client_errors

SERVICE_ERRORS = ROOT / "service" / "errors.py"
# gRPC status names as Connect (the TypeScript client's transport) spells them.
CONNECT_CODES = {code.name: "".join(part.title() for part in code.name.split("_")) for code in grpc.StatusCode}
CONNECT_CODES["CANCELLED"] = "Canceled"


def server_errors() -> set[tuple[str, str]]:
    """(status, reason) of every ServiceError the server builds."""
    found = set()
    for node in ast.walk(ast.parse(SERVICE_ERRORS.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "ServiceError":
            code, reason = node.args[:2]
            found.add((code.attr, reason.value))
    return found


def readme_rows() -> dict[str, set[str]]:
    """The README's error table: status -> the reasons listed under it."""
    section = (ROOT / "README.md").read_text().split("### Errors", 1)[1].split("\n\n", 2)[1]
    rows: dict[str, set[str]] = {}
    status = ""
    for line in section.splitlines()[2:]:
        cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        status = cells[0] or status
        rows.setdefault(status, set()).add(cells[1])
    return rows


def test_the_scan_finds_the_server_errors():
    assert ("ABORTED", "PAUSED_TOO_LONG") in server_errors() and len(server_errors()) >= 15


def test_no_status_is_built_outside_service_errors():
    for path in [*(ROOT / "service").rglob("*.py"), *(ROOT / "backend").rglob("*.py")]:
        if path != SERVICE_ERRORS:
            assert "ServiceError(" not in path.read_text(), path


def test_the_readme_lists_every_status_and_reason():
    rows = readme_rows()
    missing = {(code, reason) for code, reason in server_errors() if reason not in rows.get(code, ())}
    assert not missing, f"README error table lacks {sorted(missing)}"


def test_the_python_client_types_every_status_and_names_every_reason():
    for code, _ in server_errors():
        assert client_errors._CLASSES.get(grpc.StatusCode[code]) not in (None, client_errors.TokenspoutError), code
    assert {reason for _, reason in server_errors()} == {reason.value for reason in client_errors.Reason}


def test_the_typescript_client_types_every_status_and_names_every_reason():
    source = (ROOT / "clients" / "typescript" / "src" / "errors.ts").read_text()
    mapped = set(re.findall(r"\[Code\.(\w+)\]: \w+Error", source))
    for code, _ in server_errors():
        assert CONNECT_CODES[code] in mapped, code
    reasons = re.search(r"export const Reason = \{(.*?)\} as const", source, re.S).group(1)
    assert {reason for _, reason in server_errors()} == set(re.findall(r"^\s+(\w+): \"\1\",$", reasons, re.M))


@pytest.mark.parametrize("code", ["ABORTED", "UNAVAILABLE", "INTERNAL"])
def test_a_status_decodes_to_its_class(code):
    class Failed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode[code]

        def details(self):
            return "why"

        def trailing_metadata(self):
            return ()

    assert type(client_errors.from_rpc_error(Failed())) is client_errors._CLASSES[grpc.StatusCode[code]]
