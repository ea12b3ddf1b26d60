"""TorchTitan 0.3's own Trainer on :class:`~collective_loader.integrations.titan.TitanDataLoader`, from the command line.

Every llama3 config of TorchTitan is here under its own name, with its dataloader replaced by
:class:`TitanStreamingDataLoader` (an MDS dataset that only the data-parallel leaders read)::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module collective_loader.integrations.titan_configs --config llama3_8b \\
        --dataloader.dataset_path /data/mds --parallelism.pipeline_parallel_degree 2

For your own config function: ``return with_collective_loader(my_config(), dataset_path="/data/mds")``.

TorchTitan builds its dataloader with ``config.dataloader.build(dp_world_size=, dp_rank=,
tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)``, without the mesh, which the
loader needs to know each rank's pipeline stage and replica. So the trainer is
:class:`TitanTrainer`, TorchTitan's ``Trainer`` with one method extended: ``init_distributed()``
hands TorchTitan's data-loading mesh ``["pp", "batch", "cp", "tp"]`` to the dataloader config
before the Trainer builds the dataloader. Nothing else of the Trainer changes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from collective_loader.integrations.titan import TitanDataLoader
from collective_loader.streaming import StreamingSource, lm_collate

__all__ = ["DATA_MESH", "TitanStreamingDataLoader", "TitanTrainer", "titan_collate", "with_collective_loader"]

DATA_MESH = ["pp", "batch", "cp", "tp"]  # TorchTitan's data-loading mesh (ParallelDims.build_mesh)


def titan_collate(samples: Sequence[Mapping[str, Any]], *, seq_len: int, column: str = "tokens") -> dict[str, torch.Tensor]:
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
            mesh, local=config.dataset_path, remote=config.remote, batch_size=local_batch_size,
            collate=functools.partial(titan_collate, seq_len=seq_len, column=config.column),
            shuffle=config.shuffle, shuffle_seed=config.shuffle_seed, num_canonical_nodes=config.num_canonical_nodes,
            num_workers=config.num_workers, timeout=config.timeout,
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


class TitanTrainer(Trainer):
    """TorchTitan's ``Trainer``; ``init_distributed()`` also hands the data-loading mesh to a
    :class:`TitanStreamingDataLoader` config. Build it from ``TitanTrainer.Config`` (see
    :func:`with_collective_loader`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def init_distributed(self) -> ParallelDims:
        parallel_dims = super().init_distributed()
        if isinstance(self.config.dataloader, TitanStreamingDataLoader.Config):
            self.config.dataloader._mesh = parallel_dims.get_optional_mesh(DATA_MESH, include_singleton_axes=True)
        return parallel_dims


def with_collective_loader(config: Trainer.Config, **dataloader: Any) -> TitanTrainer.Config:
    """``config`` with ``TitanTrainer`` as its trainer and a ``TitanStreamingDataLoader.Config(**dataloader)``.

    >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
    >>> c = with_collective_loader(llama3_debugmodel(), dataset_path="/data/mds")
    >>> type(c).__qualname__, c.dataloader.dataset_path, c.training.seq_len
    ('TitanTrainer.Config', '/data/mds', 2048)
    """
    if type(config) not in (Trainer.Config, TitanTrainer.Config):
        raise TypeError(
            f"{type(config).__qualname__} is not Trainer.Config: for a Trainer subclass of your own, subclass "
            "collective_loader.integrations.titan_configs.TitanTrainer instead and set config.dataloader yourself"
        )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["dataloader"] = TitanStreamingDataLoader.Config(**dataloader)
    return TitanTrainer.Config(**fields)


def __getattr__(name: str) -> Callable[[], TitanTrainer.Config]:
    """``--config <name>``: TorchTitan's llama3 config function ``name``, with our dataloader."""
    from torchtitan.models.llama3 import config_registry

    stock = getattr(config_registry, name, None)
    if not name.startswith("llama3") or not callable(stock):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    @functools.wraps(stock)
    def config() -> TitanTrainer.Config:
        return with_collective_loader(stock())

    return config


def __dir__() -> list[str]:
    # TorchTitan lists dir(module) when --config names no function here
    from torchtitan.models.llama3 import config_registry

    return sorted({*globals(), *(name for name in dir(config_registry) if name.startswith("llama3"))})
