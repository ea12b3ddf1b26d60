"""``CollectiveLoader``: one leader per data-parallel replica loads; every rank gets what it needs.

Per step the leader takes one batch from its source, agrees with the other replicas' leaders on
whether every replica has one (so all replicas stop at the same step), and sends one message
(header, description and tensors in one buffer) per delivery group: first stage, last stage, and
middle stages when there are ``every_stage`` keys (without any, middle stages are outside
delivery and read the leader's bulletin if they iterate: :mod:`collective_loader.delivery.bulletin`); see
:mod:`collective_loader.delivery.protocol`. While batch sizes repeat that is one collective per group
(see :class:`~collective_loader.delivery.transport.Channel`). A watchdog on each leader reports a source
that stalls. Every rank runs the gloo part on a background thread that works at most
``prefetch`` steps ahead of what its training loop has consumed, so delivery overlaps compute,
and no rank ever waits inside a collective for a peer that is not about to post the matching
one. No NCCL collective is ever issued off the training thread.
"""

from __future__ import annotations

import atexit
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from collective_loader.delivery.agreement import control_group, run_phase
from collective_loader.delivery.config import LoaderConfig, make_config
from collective_loader.delivery.epoch import Epoch, OutsideEpoch
from collective_loader.delivery.figures import ShardWorkTally
from collective_loader.delivery.settings import Settings, build_settings, log_settings
from collective_loader.delivery.source_protocol import PlacesLeaders, Source, build_source
from collective_loader.delivery.state import share_state
from collective_loader.errors import ConstructionError, LeaderError
from collective_loader.plan.mesh import MeshLayout, Place
from collective_loader.plan.routing import Routing
from collective_loader.types import Batch


