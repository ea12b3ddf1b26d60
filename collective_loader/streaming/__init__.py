"""mosaicml-streaming on the data-parallel leaders only.

* :mod:`~collective_loader.streaming.source`: :class:`StreamingSource` (build it on every rank;
  its dataset exists on the leaders only);
* :mod:`~collective_loader.streaming.streams`: what it builds on a leader, a
  :class:`~collective_loader.Source` of one of three kinds (:class:`SampleStream`,
  :class:`PackedStream`, :class:`BalancedStream`), each with its own resumable state;
* :mod:`~collective_loader.streaming.mixture`: :class:`MixtureSource`, several packing sources
  mixed on a schedule (its leaders' :class:`MixtureStream`; ``MixtureSource.from_file`` reads a
  mixture's file with :mod:`~collective_loader.streaming.mixture_file`);
* :mod:`~collective_loader.streaming.leader_dataset`: :class:`LeaderStreamingDataset`, a dataset the
  leaders build alone and read by index (``QuorumData``'s order, not streaming's);
* :mod:`~collective_loader.streaming.leaders_world`: the environment and barriers streaming sees there;
* :mod:`~collective_loader.streaming.dataset`: a ``StreamingDataset`` that raises a failed
  download instead of ending the epoch early;
* :mod:`~collective_loader.streaming.cleanup`: shared memory and lock files, released and removed.
"""

from collective_loader.streaming.leader_dataset import LeaderStreamingDataset
from collective_loader.streaming.mixture import MixtureSource
from collective_loader.streaming.source import StreamingSource

__all__ = ["LeaderStreamingDataset", "MixtureSource", "StreamingSource"]
