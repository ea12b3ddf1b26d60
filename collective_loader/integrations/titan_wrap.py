"""Any TorchTitan dataloader, built on each replica's leader only; every rank gets its batches.

TorchTitan builds every dataloader the same way, ``config.build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=, local_batch_size=, ...)``, on every rank: every pipeline stage, tp rank and
cp rank of a replica opens the same data and tokenizes the same documents. :func:`wrap_dataloader`
turns such a config (``HuggingFaceTextDataLoader.Config``, ``ChatDataLoader.Config``, a
``BaseDataLoader.Config`` of your own, ...) into one that builds a :class:`ReplicaDataLoader`. It is
the dataloader step of :func:`~collective_loader.integrations.titan_trainer.load_once_per_replica`,
which also extends the trainer to hand the wrapped configs their mesh and its schedule's stage style;
outside TorchTitan's Trainer, give the mesh yourself: ``wrap_dataloader(config, mesh=mesh)`` (and
``stage_style="v"`` under a V schedule).

- on each replica's leader it builds the wrapped loader from the user's config, with exactly the
  arguments TorchTitan passed (the leader's ``dp_rank`` and ``dp_world_size``), so the replica
  trains on the batches an unwrapped run gives that ``dp_rank``; no other rank builds it, opens
  its data or tokenizes;
- every rank of the replica (every stage, tp and cp rank) receives each ``(input_dict, labels)``
  whole, with the keys, dtypes and shapes the wrapped loader yielded: TorchTitan's trainer reads
  ``input_dict`` on every stage and shards sequences over cp itself;
- its checkpoint state is the wrapped loader's own (TorchTitan's ``{"dp_rank_<i>": ...,
  "world_size": dp}`` for TorchTitan's loaders) as it was right after the last batch the trainer
  consumed, produced and restored by the wrapped loader on the leader. Other ranks hold no data
  state (``{}``), so checkpoints of wrapped and unwrapped runs load into each other. TorchTitan's
  loaders keep each DP rank's own iterator position, so a state of another DP degree is refused,
  on every rank, when the leader applies it (:func:`check_degree`).

The wrapped config is a subclass of the user's config class with the same fields (so
``--dataloader.<field>`` flags and TorchTitan's ``replace(config, infinite=...)`` keep working)
plus fields the command line does not see: the data-loading mesh and the pipeline schedule's stage
style, which the trainer hands over (:class:`~collective_loader.integrations.titan_trainer.TitanTrainer`)
or ``wrap_dataloader(config, mesh=)`` sets (:func:`with_mesh`), and the loader it built.
TorchTitan's validator calls ``build()`` at every validation; the wrapped config builds its
:class:`ReplicaDataLoader` once and afterwards has it build a fresh wrapped loader at the next
``iter()``, so each validation starts from the beginning of its data over the same process groups.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
import torch.distributed as dist
import tyro
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.dataloader import BaseDataLoader

from collective_loader.integrations.titan import DATA_MESH
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import StageStyle, mesh_place

__all__ = ["wrap_dataloader"]

# what a delivered batch holds: TorchTitan's pair, as one mapping every stage receives whole
INPUT_DICT, LABELS = "input_dict", "labels"


class NeedsMesh:
    """A dataloader config whose loader needs TorchTitan's data-loading mesh, which the Trainer does
    not pass to ``build()``: its ``_mesh`` field (hidden from the command line) takes it, and its
    ``_stage_style`` field the stage style of the Trainer's pipeline schedule
    (:func:`~collective_loader.integrations.titan.titan_stage_style`), both set by :func:`with_mesh`.
    ``TitanStreamingDataLoader.Config`` and every wrapped config are ones."""

    __slots__ = ()
    _mesh: DeviceMesh | None
    _stage_style: StageStyle


class Wrapped(NeedsMesh):
    """A config from :func:`wrap_dataloader`: ``user_class`` is the config class it wraps, ``_built``
    the :class:`ReplicaDataLoader` it built."""

    __slots__ = ()
    user_class: ClassVar[type[BaseDataLoader.Config]]
    _built: ReplicaDataLoader | None


class _LeaderSource:
    """On a leader: the wrapped loader as a :class:`CollectiveLoader` source.

    Yields ``{"input_dict": ..., "labels": ...}``. ``state_dict()`` is the wrapped loader's state,
    pickled into a uint8 tensor: a snapshot (later, prefetched batches do not change it), and a
    value the loader's state exchange carries whatever the state holds (TorchTitan's loaders keep
    bytes). Only this leader unpickles it (:func:`_snapshot_state`). A loaded state and a renewal
    are applied at the next ``iter()``, on the transfer thread, so that a failure there reaches
    every rank of every replica through the delivery protocol.
    """

    def __init__(self, build: Callable[[], BaseDataLoader], dp_world_size: int) -> None:
        self.build = build
        self.dp_world_size = dp_world_size
        self.loader = build()
        self.pending: dict[str, Any] | None = None  # a loaded state not yet handed to the loader
        self.renew = False  # build a fresh loader at the next iter()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.renew:
            self.loader, self.renew = self.build(), False
        if self.pending is not None:
            check_degree(type(self.loader).__qualname__, self.pending.get("world_size"), self.dp_world_size)
            self.loader.load_state_dict(self.pending)
            self.pending = None
        for input_dict, labels in self.loader:
            yield {INPUT_DICT: input_dict, LABELS: labels}

    def state_dict(self) -> torch.Tensor:
        state = self.pending if self.pending is not None else self.loader.state_dict()
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def check_degree(loader: str, saved: int | None, dp_world_size: int) -> None:
    """Refuse a TorchTitan loader's state saved with ``saved`` (its ``world_size``) data-parallel
    ranks when this run has ``dp_world_size``: that state is each DP rank's own position in its
    share of the data, which another number of ranks cannot take over.

    >>> check_degree("HuggingFaceTextDataLoader", 2, 1)
    Traceback (most recent call last):
    ...
    ValueError: the HuggingFaceTextDataLoader state was saved with 2 data-parallel ranks and this run has 1: its state is each DP rank's own iterator position in its share of the data (a per-rank iterator state), which cannot be split over another number of ranks; resume on 2 data-parallel ranks, or start the dataloader afresh (--checkpoint.exclude_from_loading dataloader); an MDS dataset read by TitanStreamingDataLoader resumes on any DP degree
    """
    if saved is None or saved == dp_world_size:
        return
    raise ValueError(
        f"the {loader} state was saved with {saved} data-parallel ranks and this run has {dp_world_size}: its state is "
        "each DP rank's own iterator position in its share of the data (a per-rank iterator state), which cannot be "
        f"split over another number of ranks; resume on {saved} data-parallel ranks, or start the dataloader afresh "
        "(--checkpoint.exclude_from_loading dataloader); an MDS dataset read by TitanStreamingDataLoader resumes on "
        "any DP degree"
    )


def _snapshot_state(snapshot: torch.Tensor) -> dict[str, Any]:
    """The state a leader's :meth:`_LeaderSource.state_dict` took."""
    return pickle.loads(snapshot.numpy().tobytes())


