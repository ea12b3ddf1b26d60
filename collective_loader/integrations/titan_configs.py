"""TorchTitan 0.3's own Trainer with data loaded once per data-parallel replica, from the command line.

Every config function of TorchTitan's model registries (``torchtitan/models/<family>/config_registry.py``:
llama3, qwen3, qwen3_5, deepseek_v3, gpt_oss, kimi_k2_7, muse_glimmer, flux) is here under its own
name, with one change (:func:`load_once_per_replica`): its dataloaders, training and validation,
are built on one leader per replica and deliver every batch to the replica's other ranks::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module collective_loader.titan_configs --config llama3_8b \\
        --parallelism.pipeline_parallel_degree 2

For your own config function: ``return load_once_per_replica(my_config())``. To read an MDS
dataset instead (:class:`TitanStreamingDataLoader`: token ids, or text the leaders tokenize with
the Trainer's tokenizer and pack): ``return load_mds_once_per_replica(my_config(), dataset_path="/data/mds")``.
Outside the Trainer, one dataloader config: ``wrap_dataloader(config, mesh=mesh)``
(:mod:`.titan_wrap`).

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
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from collective_loader.integrations.titan import TitanDataLoader
from collective_loader.integrations.titan_wrap import with_mesh, wrap_dataloader
from collective_loader.streaming import StreamingSource, lm_collate
from collective_loader.streaming.source import LeaderStream
from collective_loader.text import Balance, Packing, TextColumn, TokenColumn
from collective_loader.text.layouts import INTEGER_TYPES, ColumnLayout

__all__ = [
    "DATA_MESH",
    "CollectiveMesh",
    "TitanStreamingDataLoader",
    "TitanTrainer",
    "collective_trainer_config",
    "load_mds_once_per_replica",
    "load_once_per_replica",
    "titan_collate",
    "with_collective_loader",
]

DATA_MESH = ["pp", "batch", "cp", "tp"]  # TorchTitan's data-loading mesh (ParallelDims.build_mesh)
PACKED_KEYS = {"input_ids": "input", "position_ids": "positions"}  # a packed batch's inputs -> TorchTitan's


def titan_collate(
    samples: Sequence[Mapping[str, Any]], *, seq_len: int, column: str = "tokens", dtype: str | None = None
) -> dict[str, torch.Tensor]:
    """MDS samples of ``seq_len + 1`` tokens -> the batch TorchTitan's text loader yields, labels included.

    ``column`` holds an integer ndarray, or bytes of ``dtype`` (LLM Foundry's ``token_encoding_type``,
    int64 when ``None``). ``positions`` restart at 0 in every sample (one document per sample), as
    TorchTitan's per-document positions do; its attention masks are built from them.

    >>> import numpy as np
    >>> b = titan_collate([{"tokens": np.arange(4)}], seq_len=3)
    >>> b["input"].tolist(), b["positions"].tolist(), b["labels"].tolist()
    ([[0, 1, 2]], [[0, 1, 2]], [[1, 2, 3]])
    """
    batch = lm_collate(samples, key=column, dtype=dtype)
    if batch["input_ids"].shape[1] != seq_len:
        raise ValueError(
            f"the MDS column {column!r} holds {batch['input_ids'].shape[1] + 1} tokens per sample and "
            f"training.seq_len is {seq_len}: write samples of seq_len + 1 tokens, set "
            f"--training.seq_len {batch['input_ids'].shape[1]}, or pack them (--dataloader.pack)"
        )
    return {"input": batch["input_ids"], "positions": batch["position_ids"], "labels": batch["labels"]}


def titan_inputs(input_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A delivered batch's inputs under TorchTitan's names (a packed batch's ``input_ids`` and
    ``position_ids``); other keys, TorchTitan's already, are kept.

    >>> list(titan_inputs({"input_ids": torch.zeros(1), "position_ids": torch.zeros(1)}))
    ['input', 'positions']
    """
    return {PACKED_KEYS.get(key, key): value for key, value in input_dict.items()}


