"""Shared fixtures: one gloo world alive at a time, reused by the tests of a module; a local S3 endpoint."""

from __future__ import annotations

import pytest
from s3_bucket import S3_BUCKET
from world import World  # tests/support is on the path (pyproject's pythonpath)

from collective_loader.testing.s3_endpoint import APP_ID_VARIABLE, S3Endpoint


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


@pytest.fixture(scope="module")
def worlds():
    # per module: an idle world still costs CPU, which the subprocess tests of other modules need
    w = Worlds()
    yield w
    w.close()


@pytest.fixture(scope="module")
def s3():
    """A local S3 endpoint with the bucket ``S3_BUCKET``; this process's boto3 (and streaming's
    writer) point at it for the module only, and name themselves "test" to it."""
    with S3Endpoint() as endpoint, pytest.MonkeyPatch.context() as mp:
        for k, v in endpoint.client_env().items():
            mp.setenv(k, v)
        mp.setenv(APP_ID_VARIABLE, "test")
        endpoint.create_bucket(S3_BUCKET)
        yield endpoint
