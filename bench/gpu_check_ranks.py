"""The ranks' side of ``bench/gpu_check.py``: the sizes, the cases, the batch every rank expects
from its mesh coordinates alone and the comparison (:func:`expected`, :func:`compare`), and one
rank's checked and timed epochs (:func:`rank_main`); the checks themselves: ``gpu_check.py``'s
docstring."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from harness import keep, timed_steps  # bench/harness.py: run as python bench/<name>.py
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.testing import launch

INPUTS = ("input_ids", "sample_id")  # to the first pipeline stage
LABELS = ("labels", "sample_id")  # to the last
SEQ_DIMS = {"input_ids": 1, "labels": 1}
WARMUP = 2  # steps left out of the timing figures (thread start, first allocations)
HIDDEN = 0.5  # exposed_wait passes when the median wait with compute is at most this share of the synchronous one
LOADER_TIMEOUT = 60.0  # seconds a rank waits in one collective: a hang becomes an error well within a world's timeout
WORLD_TIMEOUT = 180.0  # seconds the 4-rank world may run (both its meshes)
ALONE_TIMEOUT = 90.0  # seconds the 1-rank world may run; with the above, within the script's 300 s


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sizes for one device: a few MiB per step on a GPU, small enough on CPUs for a 2-core test."""

    device: str
    batch: int  # samples per step
    seq_len: int  # int64 tokens per sample
    steps: int  # per epoch
    matmul: int  # n of the n x n float32 matmuls of the compute loop
    compute_s: float  # compute time per step the matmul count is calibrated to


CUDA = Settings("cuda", batch=8, seq_len=32768, steps=40, matmul=4096, compute_s=0.010)
CPU = Settings("cpu", batch=4, seq_len=4096, steps=10, matmul=160, compute_s=0.010)


@dataclasses.dataclass(frozen=True)
class Case:
    """One mesh and transport, run by every rank of a world; ``timed`` adds the two timed epochs."""

    name: str
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    transport: str = "host"
    timed: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Job:
    """The cases one world runs in order: one world start for several meshes, as starting ranks is
    most of the time on a small machine. Every rank writes a record per case into ``records``."""

    cases: tuple[Case, ...]
    settings: Settings
    records: str


@dataclasses.dataclass(frozen=True)
class Where:
    """What a rank should get, from its mesh coordinates alone (not from the package's layout code)."""

    dp_rank: int
    dp_size: int
    first: bool
    last: bool
    cp_size: int
    cp_index: int


# --- data: a deterministic function of the step ---------------------------------------------


def sample_batch(step: int, dp_rank: int, dp_size: int, s: Settings) -> dict[str, torch.Tensor]:
    """Replica ``dp_rank``'s batch of ``step``: ids unique over steps and replicas, and tokens
    unique over ids and positions, so a rank holding another step's or replica's data (or a
    shifted slice) is caught."""
    first = (step * dp_size + dp_rank) * s.batch
    ids = torch.arange(first, first + s.batch, dtype=torch.int64)
    tokens = ids[:, None] * s.seq_len + torch.arange(s.seq_len, dtype=torch.int64)
    return {"input_ids": tokens, "labels": tokens + 1, "sample_id": ids}


class Source:
    """The leader's source: one epoch of ``steps`` batches per ``iter()``, like a DataLoader."""

    def __init__(self, where: Where, s: Settings) -> None:
        self.where, self.s = where, s

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for step in range(self.s.steps):
            yield sample_batch(step, self.where.dp_rank, self.where.dp_size, self.s)


def where_of(mesh: DeviceMesh) -> Where:
    """This rank's place from the DeviceMesh's own coordinates, so the expectation does not reuse
    the package's layout code it checks."""
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    size = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))
    pp = size.get("pp", 1)
    return Where(
        dp_rank=coord.get("dp", 0),
        dp_size=size.get("dp", 1),
        first=coord.get("pp", 0) == 0,
        last=coord.get("pp", 0) == pp - 1,
        cp_size=size.get("cp", 1),
        cp_index=coord.get("cp", 0),
    )


