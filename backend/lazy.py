"""A package's exports loaded when first asked for, so importing the package costs nothing.

The package lists its exports as usual, `from module import name` under `if TYPE_CHECKING:` (type checkers
follow them) and in `__all__`; at run time those imports stay unrun, and `exports` reads them from the
package's source to know where each name lives. A process that only reads settings (the supervisor) so
loads none of numpy, llguidance, llama.cpp's bindings or the engines.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import sys
from collections.abc import Callable, Sequence


@functools.cache
def homes(source: str) -> dict[str, str]:
    """Each name the package at `source` (its __file__) imports under an `if`, and the module it comes from."""
    tree = ast.parse(pathlib.Path(source).read_text())
    imports = (node for block in tree.body if isinstance(block, ast.If) for node in ast.walk(block))
    return {alias.name: node.module for node in imports if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names}


def exports(package: str, source: str, names: Sequence[str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's module-level `__getattr__` and `__dir__`: `package` its __name__, `source` its __file__,
    `names` its __all__."""

    def getattr_(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes(source)[name]), name)
        setattr(sys.modules[package], name, value)  # looked up once
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return getattr_, dir_
