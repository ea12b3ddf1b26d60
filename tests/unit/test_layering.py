"""The package's layers hold: each module imports only from the layers its own may use, and no
modules import each other in a loop (imports inside functions and under ``TYPE_CHECKING``
included). Read from the source with ``ast``; nothing is imported. And docs/design.md's layer table names every
module.

The layers, lowest first: ``errors`` and ``types``; ``plan``, then ``text`` (both pure); ``delivery``; the core
(``loader``, the package's ``__init__``); ``streaming``; ``integrations`` and ``testing``; the
application (``cli``, ``__main__``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "collective_loader"

CORE = {"errors", "plan", "delivery", "core"}
MAY_IMPORT = {
    "errors": set(),
    "plan": {"errors"},
    "text": {"errors", "plan"},
    "delivery": {"errors", "plan"},
    "core": {"errors", "plan", "delivery"},
    "streaming": CORE | {"text"},
    "integrations": CORE | {"text", "streaming"},
    "testing": CORE | {"text", "streaming"},
    "app": CORE | {"text", "streaming", "integrations", "testing"},
}


def layer(module: str) -> str:
    """``collective_loader.plan.mesh`` -> ``plan``; the package's top-level modules by their job."""
    parts = module.split(".")[1:]
    top = parts[0] if parts else "__init__"
    if top == "types":  # the type aliases every layer names: as low as the errors
        return "errors"
    if top in ("loader", "__init__"):
        return "core"
    if top in ("cli", "__main__"):
        return "app"
    return top


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # "from pkg import mod" imports the module pkg.mod where there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t.split(".")[0] == "collective_loader" and t != name}
    return found


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_a_module_imports_only_what_its_layer_may(name):
    mine = layer(name)
    wrong = sorted(t for t in GRAPH[name] if layer(t) != mine and layer(t) not in MAY_IMPORT[mine])
    assert not wrong, f"{name} ({mine}) imports {wrong}; {mine} may import {sorted(MAY_IMPORT[mine])}"


def test_no_modules_import_each_other_in_a_loop():
    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in GRAPH.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    # a package's __init__ that re-exports its own modules is no loop: those modules do not import it
    loops = [c for c in map(cycle_from, GRAPH) if c is not None]
    assert not loops, f"import loops: {loops[:3]}"


def test_the_layer_rules_see_the_imports():
    """The reader finds the imports it must (a check that cannot see an import passes anything)."""
    assert "collective_loader.plan.routing" in GRAPH["collective_loader.delivery.protocol"] or (
        "collective_loader.plan.wire" in GRAPH["collective_loader.delivery.protocol"]
    )
    assert "collective_loader.delivery.epoch" in GRAPH["collective_loader.loader"]
    assert layer("collective_loader.plan.mesh") == "plan" and layer("collective_loader") == "core"
    assert "collective_loader.loader" not in GRAPH["collective_loader.delivery.protocol"]


def design_table_modules() -> set[str]:
    """The modules docs/design.md's layer table names: ``plan/mesh.py``, ``routing.py`` (in the
    directory named last in the same cell), ``streaming/`` (``source.py``, ...)."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    table = text.split("| layer | modules | job | may import |", 1)[1].split("\n\n", 1)[0]
    named = set()
    for row in table.splitlines()[2:]:
        folder = ""
        for token in re.findall(r"`([\w/]+(?:\.py)?)`", row.split("|")[2]):
            if token.endswith("/"):
                folder = token
            elif token.endswith(".py"):
                if "/" in token:
                    folder = token.rpartition("/")[0] + "/"
                    named.add(token)
                else:
                    named.add(folder + token)
    return named


def test_the_design_pages_layer_table_names_every_module():
    on_disk = {
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent == PACKAGE
    }
    table = design_table_modules()
    assert "plan/mesh.py" in table and "streaming/source.py" in table  # the reader reads the table
    assert sorted(on_disk - table) == [], "docs/design.md's layer table leaves these out"
    assert sorted(table - on_disk) == [], "docs/design.md's layer table names modules that are gone"
