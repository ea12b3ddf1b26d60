"""A mixture in one ``.json`` or ``.toml`` file: its sources' ``StreamingDataset`` arguments and its
:class:`~collective_loader.text.mixture.MixtureSchedule` (``docs/mixtures.md``)."""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from collective_loader.text.mixture import MixtureSchedule

WhenExhausted = Literal["end", "repeat", "stop"]
WHEN_EXHAUSTED = ("end", "repeat", "stop")


def read_mixture(path: str | Path) -> tuple[dict[str, dict[str, Any]], MixtureSchedule]:
    """A mixture from a ``.json`` or ``.toml`` file (``docs/mixtures.md``): a ``sources`` table of
    one table per source (its ``StreamingDataset`` arguments and, optionally, ``when_exhausted``),
    one for each source the schedule weighs, beside the schedule's keys
    (:func:`schedule_from_mapping`). Errors name the file."""
    path = Path(path)
    if path.suffix.lower() not in (".json", ".toml"):
        raise ValueError(f"{path}: a mixture must be a .json or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the mixture: {e.strerror or e}") from None
    data = dict(_parse(text, path))
    sources = data.pop("sources", None)
    if not isinstance(sources, Mapping) or not sources:
        raise ValueError(f"{path}: needs a sources table: one table per source, its StreamingDataset arguments")
    bad = sorted(str(name) for name, table in sources.items() if not isinstance(table, Mapping))
    if bad:
        raise ValueError(f"{path}: sources {bad} must be tables of StreamingDataset arguments (local = ..., ...)")
    schedule = schedule_from_mapping(data, str(path))
    when_exhausted_of(sources, str(path))
    missing = sorted(set(schedule.sources) - set(sources))
    if missing:
        raise ValueError(f"{path}: the schedule weighs {missing}, which the sources table does not describe")
    return {str(name): dict(table) for name, table in sources.items()}, schedule


def schedule_from_mapping(data: Any, where: str = "mixture schedule") -> MixtureSchedule:
    """A schedule from its config form (parsed JSON or TOML; ``MixtureSchedule.to_mapping`` writes it)::

        {"unit": "tokens", "phase": [{"start": 0, "weights": {"web": 0.7, "code": 0.3}},
                                     {"start": 9e6, "ramp": 1e6, "weights": {"web": 0.3, "math": 0.7}}]}

    or ``{"weights": {...}}`` for constant weights. Unknown keys are refused, naming them; ``where``
    begins every error (a file's path).
    """
    try:
        _known(data, ("phase", "unit", "weights"))
        if ("phase" in data) == ("weights" in data):
            raise ValueError("give either phase (a list of phases) or weights (constant weights), not both or neither")
        phases = [{"start": 0, "weights": data["weights"]}] if "weights" in data else data["phase"]
        if not isinstance(phases, (list, tuple)) or not phases:
            raise ValueError(f"phase must be a non-empty list of phases, got {phases!r}")
        return MixtureSchedule(tuple(_phase(i, raw) for i, raw in enumerate(phases)), data.get("unit", "tokens"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _phase(i: int, raw: Any) -> MixtureSchedule.Phase:
    try:
        _known(raw, ("ramp", "start", "weights"))
        if "start" not in raw or "weights" not in raw:
            raise ValueError("missing start or weights")
        return MixtureSchedule.Phase(raw["start"], raw["weights"], raw.get("ramp", 0.0))
    except ValueError as e:
        raise ValueError(f"phase {i}: {e}") from None


def _known(data: Any, known: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"must be a table (mapping) with {', '.join(known)}, got {type(data).__qualname__}")
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, 1)
            raise ValueError(
                f"unknown key {key!r}{f' (did you mean {close[0]!r}?)' if close else ''}; known: {', '.join(known)}"
            )


def when_exhausted_of(sources: Mapping[str, Mapping[str, Any]], where: str = "mixture") -> dict[str, WhenExhausted]:
    """Each source's policy for when it runs out, its table's ``when_exhausted`` (``"end"`` when
    absent): ``"end"`` the epoch, for every source; ``"repeat"`` it, in a new shuffled epoch;
    ``"stop"`` it and share its weight among the others.

    >>> when_exhausted_of({"web": {"local": "/d/web"}, "code": {"local": "/d/code", "when_exhausted": "repeat"}})
    {'web': 'end', 'code': 'repeat'}
    """
    out: dict[str, WhenExhausted] = {}
    for name, table in sources.items():
        policy = table.get("when_exhausted", "end")
        if policy not in WHEN_EXHAUSTED:
            raise ValueError(
                f"{where}: sources.{name}.when_exhausted must be one of {', '.join(WHEN_EXHAUSTED)}; got {policy!r}"
            )
        out[str(name)] = policy
    return out


def _parse(text: str, path: Path) -> Mapping[str, Any]:
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        elif sys.version_info >= (3, 11):
            import tomllib

            data = tomllib.loads(text)
        else:  # pragma: no cover - Python 3.10
            import tomli

            data = tomli.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {e}") from None
    except ImportError:  # pragma: no cover - Python 3.10
        raise ValueError(f"{path}: reading TOML needs Python 3.11 or the tomli package") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: must be a table (mapping), got {type(data).__qualname__}")
    return data
