"""TorchTitan: a dataloader its trainer can use where it expects a ``BaseDataLoader``.

TorchTitan's trainer iterates ``for input_dict, labels in dataloader`` on every rank and reads
``labels`` on every rank, pipeline stages without a loss included (it counts tokens with
``labels.numel()`` and the valid tokens of the global batch from them). So
:class:`TitanDataLoader` sends the labels to every stage (``every_stage``; their bytes are a
small share of a step's traffic: one int64 per token) and the inputs to the first stage only: a
middle or last stage's ``input_dict`` is ``{}``.

Its state is in TorchTitan's per-DP-rank form, ``{"dp_rank_<i>": ..., "world_size": dp_size}``.
TorchTitan's checkpointer hands it to ``torch.distributed.checkpoint`` (DCP), which loads into
the structure a fresh ``state_dict()`` returns, so the per-rank entry is one opaque leaf, as in
TorchTitan: bytes written by ``torch.save`` and read back with ``torch.load(weights_only=True)``,
which rebuilds tensors and plain containers only and executes nothing from the file.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from collective_loader.loader import CollectiveLoader


class TitanDataLoader:
    """Yields ``(input_dict, labels)`` on every rank of the mesh; Stateful for TorchTitan's checkpoints.

    ``source`` yields mappings holding the ``inputs`` keys and ``labels``, e.g. TorchTitan's
    ``{"input": tokens}`` plus ``"labels"``. ``options`` pass through to
    :class:`~collective_loader.CollectiveLoader` (``seq_dims``, ``timeout``, ``roles``, ...).

    Example (every rank; ``mesh`` from TorchTitan's ``ParallelDims``)::

        mesh = parallel_dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True)
        dataloader = TitanDataLoader(lambda: StatefulDataLoader(dataset, batch_size=8), mesh)
        for input_dict, labels in dataloader:   # first stage: {"input": ...}; others: {}
            ...
        checkpoint = {"dataloader": dataloader}  # state_dict() / load_state_dict(), per DP rank
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
        mesh: Any,
        *,
        inputs: tuple[str, ...] = ("input",),
        labels: str = "labels",
        **options: Any,
    ) -> None:
        self.loader = CollectiveLoader(source, mesh, inputs=tuple(inputs), labels=(), every_stage=(labels,), **options)
        self.labels = labels
        self.dp_rank, self.dp_world_size = self.loader.dp_rank, self.loader.dp_size
        self._rank_id = f"dp_rank_{self.dp_rank}"

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        for batch in self.loader:
            labels = batch.pop(self.labels)
            yield batch, labels

    def state_dict(self) -> dict[str, Any]:
        """``{"dp_rank_<i>": bytes, "world_size": dp_size}``; call on every rank after the same step."""
        buffer = io.BytesIO()
        torch.save(self.loader.state_dict(), buffer)
        return {self._rank_id: buffer.getvalue(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next ``iter()``; call on every rank. An empty state starts afresh, as in
        TorchTitan; a state without this DP rank's entry warns and starts afresh."""
        if not state_dict:
            return
        if self._rank_id not in state_dict:
            warnings.warn(f"dataloader state has no entry {self._rank_id!r}: starting from the beginning", stacklevel=2)
            return
        if state_dict["world_size"] != self.dp_world_size:
            raise ValueError(
                f"the dataloader state was saved with {state_dict['world_size']} data-parallel ranks and this run "
                f"has {self.dp_world_size}; TorchTitan's per-DP-rank state cannot be re-partitioned"
            )
        self.loader.load_state_dict(torch.load(io.BytesIO(state_dict[self._rank_id]), weights_only=True))

    def close(self) -> None:
        self.loader.close()
