"""mosaicml-streaming on the data-parallel leaders only.

* :mod:`~collective_loader.streaming.source`: :class:`StreamingSource` (build it on every rank;
  its dataset exists on the leaders only) and :class:`LeaderStream` (a leader's dataset,
  DataLoader and resumable state);
* :mod:`~collective_loader.streaming.leaders`: the environment and barriers streaming sees there;
* :mod:`~collective_loader.streaming.dataset`: a ``StreamingDataset`` that raises a failed
  download instead of ending the epoch early;
* :mod:`~collective_loader.streaming.cleanup`: shared memory and lock files, released and removed.
"""

from collective_loader.streaming.cleanup import release, remove_stale
from collective_loader.streaming.leaders import leader_env, leaders_world
from collective_loader.streaming.source import LeaderStream, StreamingSource
from collective_loader.text.collate import (
    lm_collate,  # here too: the collate StreamingSource uses by default
)

__all__ = ["LeaderStream", "StreamingSource", "leader_env", "leaders_world", "lm_collate", "release", "remove_stale"]
