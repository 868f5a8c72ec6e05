"""The layers of ``atlasfs/`` hold: no module imports from a layer above its own.

From the bottom up (docs/architecture.md): the layer-free helpers at the top of the
package (``errors``, ``sizes``, ``memory``, ``progress``, ``blockcache``...), ``storage/``
(where bytes come from), ``formats/`` (one room per format, with the contract every
format answers: ``source``, ``naming``), ``tree/`` (the file tree, tables, tar view),
``options`` (the one table of settings, made from the layers below), ``fuse/`` (FUSE
calls to Tree calls) and ``commands/`` (the command lines). A module may import its own
layer and those below. ``ray`` is imported only under ``atlasfs/ray/``, so that
atlasfs without Ray installed imports everywhere else.

Imports are read from the source (``ast``), not by importing: the ones inside functions,
under ``TYPE_CHECKING`` and given to ``importlib.import_module`` as a constant count too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "atlasfs"

#: Each layer's rank: a module may import modules of its rank or lower. The key is the
#: first name below ``atlasfs`` (a sub-package or a top-level module).
RANKS: dict[str, int] = {
    "": 0, "errors": 0, "sizes": 0, "memory": 0, "progress": 0, "blockcache": 0, "wids_in_place": 0,
    "storage": 1,
    "formats": 2,
    "tree": 3,
    "options": 4,
    "fuse": 5,
    "commands": 6, "__main__": 6, "ray": 6,
}
#: The only layer that may import the ``ray`` package.
RAY_LAYER = "ray"


@dataclass(frozen=True)
class Import:
    """One import of a module: the importing file, its line and the module imported."""

    path: Path
    line: int
    module: str


def module_name(package: Path, path: Path) -> str:
    """The dotted name of the module at ``path`` in ``package`` (a package is its ``__init__``)."""
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _relative_base(name: str, path: Path, level: int) -> str:
    """What ``from .`` (``level`` dots) means in the module ``name`` at ``path``."""
    parts = name.split(".")
    if path.name != "__init__.py":
        parts.pop()
    return ".".join(parts[:len(parts) - level + 1])


def _from_targets(node: ast.ImportFrom, name: str, path: Path, package: Path) -> list[str]:
    """The modules a ``from X import a, b`` imports: ``X.a`` where ``a`` is a submodule, else ``X``."""
    base = node.module or ""
    if node.level:
        base = _relative_base(name, path, node.level) + ("." + base if base else "")
    targets = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        is_module = _module_path(package, sub) is not None
        targets.append(sub if is_module else base)
    return targets


def _module_path(package: Path, dotted: str) -> Path | None:
    """The file of the module ``dotted`` under ``package``, or None if it is not one of its."""
    parts = dotted.split(".")
    if parts[0] != package.name:
        return None
    here = package.joinpath(*parts[1:])
    for candidate in (here.with_suffix(".py"), here / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dynamic_target(node: ast.Call) -> str | None:
    """The module of ``importlib.import_module("...")`` or ``__import__("...")`` with a constant."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports_of(package: Path, path: Path) -> list[Import]:
    """Every module the file at ``path`` imports, wherever in the file the import is."""
    name = module_name(package, path)
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = _from_targets(node, name, path, package)
        elif isinstance(node, ast.Call) and _dynamic_target(node):
            modules = [_dynamic_target(node)]
        else:
            continue
        found.extend(Import(path, node.lineno, module) for module in modules)
    return list(dict.fromkeys(found))  # `from x import a, b` is one import of x, said once


def layer_of(package: Path, dotted: str) -> str:
    """The layer key of the module ``dotted`` of ``package``: its first name below the package."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def problems(package: Path) -> list[str]:
    """One line for each import in ``package`` that breaks the layers, and each module in no layer."""
    lines = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package.parent)
        own = layer_of(package, module_name(package, path))
        if own not in RANKS:
            lines.append(f"{where}: in no layer (add {own!r} to RANKS in tests/unit/test_layers.py)")
            continue
        for imp in imports_of(package, path):
            top = imp.module.split(".")[0]
            if top == "ray" and own != RAY_LAYER:
                lines.append(f"{where}:{imp.line}: imports {imp.module} (only atlasfs/{RAY_LAYER}/ may import ray)")
            if top != package.name:
                continue
            theirs = layer_of(package, imp.module)
            if RANKS.get(theirs, 0) > RANKS[own]:
                lines.append(f"{where}:{imp.line}: {own or package.name} imports {imp.module}, a layer above it")
    return lines


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    found = problems(PACKAGE)
    assert not found, "\n".join(found)


def test_every_layer_named_in_ranks_exists() -> None:
    """A layer renamed or removed must leave RANKS too (else the rules hold nothing)."""
    missing = [key for key in RANKS if key and key != RAY_LAYER and _module_path(PACKAGE, f"atlasfs.{key}") is None]
    assert not missing


# The checker itself, on small packages written for the purpose: each rule is seen to fail.

def _package(root: Path, files: dict[str, str]) -> Path:
    package = root / "atlasfs"
    for relative, text in {"__init__.py": "", **files}.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(package).parents:
            init = package / folder / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.write_text(text)
    return package


_BELOW = {"storage/__init__.py": "", "formats/source.py": "from atlasfs.storage import x\n",
          "tree/blocks.py": "from atlasfs.formats import source\nfrom atlasfs import errors\n", "errors.py": "",
          "fuse/engine.py": "from ..tree import blocks\n", "commands/cli.py": "import atlasfs.fuse.engine\n"}


def test_imports_downwards_pass(tmp_path: Path) -> None:
    assert problems(_package(tmp_path, _BELOW)) == []


@pytest.mark.parametrize(("relative", "text", "expected"), [
    ("formats/pbin.py", "from atlasfs.tree.naming import NO_KEY\n", "formats/pbin.py:1: formats imports atlasfs.tree"),
    ("formats/atlas/dataset.py", "def f():\n    from ...tree import blocks\n", "dataset.py:2: formats imports atlasfs.tree"),
    ("formats/source.py", "from atlasfs.fuse import engine\n", "formats imports atlasfs.fuse.engine"),
    ("tree/tables.py", "import atlasfs.fuse.engine\n", "tree imports atlasfs.fuse.engine"),
    ("tree/tables.py", "from atlasfs.commands import cli\n", "tree imports atlasfs.commands.cli"),
    ("storage/remote.py", "from atlasfs.formats.source import x\n", "storage imports atlasfs.formats.source"),
    ("storage/remote.py", "import importlib\nimportlib.import_module('atlasfs.tree.blocks')\n",
     "storage/remote.py:2: storage imports atlasfs.tree.blocks"),
    ("errors.py", "from atlasfs import storage\n", "errors.py:1: errors imports atlasfs.storage"),
    ("tree/tables.py", "import ray\n", "imports ray (only atlasfs/ray/ may import ray)"),
    ("formats/ray_source.py", "from ray.data import Dataset\n", "imports ray.data (only atlasfs/ray/"),
    ("loose.py", "", "atlasfs/loose.py: in no layer"),
])
def test_each_rule_fails_when_broken(tmp_path: Path, relative: str, text: str, expected: str) -> None:
    found = problems(_package(tmp_path, {**_BELOW, relative: text}))
    assert any(expected in line for line in found), found


def test_ray_is_allowed_in_its_own_layer(tmp_path: Path) -> None:
    assert problems(_package(tmp_path, {**_BELOW, "ray/loader.py": "import ray\nfrom atlasfs.tree import blocks\n"})) == []
