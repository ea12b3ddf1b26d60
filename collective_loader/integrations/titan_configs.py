"""TorchTitan 0.3's own Trainer with data loaded once per data-parallel replica, from the command line.

Every config function of TorchTitan's model registries (``torchtitan/models/<family>/config_registry.py``:
llama3, qwen3, qwen3_5, deepseek_v3, gpt_oss, kimi_k2_7, muse_glimmer, flux) is here under its own
name, with one change (:func:`load_once_per_replica`): its dataloaders, training and validation,
are built on one leader per replica and deliver every batch to the replica's other ranks::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module collective_loader.titan_configs --config llama3_8b \\
        --parallelism.pipeline_parallel_degree 2

For your own config function: ``return load_once_per_replica(my_config())``. To read an MDS
dataset of token ids instead (:class:`TitanStreamingDataLoader`):
``return with_collective_loader(my_config(), dataset_path="/data/mds")``.

TorchTitan builds its dataloader with ``config.dataloader.build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)``, without the mesh, which the
loader needs to know each rank's pipeline stage and replica. So the trainer is
:class:`TitanTrainer`, TorchTitan's ``Trainer`` with one method extended: ``init_distributed()``
hands TorchTitan's data-loading mesh ``["pp", "batch", "cp", "tp"]`` to the dataloader configs
before the Trainer builds them. Nothing else of the Trainer changes. A config of another trainer
class (``FluxTrainer.Config``, a ``Trainer.Config`` subclass) gets the same extension of its own
trainer class (:func:`collective_trainer_config`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from collective_loader.integrations.titan import TitanDataLoader
from collective_loader.integrations.titan_wrap import wrap_dataloader
from collective_loader.streaming import StreamingSource, lm_collate

__all__ = [
    "DATA_MESH",
    "CollectiveMesh",
    "TitanStreamingDataLoader",
    "TitanTrainer",
    "collective_trainer_config",
    "load_once_per_replica",
    "titan_collate",
    "with_collective_loader",
]

DATA_MESH = ["pp", "batch", "cp", "tp"]  # TorchTitan's data-loading mesh (ParallelDims.build_mesh)


def titan_collate(
    samples: Sequence[Mapping[str, Any]], *, seq_len: int, column: str = "tokens"
) -> dict[str, torch.Tensor]:
    """MDS samples of ``seq_len + 1`` tokens -> the batch TorchTitan's text loader yields, labels included.

    ``positions`` restart at 0 in every sample (one document per sample), as TorchTitan's
    per-document positions do; its attention masks are built from them.

    >>> import numpy as np
    >>> b = titan_collate([{"tokens": np.arange(4)}], seq_len=3)
    >>> b["input"].tolist(), b["positions"].tolist(), b["labels"].tolist()
    ([[0, 1, 2]], [[0, 1, 2]], [[1, 2, 3]])
    """
    batch = lm_collate(samples, key=column)
    if batch["input_ids"].shape[1] != seq_len:
        raise ValueError(
            f"the MDS column {column!r} holds {batch['input_ids'].shape[1] + 1} tokens per sample and "
            f"training.seq_len is {seq_len}: write samples of seq_len + 1 tokens, or set "
            f"--training.seq_len {batch['input_ids'].shape[1]}"
        )
    return {"input": batch["input_ids"], "positions": batch["position_ids"], "labels": batch["labels"]}


class TitanStreamingDataLoader(TitanDataLoader, BaseDataLoader):
    """TorchTitan's dataloader, built by its Trainer: a ``StreamingDataset`` of pre-tokenized
    samples on one leader per data-parallel replica, each micro-batch delivered to every rank.

    Yields ``({"input": ..., "positions": ...}, labels)`` of ``local_batch_size`` samples (the
    pipeline micro-batch when pp > 1), on every rank of every stage. Its checkpoint state is
    :class:`~collective_loader.integrations.titan.TitanDataLoader`'s. ``tokenizer`` is not used (the samples
    are token ids already) and ``snapshot_every_n_steps`` is not needed (the state is taken
    right after every consumed batch).

    Example (what the Trainer does; ``config.dataloader`` is this class's ``Config``)::

        dataloader = config.dataloader.build(dp_world_size=2, dp_rank=0, tokenizer=None,
                                             seq_len=2048, local_batch_size=8)
        for input_dict, labels in dataloader:
            ...
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """``--dataloader.<field>``. ``dataset_path`` (from ``BaseDataLoader.Config``) is the local
        directory of an MDS dataset whose ``column`` holds ``seq_len + 1`` token ids per sample."""

        remote: str | None = None
        """Where streaming downloads shards from into ``dataset_path`` (None: local only)."""

        column: str = "tokens"
        """The MDS column of token ids."""

        shuffle: bool = True
        shuffle_seed: int = 9176
        num_canonical_nodes: int | None = None
        """Streaming's; keep it fixed to keep the sample order when the DP degree changes."""

        num_workers: int = 0
        """DataLoader workers per leader."""

        infinite: bool = True
        """Start a new epoch when the dataset ends, as TorchTitan's own text loader does."""

        timeout: float = 600.0
        """Seconds any rank waits for a batch (and a leader for its source) before raising."""

        _mesh: Annotated[Any, tyro.conf.Suppress] = None
        """Set by ``TitanTrainer.init_distributed()``; not a command-line field."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        mesh = config._mesh
        if mesh is None:
            raise ValueError(
                "TitanStreamingDataLoader needs TorchTitan's mesh, which the Trainer does not pass to "
                "dataloaders: build the trainer from collective_loader.integrations.titan_configs.TitanTrainer.Config "
                "(with_collective_loader(config) does)"
            )
        if not config.dataset_path:
            raise ValueError(
                f"set --dataloader.dataset_path to the local directory of an MDS dataset with a column "
                f"{config.column!r} of seq_len + 1 token ids per sample"
            )
        source = StreamingSource(
            mesh,
            local=config.dataset_path,
            remote=config.remote,
            batch_size=local_batch_size,
            collate=functools.partial(titan_collate, seq_len=seq_len, column=config.column),
            shuffle=config.shuffle,
            shuffle_seed=config.shuffle_seed,
            num_canonical_nodes=config.num_canonical_nodes,
            num_workers=config.num_workers,
            timeout=config.timeout,
        )
        super().__init__(source, mesh, inputs=("input", "positions"), timeout=config.timeout)
        if (self.dp_rank, self.dp_world_size) != (dp_rank, dp_world_size):
            raise ValueError(
                f"the mesh puts this rank in replica {self.dp_rank} of {self.dp_world_size}, the Trainer in "
                f"{dp_rank} of {dp_world_size}: give the dataloader the mesh of "
                f"ParallelDims.get_optional_mesh({DATA_MESH}, include_singleton_axes=True)"
            )
        self.infinite = config.infinite

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        for epoch in itertools.count():
            delivered = False
            for pair in super().__iter__():
                delivered = True
                yield pair
            # a resumed epoch may have nothing left; a fresh one that is empty never fills
            if not self.infinite or (epoch > 0 and not delivered):
                return


class CollectiveMesh:
    """Extends a TorchTitan ``Trainer`` class: ``init_distributed()`` also hands TorchTitan's
    data-loading mesh to the dataloader configs that need it (training and validation)."""

    config: Trainer.Config

    def init_distributed(self) -> ParallelDims:
        parallel_dims = super().init_distributed()  # type: ignore[misc]
        mesh = parallel_dims.get_optional_mesh(DATA_MESH, include_singleton_axes=True)
        validation = getattr(self.config.validator, "dataloader", None)
        for dataloader in (self.config.dataloader, validation):
            if hasattr(dataloader, "_mesh"):  # TitanStreamingDataLoader's, wrap_dataloader's
                dataloader._mesh = mesh  # type: ignore[union-attr]
        return parallel_dims


class TitanTrainer(CollectiveMesh, Trainer):
    """TorchTitan's ``Trainer``; ``init_distributed()`` also hands the data-loading mesh to the
    dataloader configs (see :class:`CollectiveMesh`). Build it from ``TitanTrainer.Config`` (see
    :func:`load_once_per_replica`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass


def _collective_trainer_class(config_class: type[Trainer.Config]) -> type[Trainer.Config]:
    """The config class of ``config_class``'s trainer extended by :class:`CollectiveMesh` (made once)."""
    if config_class in _COLLECTIVE_TRAINERS:
        return _COLLECTIVE_TRAINERS[config_class]
    owner = config_class._owner
    if not (isinstance(owner, type) and issubclass(owner, Trainer)):
        raise TypeError(
            f"{config_class.__qualname__} is not the config of a TorchTitan Trainer (its _owner is {owner!r})"
        )
    if issubclass(owner, CollectiveMesh):
        return config_class
    if config_class is Trainer.Config:
        return TitanTrainer.Config

    class Collective(CollectiveMesh, owner):  # type: ignore[valid-type, misc]
        @dataclass(kw_only=True, slots=True)
        class Config(config_class):  # type: ignore[valid-type, misc]
            pass

    Collective.__name__ = Collective.__qualname__ = f"Collective[{owner.__qualname__}]"
    Collective.Config.__qualname__ = f"{Collective.__qualname__}.Config"
    _COLLECTIVE_TRAINERS[config_class] = Collective.Config
    return Collective.Config


_COLLECTIVE_TRAINERS: dict[type, type[Trainer.Config]] = {}


def collective_trainer_config(config: Trainer.Config) -> Trainer.Config:
    """``config`` (fields shared, not copied) as a config of its trainer class extended by
    :class:`CollectiveMesh`: ``TitanTrainer.Config`` for a ``Trainer.Config``.

    >>> from torchtitan.models.flux.config_registry import flux_debugmodel
    >>> type(collective_trainer_config(flux_debugmodel())).__qualname__
    'Collective[FluxTrainer].Config'
    """
    config_class = _collective_trainer_class(type(config))
    if type(config) is config_class:
        return config
    return config_class(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})


def load_once_per_replica(config: Trainer.Config) -> Trainer.Config:
    """``config`` with its dataloaders (``dataloader`` and ``validator.dataloader``) built on one
    leader per data-parallel replica and delivered to every rank of it (:func:`wrap_dataloader`),
    and its trainer extended to hand them the mesh (:func:`collective_trainer_config`). Their
    classes and fields are kept, so ``--dataloader.<field>`` works as before.

    >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
    >>> c = load_once_per_replica(llama3_debugmodel())
    >>> type(c).__qualname__, type(c.dataloader).__qualname__, c.dataloader.dataset
    ('TitanTrainer.Config', 'ReplicaDataLoader[HuggingFaceTextDataLoader.Config]', 'c4_test')
    """
    config = collective_trainer_config(config)
    config.dataloader = wrap_dataloader(config.dataloader)
    if hasattr(config.validator, "dataloader"):
        config.validator.dataloader = wrap_dataloader(config.validator.dataloader)
    return config


def with_collective_loader(config: Trainer.Config, **dataloader: Any) -> Trainer.Config:
    """``config`` with its trainer extended (:func:`collective_trainer_config`) and a
    ``TitanStreamingDataLoader.Config(**dataloader)``: an MDS dataset of token ids.

    >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
    >>> c = with_collective_loader(llama3_debugmodel(), dataset_path="/data/mds")
    >>> type(c).__qualname__, c.dataloader.dataset_path, c.training.seq_len
    ('TitanTrainer.Config', '/data/mds', 2048)
    """
    config = collective_trainer_config(config)
    config.dataloader = TitanStreamingDataLoader.Config(**dataloader)
    return config


@functools.cache
def _registry_configs() -> dict[str, str]:
    """Config function name -> its registry module, for every TorchTitan model family.

    Read from the registries' source (public top-level functions whose parameters all have
    defaults), so that ``--config NAME`` imports only NAME's family, and a family whose imports
    fail here (qwen3_5 needs the ``fla`` package) still lists its names and fails, when chosen,
    with TorchTitan's own error.
    """
    import torchtitan.models

    found: dict[str, str] = {}
    root = os.path.dirname(torchtitan.models.__file__)
    for family in sorted(torchtitan.models._supported_models):
        path = os.path.join(root, family, "config_registry.py")
        with open(path) as f:
            functions = [node for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)]
        for function in functions:
            args = function.args
            every_default = len(args.defaults) == len(args.posonlyargs + args.args) and None not in args.kw_defaults
            if every_default and not function.name.startswith("_"):
                found[function.name] = f"torchtitan.models.{family}.config_registry"
    return found


def __getattr__(name: str) -> Callable[[], Trainer.Config]:
    """``--config <name>``: TorchTitan's config function ``name``, loading once per replica. Its
    registry is imported when the function is called (TorchTitan looks up every listed name)."""
    registry = _registry_configs().get(name)
    if registry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def config() -> Trainer.Config:
        return load_once_per_replica(getattr(importlib.import_module(registry), name)())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"``{registry}.{name}()`` with ``load_once_per_replica``."
    return config


def __dir__() -> list[str]:
    # TorchTitan lists the callables of dir(module) when --config names none of them
    return sorted({*__all__, *_registry_configs()})
