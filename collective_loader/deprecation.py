"""Old public names that were renamed: still importable, with a ``DeprecationWarning``.

A module keeps its old names with ``__getattr__ = renamed(__name__, {"Old": "New"}, globals())``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(module: str, names: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name in ``names`` (old -> new) from
    ``namespace`` (the module's ``globals()``), with a warning naming the new one.

    >>> getattr_ = renamed("pkg.mod", {"Old": "New"}, {"New": int})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     getattr_("Old") is int, str(caught[0].message)
    (True, 'pkg.mod.Old is renamed pkg.mod.New; the old name will be removed')
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            warnings.warn(
                f"{module}.{name} is renamed {module}.{names[name]}; the old name will be removed",
                DeprecationWarning,
                stacklevel=2,
            )
            return namespace[names[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
