"""An MDS dataset read on one leader per data-parallel replica, as TorchTitan's dataloader.

:class:`TitanStreamingDataLoader` is the ``--dataloader`` of a config passed through
:func:`~collective_loader.integrations.titan_trainer.load_once_per_replica`: a ``StreamingDataset``
in any of LLM Foundry's layouts (token ids as bytes or ndarray, or text the leaders tokenize with
the Trainer's tokenizer and pack), its batches delivered to every rank of the replica; or, with
``--dataloader.mixture FILE``, several such datasets packed and mixed on a schedule
(:class:`~collective_loader.streaming.MixtureSource`). Its state resumes on another DP degree with
the same global batch (:class:`GlobalBatch`).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
import tyro
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.dataloader import BaseDataLoader

from collective_loader.integrations.titan import DATA_MESH, TitanDataLoader
from collective_loader.integrations.titan_batches import (
    PACKED_KEYS,
    check_columns,
    titan_collate,
    titan_inputs,
)
from collective_loader.integrations.titan_wrap import NeedsMesh
from collective_loader.plan.mesh import StageStyle
from collective_loader.streaming import MixtureSource, StreamingSource
from collective_loader.streaming.mixture import MixtureStream
from collective_loader.streaming.mixture_file import read_mixture
from collective_loader.streaming.streams import PackedStream, SampleStream
from collective_loader.text import Balance, MixtureSchedule, Packing, TextColumn, TokenColumn
from collective_loader.text.layouts import INTEGER_TYPES, ColumnLayout

__all__ = ["TitanStreamingDataLoader"]

log = logging.getLogger(__name__)


def _checked(
    source: StreamingSource | MixtureSource, layout: ColumnLayout
) -> SampleStream | PackedStream | MixtureStream:
    """``source()`` (a leader's stream), each dataset's columns checked against ``layout``
    (:func:`check_columns`; an error names a mixture's source)."""
    stream = source()
    for name, columns in stream.columns().items():
        if columns:
            try:
                check_columns(layout, columns)
            except ValueError as e:
                raise ValueError(f"mixture source {name!r}: {e}" if name else str(e)) from None
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

    With ``mixture`` (a ``.json`` or ``.toml`` file, :func:`~collective_loader.streaming.mixture_file.read_mixture`) it
    reads several datasets instead, each packed into rows of its own, and draws each row of a
    batch from the source its schedule names (:class:`~collective_loader.streaming.MixtureSource`,
    ``docs/mixtures.md``), with the layout, packing and batch the flags give one dataset, and no
    ``source_id`` key: TorchTitan 0.3's train step passes every input but ``input`` to the model's
    ``forward`` on every stage (a llama3 ``Decoder`` takes no ``source_id``) and takes the labels
    as one tensor, so it has no place for it.

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
    class Config(BaseDataLoader.Config, NeedsMesh):
        """``--dataloader.<field>``. ``dataset_path`` (from ``BaseDataLoader.Config``) is the local
        directory of an MDS dataset (with ``remote``: its cache); or give ``mixture``."""

        mixture: str | None = None
        """A mixture file (``.json`` or ``.toml``, docs/mixtures.md): a table of ``StreamingDataset``
        arguments per source and the schedule of their weights, read instead of ``dataset_path`` and
        ``remote``. Every source is packed: add ``pack`` (token ids) or ``text``. ``shuffle``,
        ``shuffle_seed`` and ``num_canonical_nodes`` are each source's unless its table sets them."""

        mixture_allow_edit: bool = False
        """Resume a checkpoint saved under another schedule in the mixture file (its future edited:
        other weights, a source added or dropped); without it such a resume is refused, naming
        what changed."""

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

        balance_replicas: int | None = None
        """Packing, with ``balance``: each block of that many consecutive replicas balances on its
        own, its gather and all-to-all among its own leaders (``Balance(replicas=k)``; k must divide
        dp): for dp in the hundreds, where one step's collectives over every leader take seconds."""

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

        _mesh: Annotated[DeviceMesh | None, tyro.conf.Suppress] = None
        """Set by ``TitanTrainer.init_distributed()`` (:func:`~.titan_wrap.with_mesh`); not a command-line field."""

        _stage_style: Annotated[StageStyle, tyro.conf.Suppress] = "loop"
        """The pipeline schedule's stage style (``"v"`` for ZBVZeroBubble and DualPipeV), set with ``_mesh``."""

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
                "dataloaders: build the trainer from collective_loader.integrations.titan_trainer.TitanTrainer.Config "
                "(load_once_per_replica(config) does), or give it the mesh: with_mesh(config, mesh)"
            )
        if not config.dataset_path and config.mixture is None:
            raise ValueError(
                "set --dataloader.dataset_path to the local directory of an MDS dataset, or --dataloader.mixture to "
                "a mixture file of several"
            )
        layout, packing = read_as(config, tokenizer, seq_len)
        self.mixture = config.mixture is not None
        if config.mixture is not None:
            assert packing is not None  # read_as refuses a mixture without packing
            sources, schedule = mixture_sources(config)
            mixture = MixtureSource(
                mesh,
                sources,
                schedule,
                batch_size=local_batch_size,
                packing=packing,
                layout=layout,
                documents_per_batch=config.documents_per_batch,
                num_workers=config.num_workers,
                stage_style=config._stage_style,
                timeout=config.timeout,
                source_key=None,  # TorchTitan's train step has no place for it
                allow_edit=config.mixture_allow_edit,
            )
            self.source: StreamingSource | MixtureSource = mixture
            inputs: tuple[str, ...] = tuple(PACKED_KEYS)
        else:
            self.source, inputs = _one_dataset(config, mesh, layout, packing, seq_len, local_batch_size)
        build = functools.partial(_checked, self.source, layout)
        super().__init__(build, mesh, inputs=inputs, timeout=config.timeout, stage_style=config._stage_style)
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
            source = state["source"]
            if source is not None:
                saved = self.source.saved_global_batches(source)
                if saved is None:
                    was, now = ("one dataset", "a mixture") if self.mixture else ("a mixture", "one dataset")
                    raise ValueError(
                        f"the dataloader state was saved reading {was} and this run reads {now} "
                        "(--dataloader.mixture): resume with the data it was saved with, or start the dataloader afresh "
                        "(--checkpoint.exclude_from_loading dataloader)"
                    )
                for each in saved:
                    self.global_batch.check(each, state["dp_size"])
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


def _one_dataset(
    config: TitanStreamingDataLoader.Config,
    mesh: DeviceMesh,
    layout: ColumnLayout,
    packing: Packing | None,
    seq_len: int,
    local_batch_size: int,
) -> tuple[StreamingSource, tuple[str, ...]]:
    """The source of the dataset at ``dataset_path``, and the keys it delivers as inputs."""
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
        stage_style=config._stage_style,  # the loader's: the same leaders (a V puts them all on pp rank 0)
        **rows,
    )
    inputs = tuple(PACKED_KEYS) if packing else tuple(PACKED_KEYS.values())
    return source, inputs


