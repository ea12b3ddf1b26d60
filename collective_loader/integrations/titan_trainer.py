"""TorchTitan 0.3's Trainer with its data loaded once per data-parallel replica: config functions.

For your own config function, one line keeps its dataloaders and builds them on one leader per
replica (:func:`load_once_per_replica`); for an MDS dataset read by the leaders, set the dataloader to
a :class:`~.titan_streaming.TitanStreamingDataLoader` config first::

    def my_run():
        return load_once_per_replica(llama3_8b())

    def my_mds_run():
        config = llama3_8b()
        config.dataloader = TitanStreamingDataLoader.Config(dataset_path="/data/mds")
        return load_once_per_replica(config)

TorchTitan builds its dataloader with ``config.dataloader.build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)``, without the mesh, which the
loader needs to know each rank's pipeline stage and replica. So the trainer is
:class:`TitanTrainer`, TorchTitan's ``Trainer`` with one method extended: ``init_distributed()``
hands TorchTitan's data-loading mesh ``["pp", "batch", "cp", "tp"]`` to the dataloader configs
before the Trainer builds them, with the stage style of ``--parallelism.pipeline_parallel_schedule``
(``"v"`` for ZBVZeroBubble and DualPipeV, whose last stage TorchTitan puts on pp rank 0:
:func:`~collective_loader.integrations.titan.titan_stage_style`). Nothing else of the Trainer
changes. A config of another trainer class (``FluxTrainer.Config``, a ``Trainer.Config``
subclass) gets the same extension of its own trainer class (:func:`collective_trainer_config`).
Every config function of TorchTitan's registries, so changed, is on the command line:
``--module collective_loader.integrations.titan_configs``.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any

from torchtitan.components.validate import Validator
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from collective_loader.integrations.titan import DATA_MESH, titan_stage_style
from collective_loader.integrations.titan_wrap import NeedsMesh, with_mesh, wrap_dataloader

__all__ = ["load_once_per_replica"]


class CollectiveMesh:
    """Extends a TorchTitan ``Trainer`` class: ``init_distributed()`` also hands TorchTitan's
    data-loading mesh, and the stage style of its pipeline schedule, to the dataloader configs
    that need them (training and validation)."""

    config: Trainer.Config

    def init_distributed(self) -> ParallelDims:
        parallel_dims = super().init_distributed()  # type: ignore[misc]
        mesh = parallel_dims.get_optional_mesh(DATA_MESH, include_singleton_axes=True)
        style = titan_stage_style(self.config.parallelism.pipeline_parallel_schedule, parallel_dims.pp)
        for dataloader in _dataloaders(self.config):
            if isinstance(dataloader, NeedsMesh):
                with_mesh(dataloader, mesh, style)
        return parallel_dims


class TitanTrainer(CollectiveMesh, Trainer):
    """TorchTitan's ``Trainer``; ``init_distributed()`` also hands the data-loading mesh to the
    dataloader configs (see :class:`CollectiveMesh`). Build it from ``TitanTrainer.Config`` (see
    :func:`load_once_per_replica`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass


def _dataloaders(config: Trainer.Config) -> list[Any]:
    """The dataloader configs of ``config``: training, and validation when its validator has one."""
    if isinstance(config.validator, Validator.Config):
        return [config.dataloader, config.validator.dataloader]
    return [config.dataloader]


# TorchTitan's ``Config.build()`` constructs ``type(config)._owner``, the class that declares the
# Config (set by ``Configurable.__init_subclass__``), so a trainer class other than ``Trainer``
# (``FluxTrainer``, one's own) is extended by a subclass made here at run time, one per class.
def _collective_config_class(config_class: type[Trainer.Config]) -> type[Trainer.Config]:
    """The config class of ``config_class``'s trainer extended by :class:`CollectiveMesh` (made once)."""
    owner = config_class._owner
    if not (isinstance(owner, type) and issubclass(owner, Trainer)):
        raise TypeError(
            f"{config_class.__qualname__} is not the config of a TorchTitan Trainer (its _owner is {owner!r})"
        )
    if issubclass(owner, CollectiveMesh):
        return config_class
    if config_class is Trainer.Config:
        return TitanTrainer.Config
    if config_class not in _COLLECTIVE_CONFIGS:
        name = f"Collective[{owner.__qualname__}]"
        made = types.new_class(
            "Config",
            (config_class,),
            exec_body=lambda ns: ns.update(__module__=__name__, __qualname__=f"{name}.Config"),
        )
        config: type[Trainer.Config] = dataclass(kw_only=True, slots=True)(made)
        # the trainer class; Configurable.__init_subclass__ makes it the config's _owner, which build() constructs
        types.new_class(
            name, (CollectiveMesh, owner), exec_body=lambda ns: ns.update(__module__=__name__, Config=config)
        )
        _COLLECTIVE_CONFIGS[config_class] = config
    return _COLLECTIVE_CONFIGS[config_class]


_COLLECTIVE_CONFIGS: dict[type, type[Trainer.Config]] = {}


def collective_trainer_config(config: Trainer.Config) -> Trainer.Config:
    """``config`` (fields shared, not copied) as a config of its trainer class extended by
    :class:`CollectiveMesh`: ``TitanTrainer.Config`` for a ``Trainer.Config``.

    >>> from torchtitan.models.flux.config_registry import flux_debugmodel
    >>> type(collective_trainer_config(flux_debugmodel())).__qualname__
    'Collective[FluxTrainer].Config'
    """
    config_class = _collective_config_class(type(config))
    if type(config) is config_class:
        return config
    return config_class(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})


def load_once_per_replica(config: Trainer.Config) -> Trainer.Config:
    """``config`` with its dataloaders (``dataloader`` and ``validator.dataloader``) built on one
    leader per data-parallel replica and delivered to every rank of it (:func:`~.titan_wrap.wrap_dataloader`),
    and its trainer extended to hand them the mesh (:func:`collective_trainer_config`). Their
    classes and fields are kept, so ``--dataloader.<field>`` works as before. A dataloader that
    delivers collectively itself (``TitanStreamingDataLoader``, an MDS dataset read on the leaders)
    is kept as it is.

    >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
    >>> c = load_once_per_replica(llama3_debugmodel())
    >>> type(c).__qualname__, type(c.dataloader).__qualname__, c.dataloader.dataset
    ('TitanTrainer.Config', 'ReplicaDataLoader[HuggingFaceTextDataLoader.Config]', 'c4_test')
    >>> from collective_loader.integrations.titan_streaming import TitanStreamingDataLoader
    >>> c = llama3_debugmodel()
    >>> c.dataloader = TitanStreamingDataLoader.Config(dataset_path="/data/mds")
    >>> type(load_once_per_replica(c).dataloader).__qualname__
    'TitanStreamingDataLoader.Config'
    """
    config = collective_trainer_config(config)
    config.dataloader = wrap_dataloader(config.dataloader)
    if isinstance(config.validator, Validator.Config):
        config.validator.dataloader = wrap_dataloader(config.validator.dataloader)
    return config
