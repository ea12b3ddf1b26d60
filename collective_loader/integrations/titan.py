"""TorchTitan: a dataloader its trainer can use where it expects a ``BaseDataLoader``.

TorchTitan 0.3's trainer runs ``post_dataloading_process(input_dict, labels)`` on every rank,
every pipeline stage included: it reads ``input_dict["input"]`` there, passes the other
``input_dict`` keys (``positions``, ...) as forward kwargs to *every* stage, and counts tokens
with ``labels.numel()``. So :class:`TitanDataLoader` delivers every key to every stage
(``every_stage``). That costs the input and label bytes on stages that do not consume them,
one int64 per token and key, small next to a stage's activations. Context parallelism is the
trainer's job too (``prepare_context_parallel_input``), so sequences arrive whole on cp ranks.

Which pp rank holds the first stage and which the last (the loss) follows the schedule:
TorchTitan places the stages of ``ZBVZeroBubble`` and ``DualPipeV`` in a V (pp rank 0 holds the
first stage and the last), every other schedule's in a loop (the last on pp rank ``pp - 1``).
:func:`titan_stage_style` makes the same decision from the schedule's name, and the loaders built
for TorchTitan's Trainer pass it to :class:`~collective_loader.CollectiveLoader` as ``stage_style``,
so their ``is_first_stage`` and ``is_last_stage``, and the stages their leaders sit on, are
TorchTitan's. Every key still goes to every stage.

For TorchTitan's own Trainer see :mod:`collective_loader.integrations.titan_trainer` (and, on the
command line, ``--module collective_loader.integrations.titan_configs``); this module does not
import torchtitan.

Its state is in TorchTitan's form, ``{"dp_rank_<i>": ..., "world_size": dp_size}``, with one
entry. A source that re-partitions what was consumed over another DP degree
(an ``elastic`` one: a ``StreamingSource``'s) has the same state on every rank, so every
rank saves and reads the entry of DP rank 0, ``dp_rank_0``: DCP writes a value that every rank
saves under the same key once, and any rank of any new mesh reads it. Another source keeps each
replica's own position, under its own ``dp_rank_<i>``, and resumes on the same DP degree only.
The entry is one opaque leaf, as in TorchTitan, because
``torch.distributed.checkpoint`` (DCP) loads into the structure that a fresh ``state_dict()``
returns. A nested entry there would be ``{"source": None, ...}`` and would not match a saved
``{"source": {...}}``. The leaf is written with ``torch.save`` and read back with
``torch.load(weights_only=True)``, which rebuilds only tensors and plain containers.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import StageStyle

DATA_MESH = ["pp", "batch", "cp", "tp"]  # TorchTitan's data-loading mesh (ParallelDims.build_mesh)
SHARED = "dp_rank_0"  # the entry of a state that is the same on every rank (see the module's docstring)
# options that would contradict what TorchTitan's trainer expects of its dataloader
REFUSED = {
    "seq_dims": "TorchTitan's trainer splits the sequence over cp itself (prepare_context_parallel_input)",
    "every_stage": "every key already goes to every stage",
}


def titan_stage_style(schedule: str, pp: int) -> StageStyle:
    """The stage style in which TorchTitan 0.3 places the stages of the pipeline schedule named
    ``schedule`` (``--parallelism.pipeline_parallel_schedule``) over ``pp`` pipeline ranks: ``"v"``
    for the schedule classes it maps in a V (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: pp
    rank 0 holds the first and the last stage), ``"loop"`` for every other one and without a
    pipeline (``pp == 1``: TorchTitan reads no schedule then). The same decision as TorchTitan's
    ``_get_pp_rank_to_stage_indices_mapping``: by the class ``get_schedule_class(schedule)``
    returns, which raises ``ValueError`` for a name torch does not know.

    >>> titan_stage_style("ZBVZeroBubble", 2), titan_stage_style("dualpipev", 4), titan_stage_style("1F1B", 2)
    ('v', 'v', 'loop')
    >>> titan_stage_style("ZBVZeroBubble", 1)
    'loop'
    """
    if pp <= 1:
        return "loop"
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble, get_schedule_class

    return "v" if get_schedule_class(schedule) in (ScheduleZBVZeroBubble, ScheduleDualPipeV) else "loop"


def split_labels(batch: Mapping[str, Any], labels: str = "labels") -> tuple[dict[str, Any], torch.Tensor]:
    """TorchTitan's ``(input_dict, labels)`` from one delivered batch.

    >>> split_labels({"input": torch.tensor([[5, 6]]), "labels": torch.tensor([[6, 7]])})
    ({'input': tensor([[5, 6]])}, tensor([[6, 7]]))
    """
    input_dict = {key: value for key, value in batch.items() if key != labels}
    return input_dict, batch[labels]


class TitanDataLoader:
    """Yields ``(input_dict, labels)`` on every rank of the mesh. It is ``Stateful``, so it can
    go into TorchTitan's checkpoints.

    ``source`` yields mappings holding the ``inputs`` keys and ``labels``, e.g. TorchTitan's
    ``{"input": tokens, "positions": ...}`` plus ``"labels"``. It is built on one leader per
    data-parallel replica (pass a callable); partition it by the replica's
    ``collective_loader.mesh_place(mesh, rank)``. ``options`` pass through to
    :class:`~collective_loader.CollectiveLoader` (``timeout``, ``roles``, ``prefetch``, ...):
    ``stage_style="v"`` under a V schedule (:func:`titan_stage_style`).

    Example (every rank; ``mesh`` from TorchTitan's ``ParallelDims``)::

        mesh = parallel_dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True)
        dataloader = TitanDataLoader(lambda: StatefulDataLoader(dataset, batch_size=8), mesh)
        for input_dict, labels in dataloader:   # every stage: {"input": ...}, labels
            ...
        dcp.save({"dataloader": dataloader}, checkpoint_id=path)
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
        mesh: DeviceMesh,
        *,
        inputs: tuple[str, ...] = ("input",),
        labels: str = "labels",
        **options: Any,
    ) -> None:
        refused = sorted(set(options) & set(REFUSED))
        if refused:
            name = refused[0]
            raise ValueError(
                f"TitanDataLoader takes no {name}=: {REFUSED[name]}; use CollectiveLoader for other routing"
            )
        self.labels = labels
        self.loader = CollectiveLoader(source, mesh, inputs=(), labels=(), every_stage=(*inputs, labels), **options)
        # the names TorchTitan's ParallelAwareDataloader uses
        self.dp_rank, self.dp_world_size = self.loader.dp_rank, self.loader.dp_size
        self._rank_id = f"dp_rank_{self.dp_rank}"

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        for batch in self.loader:
            yield split_labels(batch, self.labels)

    def state_dict(self) -> dict[str, Any]:
        """``{"dp_rank_<i>": bytes, "world_size": dp_size}``; call on every rank after the same step.

        ``i`` is 0 on every rank when the source resumes on any DP degree (its state is the same
        on every rank), this rank's replica otherwise."""
        state = self.loader.state_dict()
        entry = SHARED if state["source_elastic"] else self._rank_id
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return {entry: buffer.getvalue(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next ``iter()``; call on every rank.

        As in TorchTitan, an empty state starts afresh, and a state without this rank's entry
        warns and starts afresh. Another DP degree raises ``ValueError`` on every rank (the state
        is the same on every rank, so no rank goes on alone) unless the source re-partitions.
        """
        state = self.loader_state(state_dict)
        if state is not None:
            self.loader.load_state_dict(state)

    def loader_state(self, state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``CollectiveLoader`` state in TorchTitan's ``state_dict``: ``dp_rank_0`` when it holds
        a state every rank shares (``source_elastic``), else this rank's entry; ``None`` to start
        afresh. Raises ``ValueError`` for another DP degree unless the source re-partitions."""
        if not state_dict:
            return None
        shared = _read(state_dict.get(SHARED))
        if shared is not None and shared["source_elastic"]:
            return shared
        state = shared if self._rank_id == SHARED else _read(state_dict.get(self._rank_id))
        if state is None:
            warnings.warn(f"dataloader state has no entry {self._rank_id!r}: starting from the beginning", stacklevel=3)
            return None
        saved = state_dict.get("world_size")
        if saved != self.dp_world_size:
            raise ValueError(
                f"the dataloader state was saved with world_size={saved!r} data-parallel ranks and this run has "
                f"{self.dp_world_size}; its source keeps each replica's own position, which cannot be re-partitioned "
                "(a StreamingSource's can): resume with the same DP degree, or start the dataloader afresh"
            )
        return state

    def close(self) -> None:
        """Stop the loader's transfers; call on every rank before ``destroy_process_group()``."""
        self.loader.close()


def _read(entry: bytes | None) -> dict[str, Any] | None:
    """A ``CollectiveLoader`` state from the leaf :meth:`TitanDataLoader.state_dict` wrote (``None``: no entry)."""
    return None if entry is None else torch.load(io.BytesIO(entry), weights_only=True)