# one row at a time: TorchTitan's pipeline loads one micro-batch per loader step, and the rows
# must be placed as without the pipeline for pp = 2 to train pp = 1's rows


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
    if config.mixture is not None and not (config.text or config.pack):
        raise ValueError(
            "--dataloader.mixture packs every source's documents into rows (its weights count tokens): add "
            "--dataloader.pack (token ids of any length) or --dataloader.text (text tokenized on the leaders)"
        )
    if config.mixture is not None and config.balance:
        raise ValueError(
            "--dataloader.mixture does not balance rows over the replicas yet: leave out --dataloader.balance"
        )
    if config.balance_replicas is not None and not config.balance:
        raise ValueError("--dataloader.balance_replicas says how the replicas balance: add --dataloader.balance")
    if config.text or config.pack:
        balance = Balance(rows=1, replicas=config.balance_replicas) if config.balance else None
        return layout, Packing(seq_len, config.at_end, ("position_ids",), balance)
    if config.documents_per_batch is not None or config.at_end != "pad" or config.balance:
        raise ValueError(
            "--dataloader.documents_per_batch, --dataloader.at_end and --dataloader.balance say how documents are "
            "packed: add --dataloader.pack (token ids of any length) or --dataloader.text, or leave them out"
        )
    return layout, None


def mixture_sources(config: TitanStreamingDataLoader.Config) -> tuple[dict[str, dict[str, Any]], MixtureSchedule]:
    """The sources and the schedule of ``--dataloader.mixture`` (:func:`~collective_loader.streaming.mixture_file.read_mixture`;
    ``ValueError`` naming the file), each source's ``StreamingDataset`` arguments over the flags
    every source shares: ``shuffle``, ``shuffle_seed`` and ``num_canonical_nodes``, unless its
    table sets them. ``dataset_path`` and ``remote`` are not read (a warning says so when set).
    """
    assert config.mixture is not None
    sources, schedule = read_mixture(config.mixture)
    ignored = [
        f"--dataloader.{name} {value}"
        for name, value in (("dataset_path", config.dataset_path), ("remote", config.remote))
        if value
    ]
    if ignored:
        log.warning(
            "--dataloader.mixture %s names each source's dataset: %s not read", config.mixture, " and ".join(ignored)
        )
    shared = {
        "shuffle": config.shuffle,
        "shuffle_seed": config.shuffle_seed,
        "num_canonical_nodes": config.num_canonical_nodes,
    }
    return {name: {**shared, **table} for name, table in sources.items()}, schedule
