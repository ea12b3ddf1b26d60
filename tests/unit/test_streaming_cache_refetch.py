"""``DownloadFailureRaisingDataset`` in one process, without a loader: the cache-limit case.

With ``cache_limit`` smaller than the shards that ``predownload`` samples touch, streaming's
download thread evicts shards that its ready thread is still waiting for; streaming 0.13's ready
thread then waits for ever (here, the plain ``StreamingDataset`` hung in 6 of 8 two-epoch runs of
this very setting). The download-failure cases need an object store: ``test_remote.py``.
"""

from __future__ import annotations

import threading

import pytest

from collective_loader.streaming.cleanup import release
from collective_loader.streaming.dataset import DownloadFailureRaisingDataset
from collective_loader.testing.data import write_dataset

SAMPLES, SEQ, SHARD_BYTES = 256, 16, 1 << 11  # 14 shards of about 19 samples


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_cache_that_thrashes_still_ends_every_epoch_with_every_sample(tmp_path, seed):
    write_dataset(str(tmp_path / "remote"), SAMPLES, SEQ, shard_bytes=SHARD_BYTES)
    dataset = DownloadFailureRaisingDataset(
        remote=str(tmp_path / "remote"),
        local=str(tmp_path / "cache"),
        batch_size=4,
        shuffle=True,
        shuffle_seed=seed,
        cache_limit=4 * SHARD_BYTES,
        predownload=SAMPLES,  # 4 shards' room, all 14 wanted ahead
    )
    epochs: list[list[int]] = []
    errors: list[BaseException] = []

    def iterate() -> None:
        try:
            for _ in range(2):
                epochs.append(sorted(int(sample["id"]) for sample in dataset))
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    thread = threading.Thread(target=iterate, daemon=True)  # daemon: a hung epoch must not hang pytest's exit
    thread.start()
    thread.join(60)  # two epochs take about 2 s here
    try:
        assert not thread.is_alive(), f"epoch {len(epochs)} had not ended after 60 s"
        assert not errors, errors
        assert epochs == [list(range(SAMPLES))] * 2
    finally:
        if not thread.is_alive():
            release(dataset)