def zigzag(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    """Rank ``i`` of ``n``'s piece: chunks ``i`` and ``2n-1-i`` of ``2n`` (the loader's default layout)."""
    if n == 1:
        return t
    chunks = t.chunk(2 * n, dim=dim)
    return torch.cat([chunks[i], chunks[2 * n - 1 - i]], dim=dim)


def expected(step: int, where: Where, s: Settings) -> dict[str, torch.Tensor]:
    """The host batch a rank at ``where`` must get at ``step``."""
    full = sample_batch(step, where.dp_rank, where.dp_size, s)
    keys = (INPUTS if where.first else ()) + (LABELS if where.last else ())
    return {k: zigzag(full[k], SEQ_DIMS[k], where.cp_size, where.cp_index) if k in SEQ_DIMS else full[k] for k in keys}


def compare(got: Mapping[str, Any], want: Mapping[str, torch.Tensor], device: torch.device) -> list[str]:
    """What differs between a delivered batch and the expected one: keys, device, dtype, shape,
    values. Values are compared with ``torch.equal`` on the host; the data is integer, so equal
    means bit-identical. Syncs with a GPU: call it outside the sync-debug window."""
    problems = []
    if set(got) != set(want):
        problems.append(f"keys {sorted(got)}, want {sorted(want)}")
    for key in sorted(set(got) & set(want)):
        g, w = got[key], want[key]
        if not isinstance(g, torch.Tensor):
            problems.append(f"{key}: a {type(g).__name__}, want a tensor")
            continue
        if g.device != device:
            problems.append(f"{key}: on {g.device}, want {device}")
        g = g.cpu()
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(f"{key}: {g.dtype}{tuple(g.shape)}, want {w.dtype}{tuple(w.shape)}")
        elif not torch.equal(g, w):
            at = tuple((g != w).nonzero()[0].tolist())
            problems.append(f"{key}: differs first at {at}: {g[at].item()}, want {w[at].item()}")
    return problems


def expected_sum(where: Where, s: Settings) -> int:
    return sum(int(t.sum()) for step in range(s.steps) for t in expected(step, where, s).values())


# --- device ---------------------------------------------------------------------------------


def target_device(s: Settings) -> torch.device:
    """The device batches must land on: GPU 0 (every rank shares it), or the CPU."""
    return torch.device("cuda", 0) if s.device == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, any host sync inside the block raises (``set_sync_debug_mode`` is process-wide,
    so the transfer thread is watched too). A no-op on CPU: there is no stream to sync with."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def batch_sum(batch: Mapping[str, torch.Tensor], acc: torch.Tensor) -> None:
    """Add the batch's sum to ``acc`` with kernels on the current stream: uses the batch right
    away, without a sync, so a batch handed over before its data arrived sums wrong."""
    for t in batch.values():
        acc += t.sum()


def make_compute(device: torch.device, n: int, target_s: float) -> tuple[Callable[[], None], int]:
    """A loop of n x n matmuls calibrated to about ``target_s`` (enqueued without a sync on a GPU),
    and its matmul count. Ranks calibrate at once, so sharing the device is in the count."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)

    def one() -> float:
        start = time.perf_counter()
        torch.mm(a, b, out=c)
        sync(device)
        return time.perf_counter() - start

    one()  # warm-up: cuBLAS initialization
    reps = max(1, round(target_s / statistics.median(one() for _ in range(5))))

    def compute() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    return compute, reps


# --- one rank -------------------------------------------------------------------------------


def checked_epoch(loader: CollectiveLoader, where: Where, s: Settings) -> list[str]:
    """One epoch under the sync-debug window (a host sync in it raises), each batch summed on
    arrival and kept; compared bit for bit after the window closes. Returns the problems."""
    device = loader.device
    acc = torch.zeros((), dtype=torch.int64, device=device)
    got: list[dict[str, Any]] = []
    it = iter(loader)
    with no_host_sync(device):
        for batch in it:
            batch_sum(batch, acc)
            got.append(batch)
    problems = []
    if loader.device != target_device(s):
        problems.append(f"loader.device is {loader.device}, want {target_device(s)}")
    if len(got) != s.steps:
        problems.append(f"{len(got)} steps, want {s.steps}")
    for step, batch in enumerate(got):
        problems += [f"step {step}: {p}" for p in compare(batch, expected(step, where, s), device)]
    if int(acc) != expected_sum(where, s):
        problems.append(f"kernel sum of the batches on arrival {int(acc)}, want {expected_sum(where, s)}")
    return problems


def timed_epoch(loader: CollectiveLoader, compute: Callable[[], None] | None) -> tuple[list[float], list[float], int]:
    """Per step, seconds inside ``next()`` and in the rest of the step before it (the batch's sum,
    the compute, then a device sync, so the host cannot run ahead and the next wait is the real
    one); and the batches' kernel sum. Batches are not kept: the loader's buffers are reused as in
    training."""
    device = loader.device
    acc = torch.zeros((), dtype=torch.int64, device=device)

    def each(i: int, batch: Mapping[str, torch.Tensor]) -> None:
        batch_sum(batch, acc)
        if compute is not None:
            compute()
        sync(device)

    t = timed_steps(loader, 0, each=each)  # the warm-up is left out of the slowest rank's figures
    return t.waits, [step - wait for step, wait in zip(t.steps, t.waits)], int(acc)


def timing(loader: CollectiveLoader, where: Where, s: Settings) -> dict[str, Any]:
    """The synchronous epoch, then the one with compute; their sums checked."""
    compute, reps = make_compute(loader.device, s.matmul, s.compute_s)
    sync_waits, _, sync_sum = timed_epoch(loader, None)
    waits, computes, sum_ = timed_epoch(loader, compute)
    want = expected_sum(where, s)
    sums = {"synchronous": sync_sum, "compute": sum_}
    problems = [f"{epoch} epoch: kernel sum {got}, want {want}" for epoch, got in sums.items() if got != want]
    return {"sync": sync_waits, "wait": waits, "compute": computes, "reps": reps, "problems": problems}


def run_case(case: Case, s: Settings) -> dict[str, Any]:
    """Every rank: build the mesh and the loader, run the checked epoch (then the timed ones)."""
    if s.device == "cuda":
        torch.cuda.set_device(0)  # before the mesh: every rank shares GPU 0
    mesh = init_device_mesh(s.device, case.shape, mesh_dim_names=case.dims)
    where = where_of(mesh)
    loader = CollectiveLoader(
        Source(where, s),
        mesh,
        inputs=INPUTS,
        labels=LABELS,
        seq_dims=SEQ_DIMS,
        transport=case.transport,
        timeout=LOADER_TIMEOUT,
    )
    try:
        record: dict[str, Any] = {"problems": checked_epoch(loader, where, s)}
        if case.timed:  # on every rank alike, problems or not: a rank that skipped would leave its peers waiting
            record["timing"] = timing(loader, where, s)
    finally:
        loader.close()
    return record


def rank_main(job: Job) -> int:
    """Every rank: run the cases, write a record for each (an exception's traceback included);
    exit 1 on any problem. Stops at an exception: its peers may be stuck in that case's collectives."""
    failed = False
    for case in job.cases:
        try:
            record = run_case(case, job.settings)
        except Exception:  # the report says what happened on which rank
            record = {"error": traceback.format_exc()}
        keep(os.path.join(job.records, case.name), record)
        if "error" in record:
            return 1
        failed |= bool(record["problems"] or record.get("timing", {}).get("problems"))
    return int(failed)


def run_alone(job: Job) -> int:
    """A world of one rank whose default group has a CUDA backend on a GPU (the device
    transport's NCCL groups need one; NCCL allows one rank per GPU)."""
    backend = "cpu:gloo,cuda:nccl" if job.settings.device == "cuda" else "gloo"
    return launch.run(rank_main, job, 1, timeout=ALONE_TIMEOUT, backend=backend)
