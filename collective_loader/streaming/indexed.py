"""The leaders' dataset when packing: each sample also says its index in the dataset.

A packing leader's hand-over on resume names documents by ``(step, sample index)``
(:mod:`collective_loader.text.resume`); streaming knows the index only while it reads the sample,
so :class:`IndexedDataset` adds it to the sample, under
:data:`~collective_loader.text.layouts.SAMPLE_INDEX`. A module of its own so that DataLoader
workers started by ``spawn`` or ``forkserver`` can import the class.
"""

from __future__ import annotations

from typing import Any

from collective_loader.streaming.dataset import DownloadFailureRaisingDataset
from collective_loader.text.layouts import SAMPLE_INDEX


class IndexedDataset(DownloadFailureRaisingDataset):
    """:class:`DownloadFailureRaisingDataset` whose samples carry their index under ``SAMPLE_INDEX``."""

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        sample = super().get_item(sample_id, retry)
        sample[SAMPLE_INDEX] = sample_id
        return sample
