"""Shared fixtures: one gloo world alive at a time, reused across tests and modules."""

from __future__ import annotations

import pytest

from world import World


class Worlds:
    """Hands out a world of the asked size; starting one closes the other (memory on 2 cores)."""

    def __init__(self) -> None:
        self._world: World | None = None

    def get(self, size: int) -> World:
        if self._world is not None and self._world.size != size:
            self._world.close()
            self._world = None
        if self._world is None:
            self._world = World(size)
        return self._world

    def close(self) -> None:
        if self._world is not None:
            self._world.close()


@pytest.fixture(scope="session")
def worlds():
    w = Worlds()
    yield w
    w.close()
