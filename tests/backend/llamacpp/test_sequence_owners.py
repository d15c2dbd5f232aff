"""Each part of a llama.cpp sequence has one writer: its placement (slot, cached, needs_prefix) only
backend/llamacpp/slots.py, its turn (queue and prefill turns, admissions, pauses, replay) only
backend/llamacpp/scheduler.py. Read from the source: any assignment to one of their fields, through
the sequence or an alias of the part, anywhere else in the engine is a second writer."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from backend.llamacpp.sequence import Placement, Turn

ENGINE = Path(__file__).resolve().parents[3] / "backend" / "llamacpp"
OWNERS = {"place": ("slots.py", Placement), "turn": ("scheduler.py", Turn)}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        else:
            flat.append(target)
    return flat


def writes(source: str) -> set[tuple[str, int]]:
    """(part, line) for each write to a placement or turn field, or to the part itself, in `source`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and len(node.args) > 1:
            if isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.append(node.args[1].value)
        names.extend(target.attr for target in _targets(node) if isinstance(target, ast.Attribute))
        for name in names:
            for part, (_, kind) in OWNERS.items():
                if name == part or name in {field.name for field in dataclasses.fields(kind)}:
                    found.add((part, node.lineno))
    return found


@pytest.mark.parametrize("source, part", [
    ("seq.cached += feed.count", "place"),
    ("place = seq.place\nplace.slot, other = 3, 4", "place"),
    ("seq.place = Placement(2)", "place"),
    ("setattr(seq, 'needs_prefix', False)", "place"),
    ("seq.turn.paused_since = now", "turn"),
    ("turn = leader.turn\nturn.admissions += 1", "turn"),
])
def test_the_scan_finds_a_write_however_it_is_spelled(source, part):
    assert {found for found, _ in writes(source)} == {part}


def test_only_the_owner_writes_each_part_of_a_sequence():
    strangers = []
    for path in sorted(ENGINE.rglob("*.py")):
        for part, line in writes(path.read_text()):
            owner = OWNERS[part][0]
            if path.name not in (owner, "sequence.py"):  # sequence.py makes the empty parts
                strangers.append(f"{path.relative_to(ENGINE)}:{line} writes the sequence's {part} ({owner} owns it)")
    assert strangers == []

