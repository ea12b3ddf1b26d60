"""docs/api.md and the packages' ``__all__`` agree, both ways: every name the page lists is exported
by its module and importable from it, and every name a module of the package exports is listed."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "collective_loader"
API = ROOT / "docs" / "api.md"
LINE = re.compile(r"^- `(collective_loader(?:\.\w+)*)\.(\w+)`", re.MULTILINE)


def listed() -> dict[str, list[str]]:
    """docs/api.md's lines ``- `module.Name`: ...``, as module -> names in page order."""
    out: dict[str, list[str]] = defaultdict(list)
    for module, name in LINE.findall(API.read_text()):
        out[module].append(name)
    return dict(out)


def exporting_modules() -> set[str]:
    """Every module of the package that assigns ``__all__`` (read with ``ast``, nothing imported)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                parts = path.relative_to(ROOT).with_suffix("").parts
                found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


API_LISTS = listed()


def test_the_page_is_read():
    """The reader finds the page's lines (a check that reads nothing passes anything)."""
    assert "CollectiveLoader" in API_LISTS["collective_loader"]
    assert "StreamingSource" in API_LISTS["collective_loader.streaming"]
    assert sum(map(len, API_LISTS.values())) >= 30


def test_every_exporting_module_has_its_list_on_the_page():
    assert exporting_modules() - set(API_LISTS) == set(), (
        "a module sets __all__ but docs/api.md lists none of its names"
    )


@pytest.mark.parametrize("module", sorted(API_LISTS))
def test_the_page_lists_exactly_what_the_module_exports(module):
    names = API_LISTS[module]
    assert len(names) == len(set(names)), f"docs/api.md lists a name of {module} twice"
    exported = importlib.import_module(module).__all__
    assert len(exported) == len(set(exported)), f"{module}.__all__ holds a name twice"
    assert set(names) - set(exported) == set(), f"docs/api.md lists names {module}.__all__ does not export"
    assert set(exported) - set(names) == set(), f"{module}.__all__ exports names docs/api.md does not list"


@pytest.mark.parametrize("module", sorted(API_LISTS))
def test_every_listed_name_imports(module):
    mod = importlib.import_module(module)
    for name in API_LISTS[module]:
        assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), f"{module}.{name}"


def test_a_name_is_exported_once():
    """Each public object has one public path (``lm_collate`` was exported by two packages)."""
    paths = defaultdict(list)
    for module, names in API_LISTS.items():
        mod = importlib.import_module(module)
        for name in names:
            paths[id(getattr(mod, name))].append(f"{module}.{name}")
    twice = [p for p in paths.values() if len(p) > 1]
    assert twice == []


def test_every_listed_class_and_function_has_a_docstring():
    """Its own: a dataclass without one gets its signature as ``__doc__``, which does not count."""
    import inspect

    missing = []
    for module, names in API_LISTS.items():
        for name in names:
            obj = getattr(importlib.import_module(module), name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = (obj.__doc__ or "").strip()
                if not doc or doc.startswith(f"{obj.__name__}("):
                    missing.append(f"{module}.{name}")
    assert missing == []