class ReplicaDataLoader(BaseDataLoader):
    """A TorchTitan dataloader config's loader, built on each replica's leader and delivered to
    every rank of the replica. Made by the ``build()`` of a config from :func:`wrap_dataloader`,
    with TorchTitan's usual arguments (passed on to the wrapped config's ``build()`` unchanged).

    Yields ``(input_dict, labels)`` on every rank: what the wrapped loader yielded on the leader,
    every key, dtype and shape kept (e.g. TorchTitan's text loaders: ``input`` and ``positions``
    of shape ``[local_batch_size, seq_len]``, labels the same shape).

    Example (what TorchTitan's Trainer does with ``config.dataloader``; outside it, wrap with the mesh)::

        config = wrap_dataloader(HuggingFaceTextDataLoader.Config(dataset="c4"), mesh=mesh)
        dataloader = config.build(dp_world_size=2, dp_rank=0, tokenizer=tokenizer,
                                  seq_len=2048, local_batch_size=8)
        for input_dict, labels in dataloader:   # every rank of the replica, every stage
            ...
    """

    def __init__(self, config: BaseDataLoader.Config, *, dp_world_size: int, dp_rank: int, **build: Any) -> None:
        assert isinstance(config, Wrapped), type(config)  # built by _build_once only
        mesh = config._mesh
        if mesh is None:
            raise ValueError(
                f"{type(config).__qualname__} needs TorchTitan's data-loading mesh, which the Trainer does not pass "
                "to dataloaders: build the trainer from collective_loader.integrations.titan_trainer "
                "(load_once_per_replica(config) does), or, outside the Trainer, wrap with wrap_dataloader(config, "
                "mesh=mesh)"
            )
        stage_style = config._stage_style
        place = mesh_place(mesh, dist.get_rank(), stage_style=stage_style)
        if (place.dp_rank, place.dp_size) != (dp_rank, dp_world_size):
            raise ValueError(
                f"the mesh puts this rank in replica {place.dp_rank} of {place.dp_size}, the Trainer in {dp_rank} of "
                f"{dp_world_size}: give the dataloader the mesh of ParallelDims.get_optional_mesh({DATA_MESH}, "
                "include_singleton_axes=True)"
            )
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.build_args = {"dp_world_size": dp_world_size, "dp_rank": dp_rank, **build}
        inner = unwrap_dataloader(config)
        self._leader: _LeaderSource | None = None

        def leader_source() -> _LeaderSource:  # called on leaders only
            self._leader = _LeaderSource(functools.partial(inner.build, **self.build_args), dp_world_size)
            return self._leader

        self.loader = CollectiveLoader(
            leader_source, mesh, inputs=(), labels=(), every_stage=(INPUT_DICT, LABELS), stage_style=stage_style
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            yield batch[INPUT_DICT], batch[LABELS]

    def renew(self) -> None:
        """Start the next ``iter()`` on a freshly built wrapped loader (what TorchTitan's validator
        expects of each ``build()``); call on every rank."""
        if self._leader is not None:
            self._leader.renew, self._leader.pending = True, None

    def state_dict(self) -> dict[str, Any]:
        """The leader: the wrapped loader's state right after the last consumed batch. Other
        ranks: ``{}``. Collective over the replica: call on every rank after the same step."""
        snapshot = self.loader.state_dict()["source"]
        if self._leader is None:
            return {}
        if snapshot is None:  # no batch consumed yet (or an epoch that ended empty): no thread is in the source
            snapshot = self._leader.state_dict()
        return _snapshot_state(snapshot)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The leader hands ``state_dict`` to the wrapped loader at the next ``iter()``; other
        ranks have nothing to restore. A ``world_size`` other than this run's DP degree raises
        ``ValueError`` there, which every rank receives as ``LeaderError`` (:func:`check_degree`)."""
        if self._leader is not None:
            self._leader.pending = dict(state_dict)

    def close(self) -> None:
        """Stop the transfers; call on every rank before ``destroy_process_group()``."""
        self.loader.close()


def _build_once(config: Wrapped, **build: Any) -> ReplicaDataLoader:
    """``build()`` of a wrapped config: one :class:`ReplicaDataLoader` per config object, renewed
    by each later ``build()`` with the same arguments (TorchTitan's validator builds at every
    validation)."""
    built = config._built
    if built is not None and built.build_args == build:
        built.renew()
        return built
    config._built = ReplicaDataLoader(config, **build)  # type: ignore[misc]  # a field of the made dataclass
    return config._built


# TorchTitan's ``Config.build()`` constructs ``type(config)._owner``, and the Trainer and tyro
# take the dataloader config's class from the config function (``--dataloader.<field>`` are that
# class's fields): so a wrapped config must be an instance of a subclass of the user's own config
# class, made here at run time, one per class, whose ``build()`` makes a ReplicaDataLoader.
def _wrapped_class(config_class: type[BaseDataLoader.Config]) -> type[BaseDataLoader.Config]:
    """The subclass of ``config_class`` that :func:`wrap_dataloader` returns instances of (made once)."""
    if config_class not in _WRAPPED_CLASSES:
        namespace: dict[str, Any] = {
            "__module__": __name__,
            "__qualname__": f"ReplicaDataLoader[{config_class.__qualname__}]",
            "__annotations__": {
                "_mesh": Annotated[DeviceMesh | None, tyro.conf.Suppress],
                "_stage_style": Annotated[str, tyro.conf.Suppress],
                "_built": Annotated[Any, tyro.conf.Suppress],
            },
            "_mesh": None,
            "_stage_style": "loop",
            "_built": None,
            "user_class": config_class,
            "build": _build_once,
        }
        made = types.new_class(
            namespace["__qualname__"], (config_class, Wrapped), exec_body=lambda ns: ns.update(namespace)
        )
        _WRAPPED_CLASSES[config_class] = dataclass(kw_only=True, slots=True)(made)
    return _WRAPPED_CLASSES[config_class]


_WRAPPED_CLASSES: dict[type, type[BaseDataLoader.Config]] = {}


def wrap_dataloader(
    config: BaseDataLoader.Config, *, mesh: DeviceMesh | None = None, stage_style: StageStyle = "loop"
) -> BaseDataLoader.Config:
    """``config`` as a config whose ``build()`` makes a :class:`ReplicaDataLoader`: the same
    class (a subclass of it) and field values. A config already wrapped, or one of a loader that
    delivers collectively itself, is returned as it is.

    ``mesh``: TorchTitan's data-loading mesh (``ParallelDims.get_optional_mesh(["pp", "batch", "cp",
    "tp"], include_singleton_axes=True)``), for a loader built outside TorchTitan's Trainer, and
    ``stage_style`` the stage style of its pipeline schedule (``"v"`` for ``ZBVZeroBubble`` and
    ``DualPipeV``: :func:`~collective_loader.integrations.titan.titan_stage_style`); under the
    Trainer leave both out (``TitanTrainer.init_distributed()`` hands them over).

    >>> from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    >>> wrapped = wrap_dataloader(HuggingFaceTextDataLoader.Config(dataset="c4_test"))
    >>> type(wrapped).__qualname__, wrapped.dataset, isinstance(wrapped, HuggingFaceTextDataLoader.Config)
    ('ReplicaDataLoader[HuggingFaceTextDataLoader.Config]', 'c4_test', True)
    >>> unwrap_dataloader(wrapped) == HuggingFaceTextDataLoader.Config(dataset="c4_test")
    True
    """
    if not isinstance(config, NeedsMesh):
        config = _wrapped_class(type(config))(**_init_fields(config))
    return config if mesh is None else with_mesh(config, mesh, stage_style)


def with_mesh(
    config: BaseDataLoader.Config, mesh: DeviceMesh, stage_style: StageStyle = "loop"
) -> BaseDataLoader.Config:
    """Hand ``mesh``, TorchTitan's data-loading mesh, and ``stage_style``, the stage style of the
    pipeline schedule (:func:`~collective_loader.integrations.titan.titan_stage_style`), to a
    dataloader config that needs them (one from :func:`wrap_dataloader`, a
    ``TitanStreamingDataLoader.Config``); returns ``config``, changed in place.
    ``TitanTrainer.init_distributed()`` does this under TorchTitan's Trainer.

    >>> from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    >>> with_mesh(HuggingFaceTextDataLoader.Config(), mesh=None)
    Traceback (most recent call last):
    ...
    TypeError: HuggingFaceTextDataLoader.Config takes no mesh: wrap it first, wrap_dataloader(config, mesh=mesh)
    """
    if not isinstance(config, NeedsMesh):
        raise TypeError(f"{type(config).__qualname__} takes no mesh: wrap it first, wrap_dataloader(config, mesh=mesh)")
    config._mesh = mesh  # type: ignore[misc]  # a field of each config dataclass: no slot comes from a marker
    config._stage_style = stage_style  # type: ignore[misc]
    return config


def unwrap_dataloader(config: BaseDataLoader.Config) -> BaseDataLoader.Config:
    """The user's config that ``config`` wraps (``config`` itself when it is not wrapped)."""
    if not isinstance(config, Wrapped):
        return config
    return config.user_class(**_init_fields(config, config.user_class))


def _init_fields(config: Any, config_class: type | None = None) -> dict[str, Any]:
    """The constructor arguments that rebuild ``config`` (as ``config_class``)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config_class or config) if f.init}
