"""What ``bench/mixture.py``'s worlds run, and what its parent shares with them: the three MDS
datasets (:func:`write_data`), each case's schedule (:func:`schedule_of`), the loader over a mixture
or a single source (:func:`loader_of`), and the ranks' two mains: the tokens per source of every
step of each case (:func:`shares_main`) and a leader's CPU per step of each variant
(:func:`cpu_main`), each rank's records kept with ``harness.keep``.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
from harness import keep, rotated  # bench/harness.py: run as python bench/<name>.py

NAMES = ("long", "medium", "short")  # MixtureSource.names: sorted; a token's source is its index here
LENGTHS = {"short": (20, 60), "medium": (200, 600), "long": (2000, 6000)}  # tokens, inclusive, uniform
DATASET_TOKENS, SOURCE_SHIFT = 600_000, 24
A = {"short": 0.5, "medium": 0.3, "long": 0.2}
B = {"short": 0.2, "medium": 0.3, "long": 0.5}
SEQ_LEN, ROWS, DOCS_PER_BATCH = 128, 4, 8
CPU_SEQ_LEN, CPU_ROWS, CPU_SKIP = 256, 4, 30
CASES = {
    "a": "(a) A constant",
    "b": "(b) A, B from the middle (step change)",
    "c": "(c) A ramped to B over the middle half",
    "streaming": "(a) streaming `Stream(proportion=)` at A",
}
VARIANTS = ("short", "medium", "long", "mixture", "mixture of short")


@dataclass(frozen=True)
class Settings:
    dps: tuple[int, ...]  # one world per dp
    steps: int  # per run of part 1
    cpu_steps: int  # timed steps per variant and round of part 3
    cpu_rounds: int


FULL = Settings(dps=(1, 2, 4), steps=160, cpu_steps=400, cpu_rounds=5)
QUICK = Settings(dps=(1, 2), steps=40, cpu_steps=100, cpu_rounds=2)


def write_data(root: str) -> tuple[dict[str, str], dict[str, float]]:
    """The three datasets under ``root``: their paths and their mean document lengths."""
    from collective_loader.testing.data import write_token_documents

    paths, means = {}, {}
    for s, name in enumerate(NAMES):
        low, high = LENGTHS[name]
        lengths = np.random.default_rng(s).integers(low, high + 1, size=DATASET_TOKENS * 2 // (low + high))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        docs = [((s + 1) << SOURCE_SHIFT) + start + np.arange(n, dtype=np.int64) for start, n in zip(starts, lengths)]
        paths[name] = os.path.join(root, name)
        write_token_documents(paths[name], docs, "bytes", "uint32", shard_bytes=1 << 20)
        means[name] = float(lengths.mean())
    return paths, means


def schedule_of(case: str, steps: int, dp: int) -> Any:
    """Case ``case``'s schedule for a run of ``steps`` steps at ``dp`` (streaming's mix: ``A``)."""
    from collective_loader.text import MixtureSchedule

    Phase = MixtureSchedule.Phase

    per_step = dp * ROWS * SEQ_LEN  # the progress of one step: real tokens over every replica
    if case in ("a", "streaming"):
        return MixtureSchedule.constant(A)
    if case == "b":
        return MixtureSchedule((Phase(0, A), Phase(steps // 2 * per_step, B)))
    return MixtureSchedule((Phase(0, A), Phase(steps // 4 * per_step, B, ramp=steps // 2 * per_step)))


# --- on the ranks ---------------------------------------------------------------------------------


def loader_of(mesh: Any, rows: int, seq_len: int, schedule: Any = None, **data: Any) -> Any:
    """The ``CollectiveLoader`` over a ``MixtureSource`` of ``data`` (paths by name) on ``schedule``,
    or, without one, over a single packing ``StreamingSource`` of ``data`` (``local=`` or ``streams=``)."""
    from collective_loader import CollectiveLoader
    from collective_loader.streaming import MixtureSource, StreamingSource
    from collective_loader.text import Packing, TokenColumn

    common: dict[str, Any] = dict(batch_size=rows, packing=Packing(seq_len), layout=TokenColumn(dtype="uint32"))
    common |= dict(documents_per_batch=DOCS_PER_BATCH, num_workers=0, shuffle=True, shuffle_seed=3)
    if schedule is None:
        return CollectiveLoader(
            StreamingSource(mesh, **common, **data), mesh, inputs=("input_ids", "position_ids"), labels=("labels",)
        )
    source = MixtureSource(mesh, {name: {"local": path} for name, path in data.items()}, schedule, **common)
    return CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels", "source_id"))


def counts_of(batch: Any) -> tuple[list[int], int, int]:
    """Real tokens per source (index into NAMES), read from each label token; the rows whose
    ``source_id`` does not name their tokens' one source; the rows not full."""
    labels, ids = batch["labels"].numpy(), batch["source_id"].numpy() if "source_id" in batch else None
    per_source, mismatched, not_full = [0] * len(NAMES), 0, 0
    for r, row in enumerate(labels):
        sources = (row[row != -100] >> SOURCE_SHIFT) - 1
        not_full += len(sources) != SEQ_LEN
        for s, n in zip(*np.unique(sources, return_counts=True)):
            per_source[int(s)] += int(n)
        mismatched += ids is not None and set(sources.tolist()) != {int(ids[r])}
    return per_source, mismatched, not_full


