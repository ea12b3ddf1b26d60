"""The private parts of mosaicml-streaming that ``collective_loader/streaming/dataset.py`` overrides
are the ones it was written against: a release that changes them fails here, naming the version,
before anything hangs.

``DownloadFailureRaisingDataset`` replaces ``prepare_shard``, ``on_exception``, ``_prepare_thread``
and ``_ready_thread`` and reads ``_Iterator``'s indices, ``_ShardState`` and ``TICK``. Each is
fingerprinted by the SHA-256 of its source as mosaicml-streaming 0.13.0 ships it; pyproject.toml
pins ``mosaicml-streaming>=0.13,<0.14``. When this fails after an upgrade, read the new code of
the named parts, mend the overrides, then update the fingerprints.
"""

from __future__ import annotations

import hashlib
import inspect

import streaming
from streaming.base import dataset

WRITTEN_FOR = "0.13.0"
FINGERPRINTS = {
    "StreamingDataset.prepare_shard": "0aebbfc3c71ca41a",
    "StreamingDataset.on_exception": "29b835084a0b6d8a",
    "StreamingDataset._prepare_thread": "51ca7defcb598b6d",
    "StreamingDataset._ready_thread": "7d83095a9f36423e",
    "StreamingDataset.__iter__": "6457c4cfbae05998",
    "_Iterator": "ab33a14a12152f39",
}


def fingerprint(qualname: str) -> str:
    obj = dataset
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def test_the_overridden_internals_are_those_of_the_release_they_were_written_for():
    changed = [name for name, want in FINGERPRINTS.items() if fingerprint(name) != want]
    assert not changed, (
        f"mosaicml-streaming {streaming.__version__} changed {changed}, which "
        f"collective_loader/streaming/dataset.py overrides (written for {WRITTEN_FOR}): read them and mend it"
    )


def test_the_states_and_tick_it_reads_are_there():
    assert [s.name for s in dataset._ShardState] == ["INVALID", "REMOTE", "PREPARING", "LOCAL"]
    assert isinstance(dataset.TICK, float) and dataset.TICK > 0