def check_columns(layout: ColumnLayout, columns: Mapping[str, str]) -> None:
    """Refuse a dataset whose columns (name -> MDS encoding) ``layout`` cannot read, naming the
    ``--dataloader`` flag to change. Run on the leaders once the dataset is built.

    >>> check_columns(TokenColumn("tokens", "uint16"), {"tokens": "bytes"})
    >>> check_columns(TokenColumn("tokens"), {"text": "str"})
    Traceback (most recent call last):
    ...
    ValueError: the dataset has no column 'tokens' (it has: text (str)): set --dataloader.column to the column of token ids, or --dataloader.text for a column of text
    """
    column = layout.column
    if column not in columns:
        has = ", ".join(f"{name} ({encoding})" for name, encoding in columns.items())
        what = (
            "of text" if isinstance(layout, TextColumn) else "of token ids, or --dataloader.text for a column of text"
        )
        raise ValueError(
            f"the dataset has no column {column!r} (it has: {has}): set --dataloader.column to the column {what}"
        )
    encoding = columns[column]
    if isinstance(layout, TextColumn):
        if encoding != "str":
            raise ValueError(
                f"--dataloader.text: column {column!r} holds {encoding}, not text (str): leave out --dataloader.text to "
                "read token ids (with --dataloader.token_dtype for bytes)"
            )
    elif encoding == "str":
        raise ValueError(
            f"column {column!r} holds text (str): set --dataloader.text to tokenize it on the leaders with the "
            "Trainer's tokenizer (--hf_assets_path)"
        )
    elif encoding.startswith("ndarray"):
        if layout.dtype is not None:
            raise ValueError(
                f"--dataloader.token_dtype reads token ids written as bytes; column {column!r} holds {encoding}, read "
                "as its own type: leave out --dataloader.token_dtype"
            )
    elif encoding != "bytes":
        raise ValueError(
            f"column {column!r} holds {encoding}: token ids are bytes (with --dataloader.token_dtype, LLM Foundry's "
            "token_encoding_type) or an integer ndarray; for text set --dataloader.text"
        )


def _checked(source: StreamingSource) -> LeaderStream:
    """``source()`` (a leader's stream), its dataset's columns checked against the source's layout."""
    stream = source()
    shards = stream.dataset.shards
    if shards:
        check_columns(source.layout, dict(zip(shards[0].column_names, shards[0].column_encodings)))
    return stream