def shares_main(args: tuple[dict[str, str], Settings, str]) -> int:
    """Every rank of a world of dp leaders: each schedule's run, then streaming's mix."""
    import torch.distributed as dist
    from streaming import Stream
    from torch.distributed.device_mesh import init_device_mesh

    data, settings, out = args
    dp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    for case in CASES:
        if case == "streaming":
            loader = loader_of(mesh, ROWS, SEQ_LEN, streams=[Stream(local=data[n], proportion=A[n]) for n in NAMES])
        else:
            loader = loader_of(mesh, ROWS, SEQ_LEN, schedule_of(case, settings.steps, dp), **data)
        per_step, mismatched, not_full = [], 0, 0
        for _, batch in zip(range(settings.steps), loader):
            counts, bad, partial = counts_of(batch)
            per_step.append(counts)
            mismatched, not_full = mismatched + bad, not_full + partial
        loader.close()
        record = dict(
            case=case, dp=dp, rank=dist.get_rank(), per_step=per_step, mismatched=mismatched, not_full=not_full
        )
        keep(out, {"kind": "shares", **record})
    return 0


def cpu_main(args: tuple[dict[str, str], Settings, str]) -> int:
    """The one rank of a world of its own: leader CPU per step of each variant, once per round."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader.text import MixtureSchedule

    data, settings, out = args
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    thread = f"collective_loader-r{dist.get_rank()}"  # the loader's thread that runs the source
    for r in range(settings.cpu_rounds):
        for variant in rotated(VARIANTS, r):
            data_of = {"mixture": data, "mixture of short": {"short": data["short"]}}.get(variant)
            weights = A if variant == "mixture" else {"short": 1.0}
            if data_of is None:
                loader = loader_of(mesh, CPU_ROWS, CPU_SEQ_LEN, local=data[variant])
            else:
                loader = loader_of(mesh, CPU_ROWS, CPU_SEQ_LEN, MixtureSchedule.constant(weights), **data_of)
            clocks, pieces, transfer = [], [], None
            for batch in islice(loader, CPU_SKIP + settings.cpu_steps + 1):
                process = time.process_time()
                transfer = transfer or time.pthread_getcpuclockid(
                    next(t.ident for t in threading.enumerate() if t.name == thread)
                )
                clocks.append((process, time.clock_gettime(transfer)))
                pieces.append(int((batch["position_ids"] == 0).sum()))  # the loop's only work, in every variant
                del batch  # the loader may reuse its buffer
            loader.close()
            per_step, on_thread = np.diff(np.array(clocks[CPU_SKIP:]), axis=0).T.tolist()
            record = dict(variant=variant, round=r, per_step=per_step, transfer_per_step=on_thread)
            keep(out, {"kind": "cpu", **record, "pieces": pieces[CPU_SKIP + 1 :]})
    return 0
