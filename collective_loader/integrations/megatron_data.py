"""Megatron's own data, read on the leaders only: ``.bin``/``.idx`` indexed datasets as GPTDataset samples.

Megatron-LM builds its datasets on every rank (``BlendedMegatronDatasetBuilder``: rank 0 first,
the others after a barrier of the whole world), and its ``MegatronPretrainingSampler`` hands each
data-parallel rank its slice of every global micro-batch. Here one leader per replica builds the
split the builder would give (:func:`gpt_dataset`: the train split of the config's blend and
``split`` by default, no collective) and :class:`MegatronSamples` yields that replica's
micro-batches in the sampler's order, as they are (``tokens``, ``labels``, ``loss_mask``,
``position_ids``, and ``attention_mask`` when the config creates one), for
:func:`~collective_loader.integrations.megatron.megatron_loader` to deliver::

    place = mesh_place(mesh, dist.get_rank())
    source = lambda: MegatronSamples(gpt_dataset(config, num_samples), micro_batch_size, place.dp_rank, place.dp_size)
    loader = megatron_loader(source, mesh)  # every rank; only the leaders call source()

megatron-core is imported when a dataset is built, on the leaders: it is not a dependency of
this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = ["MegatronSamples", "gpt_dataset"]

# what megatron_loader routes (and Megatron's get_batch reads) of a GPTDataset sample
KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


class SampleDataset(Protocol):
    """What :class:`MegatronSamples` reads: Megatron's ``GPTDataset`` (or ``BlendedDataset``), or
    any map of sample index to a mapping of str to tensors."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...


SPLITS = ("train", "valid", "test")  # megatron-core's Split, in its order


def gpt_dataset(config: Any, num_samples: int | None = None, split: str = "train") -> Any:
    """The dataset ``BlendedMegatronDatasetBuilder(GPTDataset, sizes, is_built_on_rank,
    config).build()`` gives ``split`` (``"train"``, ``"valid"`` or ``"test"``), built on this rank
    alone, without the builder's barriers of the whole world (only the leaders call this).

    ``config`` is the ``GPTDatasetConfig`` the training script builds, read as the builder reads
    it: ``blend=(prefixes, weights)`` cut into train, validation and test documents by ``split``
    (``"969,30,1"``: the first 96.9% of each prefix's documents train), or ``blend_per_split``.
    One prefix without weights gives megatron-core's ``GPTDataset`` of the split's documents;
    several, or weights, its ``BlendedDataset`` over one ``GPTDataset`` per prefix, sized by the
    builder's own arithmetic (``mid_level_dataset_surplus`` included). ``num_samples`` is the
    builder's size of ``split``: Megatron-LM's ``train_iters * global_batch_size`` for train; None
    (one epoch) is refused with weights, as the builder refuses it. A split the config gives no
    documents is refused, naming it.

    A config without ``path_to_cache`` builds the shuffle indices in memory on each leader
    (Megatron's builder would write them beside the data from rank 0 and have the other ranks
    wait for them). Give ``path_to_cache`` only where an earlier Megatron run wrote them:
    megatron-core builds them there on global rank 0 alone, and another leader would fail to read them.

    Example (on a leader)::

        config = GPTDatasetConfig(random_seed=1234, sequence_length=2048, tokenizer=tokenizer,
                                  blend=(["/data/web_text_document", "/data/code_text_document"], [0.7, 0.3]),
                                  split="969,30,1", reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False)
        train = gpt_dataset(config, train_iters * global_batch_size)
        valid = gpt_dataset(config, valid_samples, "valid")  # the size Megatron-LM gives the builder for it
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: give one of {', '.join(map(repr, SPLITS))}")
    prefixes, weights, documents, single = _split_blend(config, split)
    config = _in_memory(config)
    if single:
        return _gpt_split(prefixes[0], documents, num_samples, split, config)
    return _blend(prefixes, weights, documents, num_samples, split, config)


def _split_blend(config: Any, split: str) -> tuple[list[str], list[float] | None, tuple[float, float], bool]:
    """What the builder reads of ``config`` for ``split``: its prefixes, their weights (None: by
    their lengths), the fraction of each prefix's documents it takes (``split_matrix``'s row, or
    all of them under ``blend_per_split``), and whether it builds one GPTDataset, not a blend."""
    index = SPLITS.index(split)
    if config.blend is not None:
        prefixes, weights = config.blend
        documents = config.split_matrix[index]
        if documents is None:
            raise ValueError(
                f"config.split {config.split!r} gives the {split} split no documents: ask for another split, "
                "or give config a split with a share for it (Megatron-LM's default is '969,30,1')"
            )
        return list(prefixes), weights, documents, len(prefixes) == 1 and weights is None
    if config.blend_per_split is not None and any(config.blend_per_split):
        if config.blend_per_split[index] is None:
            raise ValueError(f"config.blend_per_split has no blend for the {split} split: give it one")
        if split == "valid" and config.multiple_validation_sets and len(config.blend_per_split[index][0]) > 1:
            raise ValueError(
                "config.multiple_validation_sets: build each validation prefix as its own split "
                "(a config whose blend_per_split holds that prefix alone for valid)"
            )
        prefixes, weights = config.blend_per_split[index]
        return list(prefixes), weights, (0.0, 1.0), len(prefixes) == 1
    raise ValueError(
        "config has neither blend nor blend_per_split (megatron-core would make mock data): give "
        "GPTDatasetConfig(blend=([path_prefix], None), split='969,30,1', ...), as Megatron-LM's --data-path and --split do"
    )


def _gpt_split(prefix: str, documents: tuple[float, float], num_samples: int | None, split: str, config: Any) -> Any:
    """megatron-core's ``GPTDataset`` of ``prefix``'s documents in the fraction ``documents`` of
    them, as the builder's ``_build_megatron_dataset_splits`` cuts them (each end rounded)."""
    import numpy as np
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.utils import Split

    indexed = GPTDataset.build_low_level_dataset(prefix, config)
    count = GPTDataset.numel_low_level_dataset(indexed)
    begin, end = (int(round(fraction * float(count))) for fraction in documents)
    if begin >= end:
        cut = f"config.split {config.split!r}" if config.blend is not None else "config.blend_per_split"
        raise ValueError(
            f"{cut} gives the {split} split documents [{begin}, {end}) of the {count} of {prefix}: none; "
            "ask for another split, or give it a larger share"
        )
    indices = np.arange(begin, end, dtype=np.int32)
    return GPTDataset(indexed, prefix, indices, num_samples, Split[split], config)