class TitanStreamingDataLoader(TitanDataLoader, BaseDataLoader):
    """TorchTitan's dataloader, built by its Trainer: a ``StreamingDataset`` read on one leader per
    data-parallel replica, each micro-batch delivered to every rank.

    The dataset is one of LLM Foundry's layouts (``docs/text-data.md``): token ids as bytes of
    ``token_dtype`` or as an integer ndarray, one row of ``seq_len + 1`` tokens per sample, or
    documents of any length packed into such rows (``pack``); or ``text``, tokenized on the leaders
    (and their DataLoader workers) with the ``tokenizer`` the Trainer builds from
    ``--hf_assets_path``, and packed. Packed rows carry per-document ``positions`` (0 at each
    document and each row), from which TorchTitan's block-causal attention builds its masks.

    Yields ``({"input": ..., "positions": ...}, labels)`` of ``local_batch_size`` rows (the
    pipeline micro-batch when pp > 1), on every rank of every stage. Its checkpoint state is
    :class:`~collective_loader.integrations.titan.TitanDataLoader`'s (packed: the leaders' hand-over,
    gathered by ``CollectiveLoader.state_dict``), the same on every rank, so one entry,
    ``dp_rank_0``, which any rank of another mesh reads: a restart may change the DP degree when it
    keeps the global batch (:class:`GlobalBatch`). ``snapshot_every_n_steps`` is not needed (the
    state is taken right after every consumed batch).

    Example (what the Trainer does; ``config.dataloader`` is this class's ``Config``)::

        dataloader = config.dataloader.build(dp_world_size=2, dp_rank=0, tokenizer=tokenizer,
                                             seq_len=2048, local_batch_size=8)
        for input_dict, labels in dataloader:
            ...
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """``--dataloader.<field>``. ``dataset_path`` (from ``BaseDataLoader.Config``) is the local
        directory of an MDS dataset (with ``remote``: its cache)."""

        remote: str | None = None
        """Where streaming downloads shards from into ``dataset_path`` (None: local only)."""

        column: str | None = None
        """The MDS column: ``tokens`` by default, ``text`` with ``text``."""

        token_dtype: str | None = None
        """Token ids written as bytes: their type (LLM Foundry's ``token_encoding_type``; int64 when
        not given, as there). An ndarray column is read as its own type."""

        text: bool = False
        """The column holds text: tokenize it on the leaders with the Trainer's tokenizer
        (``--hf_assets_path``) and pack it."""

        pack: bool = False
        """Samples are documents of any length: pack them into rows of ``seq_len + 1`` tokens (text
        is always packed)."""

        at_end: Literal["pad", "drop"] = "pad"
        """Packing: the epoch's last partial row and batch are padded (labels -100) or dropped."""

        balance: bool = False
        """Packing: the leaders place each step's rows over the data-parallel replicas by attention
        cost, row by row (``Packing(balance=Balance(rows=1))``, docs/text-data.md); a step trains
        the same tokens, and pp = 2 the rows of pp = 1."""

        documents_per_batch: int | None = None
        """Packing: samples per DataLoader batch on a leader (default: the dataloader's batch, the
        micro-batch under pp). Keep it fixed to keep the rows when the micro-batch changes."""

        shuffle: bool = True
        shuffle_seed: int = 9176
        num_canonical_nodes: int | None = None
        """Streaming's; keep it fixed to keep the sample order when the DP degree changes."""

        num_workers: int = 0
        """DataLoader workers per leader (they read, and tokenize text)."""

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
                "(load_mds_once_per_replica(config) does), or give it the mesh: with_mesh(config, mesh)"
            )
        if not config.dataset_path:
            raise ValueError("set --dataloader.dataset_path to the local directory of an MDS dataset")
        layout, packing = read_as(config, tokenizer, seq_len)
        if packing is None:
            assert isinstance(layout, TokenColumn)
            rows: dict[str, Any] = {
                "collate": functools.partial(titan_collate, seq_len=seq_len, column=layout.column, dtype=layout.dtype)
            }
        else:
            rows = {"packing": packing, "documents_per_batch": config.documents_per_batch}
        source = StreamingSource(
            mesh,
            local=config.dataset_path,
            remote=config.remote,
            batch_size=local_batch_size,
            layout=layout,
            shuffle=config.shuffle,
            shuffle_seed=config.shuffle_seed,
            num_canonical_nodes=config.num_canonical_nodes,
            num_workers=config.num_workers,
            timeout=config.timeout,
            **rows,
        )
        inputs = tuple(PACKED_KEYS) if packing else tuple(PACKED_KEYS.values())
        super().__init__(functools.partial(_checked, source), mesh, inputs=inputs, timeout=config.timeout)
        if (self.dp_rank, self.dp_world_size) != (dp_rank, dp_world_size):
            raise ValueError(
                f"the mesh puts this rank in replica {self.dp_rank} of {self.dp_world_size}, the Trainer in "
                f"{dp_rank} of {dp_world_size}: give the dataloader the mesh of "
                f"ParallelDims.get_optional_mesh({DATA_MESH}, include_singleton_axes=True)"
            )
        self.infinite = config.infinite
        self.global_batch = GlobalBatch(
            config.documents_per_batch or local_batch_size, self.dp_world_size, batch_flag(packing, mesh)
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the next ``iter()``, on this DP degree or another; call on every rank.

        Streaming resumes exactly only with the global batch the state was saved with; another
        one raises ``ValueError`` on every rank, naming the flag to set (:meth:`GlobalBatch.check`).
        """
        state = self.loader_state(state_dict)
        if state is not None:
            if state["source"] is not None:
                self.global_batch.check(state["source"]["global_batch"], state["dp_size"])
            self.loader.load_state_dict(state)

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        for epoch in itertools.count():
            delivered = False
            for input_dict, labels in super().__iter__():
                delivered = True
                yield titan_inputs(input_dict), labels
            # a resumed epoch may have nothing left; a fresh one that is empty never fills
            if not self.infinite or (epoch > 0 and not delivered):
                return


# one row at a time: TorchTitan's pipeline loads one micro-batch per loader step, and the rows
# must be placed as without the pipeline for pp = 2 to train pp = 1's rows
BALANCE = Balance(rows=1)


def batch_flag(packing: Packing | None, mesh: Any) -> str:
    """The flag that sets a leader's samples per DataLoader batch: the packing's sample-batch, or
    the dataloader's batch, which TorchTitan takes from the micro-batch under pp."""
    if packing is not None:
        return "--dataloader.documents_per_batch"
    pp = mesh.size(mesh.mesh_dim_names.index("pp")) if "pp" in (mesh.mesh_dim_names or ()) else 1
    return "--parallelism.pipeline_parallel_microbatch_size" if pp > 1 else "--training.local_batch_size"


@dataclass(frozen=True)
class GlobalBatch:
    """This run's samples per DataLoader batch on each leader, ``per_replica``, times its DP degree
    ``dp``: what streaming's state counts in, which a resume must keep; ``flag`` sets ``per_replica``."""

    per_replica: int
    dp: int
    flag: str

    def check(self, saved: int, saved_dp: int) -> None:
        """Refuse a state saved with a global batch of ``saved`` samples over ``saved_dp`` replicas
        unless it is this run's, naming the value of ``flag`` that resumes it.

        >>> GlobalBatch(4, 1, "--training.local_batch_size").check(8, 2)
        Traceback (most recent call last):
        ...
        ValueError: the dataloader state was saved with a global batch of 8 samples (4 x 2 data-parallel replicas) and this run's is 4 (4 x 1): streaming resumes exactly only with the same global batch: set --training.local_batch_size 8
        """
        if saved == self.per_replica * self.dp:
            return
        what = (
            f"the dataloader state was saved with a global batch of {saved} samples ({saved // saved_dp} x {saved_dp} "
            f"data-parallel replicas) and this run's is {self.per_replica * self.dp} ({self.per_replica} x {self.dp}): "
            "streaming resumes exactly only with the same global batch"
        )
        if saved % self.dp:
            raise ValueError(
                f"{what}, which {self.dp} replicas cannot split: resume on a data-parallel degree that divides {saved}, "
                "or start the dataloader afresh (--checkpoint.exclude_from_loading dataloader)"
            )
        raise ValueError(f"{what}: set {self.flag} {saved // self.dp}")


def read_as(
    config: TitanStreamingDataLoader.Config, tokenizer: Any, seq_len: int
) -> tuple[ColumnLayout, Packing | None]:
    """How the leaders read the dataset of ``config``: its layout, and the packing when documents
    are packed. Options that do not fit together raise ``ValueError`` naming the flag to change
    (on every rank: the Trainer builds the dataloader on every rank).

    >>> read_as(TitanStreamingDataLoader.Config(token_dtype="uint16"), None, seq_len=8)
    (TokenColumn(column='tokens', dtype='uint16'), None)
    >>> packing = read_as(TitanStreamingDataLoader.Config(pack=True), None, seq_len=8)[1]
    >>> packing.seq_len, packing.at_end, packing.boundaries
    (8, 'pad', ('position_ids',))
    """
    if config.token_dtype is not None and config.token_dtype not in INTEGER_TYPES:
        raise ValueError(
            f"--dataloader.token_dtype {config.token_dtype}: token ids are integers; give one of "
            f"{', '.join(INTEGER_TYPES)} (the token_encoding_type they were written with)"
        )
    layout: ColumnLayout
    if config.text:
        if config.token_dtype is not None:
            raise ValueError(
                "--dataloader.token_dtype reads token ids written as bytes; with --dataloader.text the column is text, "
                "tokenized on the leaders: leave out --dataloader.token_dtype"
            )
        if tokenizer is None:
            raise ValueError(
                "--dataloader.text tokenizes with the tokenizer the Trainer builds, and it passed none: set "
                "--hf_assets_path to the directory of its tokenizer.json"
            )
        layout = TextColumn(tokenizer, column=config.column or "text")
    else:
        layout = TokenColumn(config.column or "tokens", config.token_dtype)
    if config.text or config.pack:
        return layout, Packing(seq_len, config.at_end, ("position_ids",), BALANCE if config.balance else None)
    if config.documents_per_batch is not None or config.at_end != "pad" or config.balance:
        raise ValueError(
            "--dataloader.documents_per_batch, --dataloader.at_end and --dataloader.balance say how documents are "
            "packed: add --dataloader.pack (token ids of any length) or --dataloader.text, or leave them out"
        )
    return layout, None


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
                with_mesh(dataloader, mesh)
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


def load_mds_once_per_replica(config: Trainer.Config, **dataloader: Any) -> Trainer.Config:
    """``config`` with its trainer extended (:func:`collective_trainer_config`) and its dataloader
    replaced by ``TitanStreamingDataLoader.Config(**dataloader)``: an MDS dataset read on one leader
    per replica. (:func:`load_once_per_replica` instead keeps the config's own dataloader.)

    >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
    >>> c = load_mds_once_per_replica(llama3_debugmodel(), dataset_path="/data/mds")
    >>> type(c).__qualname__, c.dataloader.dataset_path, c.training.seq_len
    ('TitanTrainer.Config', '/data/mds', 2048)
    """
    config = collective_trainer_config(config)
    config.dataloader = TitanStreamingDataLoader.Config(**dataloader)
    return config


def with_collective_loader(config: Trainer.Config, **dataloader: Any) -> Trainer.Config:
    """Deprecated: the earlier name of :func:`load_mds_once_per_replica`, which it calls."""
    warnings.warn(
        "with_collective_loader is deprecated: call load_mds_once_per_replica(config, dataset_path=...), "
        "which does the same",
        DeprecationWarning,
        stacklevel=2,
    )
    return load_mds_once_per_replica(config, **dataloader)


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
