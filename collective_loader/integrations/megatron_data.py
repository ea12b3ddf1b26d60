"""Megatron's own data, read on the leaders only: ``.bin``/``.idx`` indexed datasets as GPTDataset samples.

Megatron-LM builds its ``GPTDataset`` on every rank (rank 0 first, the others after a barrier of
the whole world), and its ``MegatronPretrainingSampler`` hands each data-parallel rank its slice
of every global micro-batch. Here one leader per replica builds the dataset
(:func:`gpt_dataset`: megatron-core's ``GPTDataset`` over a whole ``.bin``/``.idx`` prefix, no
collective) and :class:`MegatronSamples` yields that replica's micro-batches in the sampler's
order, as they are (``tokens``, ``labels``, ``loss_mask``, ``position_ids``, and
``attention_mask`` when the config creates one; :func:`gpt_blend` blends prefixes as Megatron's
``BlendedDataset`` does), for
:func:`~collective_loader.integrations.megatron.megatron_loader` to deliver::

    place = mesh_place(mesh, dist.get_rank())
    source = lambda: MegatronSamples(gpt_dataset(prefix, config), micro_batch_size, place.dp_rank, place.dp_size)
    loader = megatron_loader(source, mesh)  # every rank; only the leaders call source()

megatron-core is imported when a dataset is built, on the leaders: it is not a dependency of
this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = ["MegatronSamples", "gpt_blend", "gpt_dataset"]

# what megatron_loader routes (and Megatron's get_batch reads) of a GPTDataset sample
KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


class SampleDataset(Protocol):
    """What :class:`MegatronSamples` reads: Megatron's ``GPTDataset`` (or ``BlendedDataset``), or
    any map of sample index to a mapping of str to tensors."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...


def gpt_dataset(path_prefix: str, config: Any, num_samples: int | None = None) -> Any:
    """megatron-core's ``GPTDataset`` over every document of ``path_prefix`` (``.bin``/``.idx``),
    built on this rank alone: what ``BlendedMegatronDatasetBuilder`` builds for the train split
    of ``blend=([path_prefix], None)``, ``split="100,0,0"``, without its barriers of the whole
    world (only the leaders call this).

    ``config`` is a ``GPTDatasetConfig``; ``num_samples`` (None: one epoch) as Megatron-LM's
    ``train_iters * global_batch_size``. A config without ``path_to_cache`` builds the shuffle
    indices in memory on each leader (Megatron's builder would write them beside the data from
    rank 0 and have the other ranks wait for them). Give ``path_to_cache`` only where an earlier
    Megatron run wrote them: megatron-core builds them there on global rank 0 alone, and another
    leader would fail to read them.

    Example (on a leader)::

        config = GPTDatasetConfig(random_seed=1234, sequence_length=2048, tokenizer=tokenizer,
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        dataset = gpt_dataset("/data/my-corpus_text_document", config)
    """
    import numpy as np
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.utils import Split

    config = _in_memory(config)
    documents = GPTDataset.build_low_level_dataset(path_prefix, config)
    indices = np.arange(GPTDataset.numel_low_level_dataset(documents), dtype=np.int32)
    return GPTDataset(documents, path_prefix, indices, num_samples, Split.train, config)


def gpt_blend(path_prefixes: Sequence[str], weights: Sequence[float], config: Any, num_samples: int) -> Any:
    """megatron-core's ``BlendedDataset`` of ``num_samples`` samples drawn from the GPTDatasets of
    ``path_prefixes`` by ``weights``, built on this rank alone: what ``BlendedMegatronDatasetBuilder``
    builds for the train split of ``blend=(path_prefixes, weights)``, ``split="100,0,0"`` (each
    prefix's GPTDataset sized by the builder's own arithmetic, with its ``mid_level_dataset_surplus``).

    Example (on a leader)::

        dataset = gpt_blend(["/data/web_text_document", "/data/code_text_document"], [0.7, 0.3], config, 10_000)
    """
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import _get_size_per_split_per_dataset
    from megatron.core.datasets.utils import normalize

    config = _in_memory(config)
    weights = normalize(list(weights))
    sizes = [num_samples, 0, 0]  # train, validation, test: the train split only
    used = [size[0] for size in _get_size_per_split_per_dataset(weights, sizes)]
    built = [size[0] for size in _get_size_per_split_per_dataset(weights, sizes, config.mid_level_dataset_surplus)]
    datasets = [gpt_dataset(prefix, config, n) for prefix, n in zip(path_prefixes, built)]
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