class CollectiveLoader:
    """Deliver each rank of a ``DeviceMesh`` exactly the data it needs, loaded once per replica.

    Args:
        source: an iterable of batches (mappings of str to tensors, nested mappings and plain
            values allowed), or a zero-argument callable returning one. Only leaders touch it;
            a callable is called only on leaders, so other ranks build nothing.
        mesh: a ``DeviceMesh`` with named dims, in any order, holding every rank of the world.
        config: a :class:`~collective_loader.LoaderConfig`; or leave it out and give its fields
            as keywords (``inputs=``, ``labels=``, ``every_stage=``, ``seq_dims=``, ``split=``,
            ``roles=``, ``placement=``, ``stage_style=``, ``delivery=``, ``transport=``,
            ``prefetch=``, ``timeout=``, ``max_batch_bytes=``; each documented there), not both.
        schedule: this rank's ``torch.distributed.pipelining`` schedule, when it exists before
            the loader: checked against ``stage_style`` (the ranks that compute the loss must be
            the ones that get ``labels``).

    Construction is collective: every rank of the world builds the loader, with the same
    config. A refused option, a schedule that does not match it, or a source that fails to
    build on a leader, raises on every rank.

    Which ranks must iterate: every rank that receives keys (:attr:`in_delivery`: the first and
    the last stage, and middle stages when there are ``every_stage`` keys), leaders included. A
    middle stage without ``every_stage`` keys is outside delivery: it may iterate (it gets ``{}``
    per step and stops with everyone) or never touch the loader, as Megatron's middle stages do.

    Example (every rank)::

        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        loader = CollectiveLoader(lambda: DataLoader(ds, batch_size=8), mesh,
                                  inputs=("input_ids",), labels=("labels",))
        for batch in loader:
            if loader.is_first_stage: model(batch["input_ids"])
            if loader.is_last_stage:  loss(batch["labels"])
    """

    def __init__(
        self,
        source: Iterable[Mapping[str, Any]] | Callable[[], Iterable[Mapping[str, Any]]],
        mesh: DeviceMesh,
        config: LoaderConfig | None = None,
        *,
        schedule: Any = None,
        **options: Any,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("CollectiveLoader needs torch.distributed initialized (init_process_group) first")
        # each construction phase ends in an agreement over this group: a phase that fails on
        # some ranks ends construction on every rank, with that rank's error (run_phase)
        control = control_group(config.timeout if config is not None else options.get("timeout", LoaderConfig.timeout))
        self.settings: Settings = build_settings(lambda: make_config(config, options), mesh, control)
        place = self.settings.place
        run_phase(  # every rank, whatever it was given: a phase is collective
            control,
            lambda: _check_placement(source, schedule, self.settings),
            lambda rank, text: ConstructionError(f"rank {rank} could not build CollectiveLoader: {text}"),
        )
        self._source: Source | None = run_phase(
            control,
            lambda: build_source(source) if place.is_leader else None,
            lambda rank, text: LeaderError(f"leader rank {rank} could not build its source: {text}"),
        )
        self._shard_work = ShardWorkTally()  # a leader's work over its shard ranks, for stats()
        self._epoch: Epoch | OutsideEpoch | None = None
        self._resume: dict[str, Any] | None = None
        self.epoch = 0  # epochs started
        self._epochs_made = 0  # passes begun by iter() (with a resume, one more): a bulletin's epoch id
        self._checkpoints = 0  # state_dict() calls: a bulletin's checkpoint index
        _LIVE.add(self)
        log_settings(self.settings)

    # --- public facts ------------------------------------------------------------------------

    @property
    def place(self) -> Place:
        """Where this rank sits: replica, leader, stage, shard (see :class:`~collective_loader.plan.mesh.Place`)."""
        return self.settings.place

    @property
    def mesh_layout(self) -> MeshLayout:
        """The mesh's dims with their roles and the arithmetic on its ranks (the same on every rank)."""
        return self.settings.mesh_layout

    @property
    def routing(self) -> Routing:
        """What goes where: the keys each stage receives, each key's sequence dim, the split, the
        shard dims (the same on every rank)."""
        return self.settings.routing

    @property
    def device(self) -> torch.device:
        """Where delivered batches land: the mesh's device type (on ``"cuda"``, the current device
        when the loader was built)."""
        return self.settings.device

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica, 0 to ``dp_size - 1``."""
        return self.place.dp_rank

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (and of leaders)."""
        return self.place.dp_size

    @property
    def is_leader(self) -> bool:
        """Whether this rank loads its replica's batches."""
        return self.place.is_leader

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank is on the first pipeline stage (it receives the inputs)."""
        return self.place.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is on the last pipeline stage (it computes the loss and receives the
        labels): pp rank ``pp - 1``, or pp rank 0 under ``stage_style="v"``."""
        return self.place.is_last_stage

    @property
    def in_delivery(self) -> bool:
        """Whether this rank receives keys and must iterate the loader (every rank but a middle
        stage's when there are no ``every_stage`` keys; see the class docstring)."""
        return self.settings.groups.in_delivery

    @property
    def source(self) -> Source | None:
        """On a leader, the :class:`~collective_loader.Source` it loads from (what ``source()``
        returned, for a callable; a plain iterable in an
        :class:`~collective_loader.delivery.source_protocol.IterableSource`); ``None`` on every other rank,
        which builds nothing. Iterate the loader, never the source."""
        return self._source

    @property
    def config(self) -> LoaderConfig:
        """The options this loader was built with (the same on every rank)."""
        return self.settings.config

    @property
    def group_count(self) -> int:
        """Process groups this loader created (every rank creates the same ones)."""
        return self.settings.groups.count

    # --- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        """Start an epoch (or resume the one a loaded state was saved in).

        An unfinished previous epoch is closed first, on every rank alike.
        """
        if self._epoch is not None:
            self._epoch.close()
        resume, self._resume = self._resume, None
        if resume is not None:
            self.epoch = resume["epoch"]
        self._epoch = self._new_epoch(resume)
        self.epoch += 1
        if resume is None or not resume["steps"]:
            return self._epoch
        return self._resumed(self._epoch)

    def _new_epoch(self, resume: Mapping[str, Any] | None) -> Epoch | OutsideEpoch:
        self._epochs_made += 1
        if not self.in_delivery:
            return OutsideEpoch(self.settings, resume, self._epochs_made)
        return Epoch(self.settings, self._source, resume, self._shard_work, self._epochs_made)

    def _resumed(self, epoch: Epoch | OutsideEpoch) -> Iterator[Batch]:
        """A resumed epoch; when its checkpoint was taken right after its last batch, the next
        epoch instead of an empty one (every rank sees the same end at the same step)."""
        try:
            first = next(epoch)
        except StopIteration:
            epoch = self._epoch = self._new_epoch(None)
            self.epoch += 1
            try:
                first = next(epoch)
            except StopIteration:
                return
        yield first
        yield from epoch

    # --- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the training loop is: epoch, batches it consumed, and the leader's source state.

        Collective over each replica's ranks in delivery: call it on every rank at the same step
        (as a checkpoint does). Every rank of a replica returns the same dict; a rank outside
        delivery may call it or not (when it does, it reads the dict its leader posted). Batches that were prefetched but
        not consumed are not counted: after a resume they are delivered again.

        The source state is the leader's ``source.state_dict()`` taken right after the last
        consumed batch, as the source's ``checkpoint_state()`` turns it into what to save (a
        packing ``StreamingSource``'s: one state over every leader, a collective over the
        leaders, so that every rank saves what every leader has trained). A plain iterable without
        a state has ``None`` there, and a resume skips the consumed batches.
        """
        epoch = self._epoch
        steps = epoch.steps if epoch is not None else 0
        source_state = epoch.source_state if epoch is not None else None
        if self._source is not None:
            source_state = self._source.checkpoint_state(source_state)
        state = {
            "format": 1,
            "dp_size": self.dp_size,
            "epoch": max(self.epoch - 1, 0),
            "steps": steps,
            "source": source_state,
            "source_elastic": self._source is not None and self._source.elastic,
        }
        self._checkpoints += 1
        return share_state(self.settings, state, self._checkpoints)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter(loader)``; call on every rank.

        Raises ``ValueError`` for a state this loader cannot resume: another format, or another
        DP degree with a source that cannot re-partition (only ``elastic`` sources, such as
        ``StreamingSource``'s with the same global batch, can).
        """
        if not isinstance(state, Mapping) or state.get("format") != 1:
            raise ValueError(f"not a CollectiveLoader state (format 1): {str(state)[:200]}")
        if state["dp_size"] != self.dp_size and not state["source_elastic"]:
            raise ValueError(
                f"the state was saved with {state['dp_size']} data-parallel replicas and this loader has "
                f"{self.dp_size}; its source cannot re-partition consumed data over another DP degree "
                "(a StreamingSource with the same global batch size can)"
            )
        self._resume = dict(state)

    def close(self) -> None:
        """Finish the transfers already under way, stop the background thread, close the source,
        give back the loader's process groups: a closed loader cannot iterate again.

        Call it on every rank before ``dist.destroy_process_group()``; at interpreter exit it
        runs by itself. On a rank outside delivery, raises the error its leader failed with, if
        this rank has not raised it from ``next()`` already: a middle stage that never iterates
        learns of it here. On the process that hosts the job's key-value store (rank 0 in a plain
        ``env://`` world; under torchrun, its agent, and no rank waits), waits until every rank
        outside delivery has closed, at most ``timeout`` seconds: they read their leader's steps
        and errors there.
        """
        _LIVE.discard(self)
        stuck = False
        if self._epoch is not None:
            self._epoch.close()
            stuck = self._epoch.in_source()
        if self._source is not None:
            if stuck:
                warnings.warn("the source is still inside a stalled call; it is left open", stacklevel=2)
            else:
                self._source.close()
        groups = self.settings.groups
        try:
            if not self.in_delivery:
                assert groups.readers is not None, "a rank outside delivery is one of the readers"
                try:
                    self._raise_posted_error()
                finally:
                    groups.readers.closed(self.place.rank)
            elif groups.readers is not None:  # this process hosts the store
                groups.readers.wait_closed()
        finally:
            if not stuck:  # a thread stuck in the source may still be inside a collective
                groups.release()

    def _raise_posted_error(self) -> None:
        bulletin = self.settings.groups.bulletin
        assert bulletin is not None, "a rank outside delivery reads a bulletin"
        posted = None if bulletin.reported else bulletin.error()
        if posted is not None:
            bulletin.reported = True
            kind, text = posted
            raise kind.error(f"rank {self.place.rank} (outside delivery) learned at close(): {text}")

    def stats(self) -> dict[str, float]:
        """Collectives and bytes this rank has sent and received through its delivery groups; on a
        leader, its source's own ``stats()`` (a packing ``StreamingSource``'s: documents, rows, padding, and with balancing the replicas' cost
        max/mean), those too; on a leader under a per-document split, the work over the shard
        ranks (``cp_cost_max_over_mean``, its ``_worst``, ``cp_padding``: see
        :class:`~collective_loader.delivery.figures.ShardWorkTally`)."""
        out: dict[str, float] = dict(self.settings.groups.traffic())
        out.update(self._shard_work.figures())
        if self._source is not None:
            out.update(self._source.stats())
        return out

    def __enter__(self) -> CollectiveLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# Loaders not closed yet, held until they are (a loader dropped unclosed still has its transfer
# thread, and on the store's host, ranks outside delivery reading the store): closed at exit.
_LIVE: set[CollectiveLoader] = set()


@atexit.register
def _close_live_loaders() -> None:
    # A thread left inside a gloo collective at interpreter exit aborts the process.
    for loader in list(_LIVE):
        try:
            loader.close()
        except Exception as e:  # nobody is left to catch it: say it, and close the others
            warnings.warn(f"CollectiveLoader.close() at exit: {e}", stacklevel=1)


def _check_placement(source: Any, schedule: Any, settings: Settings) -> None:
    """Refuse a source that put the leaders elsewhere, or a schedule that puts the loss elsewhere."""
    leaders = settings.mesh_layout.leaders()
    if isinstance(source, PlacesLeaders) and tuple(source.leaders) != leaders:
        config = settings.config
        raise ValueError(
            f"the source places the replicas' leaders on ranks {list(source.leaders)}, the loader on {list(leaders)} "
            f"(placement={config.placement!r}, stage_style={config.stage_style!r}): give both the same placement= "
            "and stage_style="
        )
    if schedule is not None:
        from collective_loader.plan.schedules import check_schedule  # imports torch's pipelining only when used

        check_schedule(schedule, settings.place)
