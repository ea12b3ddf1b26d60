"""Exceptions the loader raises; each names the rank, step or key a user needs to act on."""

from __future__ import annotations


class CollectiveLoaderError(Exception):
    """Base of every exception the loader raises; each subclass also keeps its built-in base
    (``ValueError`` or ``RuntimeError``), so ``except ValueError`` still catches what it did.

    >>> issubclass(BatchError, CollectiveLoaderError) and issubclass(BatchError, ValueError)
    True
    """


class BatchError(CollectiveLoaderError, ValueError):
    """A batch the loader cannot deliver: a missing or unknown key, an unencodable value, a
    sequence length the layout cannot split, a batch over the size cap.

    Raised on the leader and, with the same message, on every rank of every replica.
    """


class WireError(CollectiveLoaderError, ValueError):
    """Bytes received that do not decode to a valid batch (corrupt or hostile header or payload)."""


class LeaderError(CollectiveLoaderError, RuntimeError):
    """The data source raised on a leader; raised on every rank with the original message."""


class ConstructionError(CollectiveLoaderError, ValueError):
    """Building the loader failed on some rank (an argument it refused, state of its own); raised
    on every rank with that rank's message, so no rank is left waiting in a collective."""


class ConfigMismatchError(ConstructionError):
    """Ranks constructed the loader with different arguments; raised on every rank."""


class ShardDownloadError(CollectiveLoaderError, RuntimeError):
    """A leader's ``StreamingDataset`` could not download (or prepare) a shard; names the shard and
    why. Reaches the other ranks as :class:`LeaderError` with this message."""


class DeliveryError(CollectiveLoaderError, RuntimeError):
    """A collective failed or timed out; says which rank was waiting for whom, for which step."""
