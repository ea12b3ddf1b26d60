"""Check, from what every rank received, that delivery kept its promises.

Used by the demo's verdict and by the tests. Every rank contributes a :class:`RankRecord`; the
checks recompute each expected tensor from the sample ids that were delivered, with a function
the caller supplies (``expected(ids) -> full batch``), so a wrong sample, shard or label, a
duplicated or lost sample all fail:

a. *copies*: every rank holds exactly its keys, replicated keys equal the full tensor, and
   ranks that differ only along replicate dims hold bit-identical pieces;
b. *shards*: each rank's piece is its slice, and the pieces of a step reassemble the full tensor
   (under a per-document split: each rank's whole batch, metadata included, is its piece);
c. *labels match inputs*: the last stage's samples at step k are the first stage's at step k;
d. *coverage*: replicas get disjoint samples that together are exactly the expected set;
e. *middle stages* get only the ``every_stage`` keys (often nothing), and every rank sees the
   same number of steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from collective_loader.plan.mesh import Stage
from collective_loader.plan.routing import Routing
from collective_loader.plan.split import Split


@runtime_checkable
class Reassembling(Split, Protocol):
    """A :class:`~collective_loader.plan.split.Split` these checks can reassemble: the two members
    only they read (the package's splits have both; the loader needs neither)."""

    reshapes: ClassVar[bool]
    """Whether ``piece`` changes a batch even when nothing is cut (one shard rank): a
    per-document split flattens the rows and adds its metadata there too."""

    def unshard(
        self, pieces: Sequence[torch.Tensor], sizes: Sequence[int], dim: int, batch: Mapping[str, Any]
    ) -> torch.Tensor:
        """One key's tensor from every rank's piece of it, as one shard rank would keep it.

        ``pieces`` is ordered row-major over the shard dims' indices (outermost slowest), ``dim``
        is the key's sequence dim, ``batch`` the batch they were cut from (for its boundaries).
        """


@dataclass
class RankRecord:
    """What one rank received over one epoch, with its place in the mesh."""

    rank: int
    dp_rank: int
    stage: Stage
    shard: tuple[tuple[int, int], ...]
    steps: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str = ""


def check(
    records: Iterable[RankRecord],
    routing: Routing,
    expected: Callable[[list[int]], Mapping[str, Any]],
    all_ids: Iterable[int],
    id_key: str = "sample_id",
) -> list[Verdict]:
    """Run checks (a)-(e); ``id_key`` must be delivered to first and last stages.

    ``all_ids`` is the set of sample ids the replicas together must cover exactly once. The
    routing's split must be :class:`Reassembling` (``TypeError`` otherwise).
    """
    if not isinstance(routing.split, Reassembling):
        raise TypeError(
            f"the checks reassemble each step's pieces: {type(routing.split).__qualname__} needs reshapes and "
            "unshard (testing.invariants.Reassembling) besides the Split protocol"
        )
    records = list(records)
    problems: dict[str, list[str]] = defaultdict(list)
    counts = {len(r.steps) for r in records}
    if len(counts) != 1:
        problems["e"].append(f"ranks saw different numbers of steps: {sorted(counts)}")
    replicas: dict[int, list[RankRecord]] = defaultdict(list)
    for rec in records:
        replicas[rec.dp_rank].append(rec)
    seen: dict[int, list[int]] = {}
    for dp_rank, recs in sorted(replicas.items()):
        seen[dp_rank] = []
        for step in range(min(counts)):
            ids = _check_step(recs, step, routing, expected, id_key, problems)
            seen[dp_rank].extend(ids)
    flat = [i for ids in seen.values() for i in ids]
    want = sorted(all_ids)
    if len(flat) != len(set(flat)):
        problems["d"].append(f"{len(flat) - len(set(flat))} samples were delivered twice")
    if sorted(set(flat)) != want:
        lost, extra = sorted(set(want) - set(flat)), sorted(set(flat) - set(want))
        problems["d"].append(f"lost {len(lost)} samples {lost[:5]}, unexpected {len(extra)} {extra[:5]}")
    names = {
        "a": "replicated keys identical across each replica's ranks",
        "b": "shard pieces are their slices and reassemble the full tensor",
        "c": "last-stage labels belong to the first stage's samples, same step",
        "d": "replicas disjoint, together covering every sample exactly once",
        "e": "middle stages get only every_stage keys; every rank sees the same steps",
    }
    return [Verdict(f"({k}) {v}", not problems[k], "; ".join(problems[k][:3])) for k, v in names.items()]


def _check_step(
    recs: list[RankRecord],
    step: int,
    routing: Routing,
    expected: Callable[[list[int]], Mapping[str, Any]],
    id_key: str,
    problems: dict[str, list[str]],
) -> list[int]:
    where = f"replica {recs[0].dp_rank} step {step}"
    ids_by_stage: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for rec in recs:
        batch = rec.steps[step]
        if rec.stage == Stage.MIDDLE and not routing.every_stage:
            if batch:
                problems["e"].append(f"{where}: middle-stage rank {rec.rank} got keys {sorted(batch)}")
            continue
        if id_key in batch:
            ids_by_stage[rec.stage].add(tuple(torch.as_tensor(batch[id_key]).tolist()))
    all_sets = set().union(*ids_by_stage.values()) if ids_by_stage else set()
    if len(all_sets) != 1:
        problems["c"].append(f"{where}: ranks hold different samples {sorted(all_sets)[:3]}")
        return []
    ids = list(all_sets.pop())
    full = expected(ids)
    split = routing.split
    assert isinstance(split, Reassembling)  # check() refused any other
    pieces: dict[str, dict[tuple[int, ...], torch.Tensor]] = defaultdict(dict)
    for rec in recs:
        if rec.stage == Stage.MIDDLE and not routing.every_stage:
            continue
        batch = rec.steps[step]
        want_batch = routing.piece(routing.select(full, rec.stage), rec.shard)
        if set(batch) != set(want_batch):
            problems["e" if rec.stage == Stage.MIDDLE else "a"].append(
                f"{where}: rank {rec.rank} ({rec.stage}) got keys {sorted(batch)}, want {sorted(want_batch)}"
            )
            continue
        for key, value in batch.items():
            # a wrong label-only key means labels and inputs came apart: that is (c)
            label_only = key in routing.labels and key not in routing.inputs
            # a split that reshapes makes every rank's batch its piece, also at one shard rank
            if key in routing.seq_dims and (rec.shard or split.reshapes):
                if not _equal(value, want_batch[key]):
                    problems["c" if label_only else "b"].append(
                        f"{where}: rank {rec.rank} holds a wrong piece of {key!r}"
                    )
                index = tuple(i for _, i in rec.shard)
                if index in pieces[key] and not _equal(pieces[key][index], value):
                    problems["a"].append(f"{where}: replicate peers differ on {key!r}")
                pieces[key][index] = value
            elif not _equal(value, want_batch[key]):
                problems["c" if label_only else "a"].append(f"{where}: rank {rec.rank} holds a wrong {key!r}")
    sizes = [size for size, _ in recs[0].shard]
    for key, by_index in pieces.items():
        if len(by_index) != math.prod(sizes):
            problems["b"].append(f"{where}: {key!r} has {len(by_index)} of {math.prod(sizes)} pieces")
            continue
        ordered = [by_index[i] for i in sorted(by_index)]
        rebuilt = split.unshard(ordered, sizes, routing.seq_dims[key], full).reshape(full[key].shape)
        if not _equal(rebuilt, full[key]):
            label_only = key in routing.labels and key not in routing.inputs
            problems["c" if label_only else "b"].append(f"{where}: {key!r} pieces do not reassemble")
    return ids


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b