def _blend(
    prefixes: Sequence[str],
    weights: Sequence[float] | None,
    documents: tuple[float, float],
    num_samples: int | None,
    split: str,
    config: Any,
) -> Any:
    """megatron-core's ``BlendedDataset`` of ``split`` over one ``GPTDataset`` per prefix, as the
    builder sizes them: by ``weights`` (each prefix's share of ``num_samples``, built with the
    config's ``mid_level_dataset_surplus``), or without weights one epoch of each prefix, blended
    by their lengths (``num_samples`` of them, at most all)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.utils import normalize

    if weights is None:
        datasets = [_gpt_split(prefix, documents, None, split, config) for prefix in prefixes]
        lengths = [len(dataset) for dataset in datasets]
        size = None if num_samples is None else min(num_samples, sum(lengths))
        return BlendedDataset(datasets, lengths, size, config)
    if num_samples is None:
        raise ValueError(
            f"a blend by weights {list(weights)} needs num_samples (the builder's size of the {split} split)"
        )
    weights = normalize(list(weights))
    used = [sizes[0] for sizes in _get_size_per_split_per_dataset(weights, [num_samples])]
    built = _get_size_per_split_per_dataset(weights, [num_samples], config.mid_level_dataset_surplus)
    datasets = [_gpt_split(prefix, documents, n, split, config) for prefix, (n,) in zip(prefixes, built)]
    return BlendedDataset(datasets, weights, sum(used), config)


def _in_memory(config: Any) -> Any:
    """``config`` with ``path_to_cache=""`` if it has none: megatron-core then builds its indices in
    memory and writes nothing (with None it would write them beside the data, from rank 0 only)."""
    return dataclasses.replace(config, path_to_cache="") if config.path_to_cache is None else config


class MegatronSamples:
    """A replica's micro-batches of ``dataset``, in Megatron-LM's ``MegatronPretrainingSampler``
    order, as a :class:`~collective_loader.Source` (on its leader).

    Global micro-batch ``m`` (counted from ``consumed_samples``) is samples
    ``[consumed + m * micro * dp, consumed + (m + 1) * micro * dp)``; replica ``d`` takes the
    ``micro`` samples from ``consumed + m * micro * dp + d * micro``, stacked per key. The epoch
    ends before the first global micro-batch the dataset cannot fill (the sampler's drop_last).

    Resume: the state is ``{"consumed_samples": n}``, the samples every replica consumed
    together, the same on every leader: Megatron-LM's own checkpoint figure. So it is exact, and
    elastic: on another number of replicas the next micro-batches start at the same sample
    (Megatron-LM resumes a changed data-parallel size the same way); keep the micro-batch size.

    >>> data = [{"tokens": torch.tensor([i])} for i in range(10)]
    >>> [b["tokens"].flatten().tolist() for b in MegatronSamples(data, micro_batch_size=2, dp_rank=1, dp_size=2)]
    [[2, 3], [6, 7]]
    """

    elastic = True

    def __init__(self, dataset: SampleDataset, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        if micro_batch_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"micro_batch_size {micro_batch_size}, dp_rank {dp_rank} of {dp_size}: not a replica")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = 0  # where the next epoch starts: 0, or a resumed state
        self._state: dict[str, int] | None = None  # after the last micro-batch yielded

    @property
    def _global_micro(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self.consumed_samples = self.consumed_samples, 0
        self._state = None
        for first in range(start, len(self.dataset) - self._global_micro + 1, self._global_micro):
            mine = first + self.dp_rank * self.micro_batch_size
            batch = _stack([self.dataset[i] for i in range(mine, mine + self.micro_batch_size)])
            self._state = {"consumed_samples": first + self._global_micro}
            yield batch

    def state_dict(self) -> dict[str, int] | None:
        return self._state

    def resume(self, state: dict[str, int] | None, steps: int) -> None:
        # no state: a checkpoint of the first step's start, or a source that had yielded nothing
        self.consumed_samples = state["consumed_samples"] if state is not None else steps * self._global_micro

    def checkpoint_state(self, snapshot: dict[str, int] | None) -> dict[str, int] | None:
        return snapshot

    def stop(self) -> None:
        self._state = None

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.dataset = []  # the dataset's memory maps go with it


def _stack(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One micro-batch: each key Megatron's ``get_batch`` reads, its samples stacked along a new
    first dim, as a DataLoader collates them (a blend's ``dataset_id``, which it does not read, is left out)."""
    return {key: torch.stack([s[key] for s in samples]) for key in KEYS if key in samples[0]}
