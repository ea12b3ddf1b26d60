"""mosaicml-streaming's ``StreamingDataset`` on the data-parallel leaders only.

Streaming assumes every rank builds and iterates the dataset and that ranks which should see the
same samples are adjacent. Under pipeline parallelism neither holds. :class:`StreamingSource`
builds the dataset and its ``DataLoader`` on the leaders alone, showing streaming a world of
exactly the leaders (rank = dp_rank, world = dp_size, local world = leaders on this node), and
:class:`~collective_loader.CollectiveLoader` delivers its batches to everyone else::

    source = StreamingSource(mesh, local="/data/mds", batch_size=8, shuffle=True, num_workers=2)
    loader = CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",))

Batch sizes: ``batch_size`` is the **per-replica** batch of one step (what one leader's
``DataLoader`` yields, all micro-batches of a pipeline step together). The global batch is
``batch_size * dp_size``; a pipeline schedule splits each replica's batch into micro-batches.
Elastic resume keeps the global batch: at twice the replicas, halve ``batch_size``.

Streaming facts this relies on (mosaicml-streaming 0.13): ``World.detect()`` reads ``RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (and ``LOCAL_RANK``) when the dataset is built; the
constructor calls the default group's ``torch.distributed.barrier()`` three times; iteration
makes no ``torch.distributed`` calls. So, while constructing, the environment holds the leaders'
world and ``torch.distributed.barrier`` runs over a group of the leaders; both are restored
afterwards, also when construction raises.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import tempfile
import threading
import warnings
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from collective_loader.errors import LeaderError
from collective_loader.layout import MeshLayout
from collective_loader.transport import agree, new_group
from collective_loader.wire import Kind
from collective_loader.workers import stop_workers

Sample = Mapping[str, Any]
Failure = Callable[[int, str], Exception]  # (failing rank, its error's text) -> what the others raise
CLOSE_WAIT = 60.0  # seconds a leader waits for the others before releasing shared files


def lm_collate(samples: Sequence[Sample], key: str = "tokens") -> dict[str, torch.Tensor]:
    """Turn MDS samples holding ``seq_len + 1`` tokens into a language-model batch.

    Returns ``input_ids`` and ``labels`` (the same tokens shifted by one), ``position_ids``,
    each of shape ``(batch, seq_len)``, plus ``sample_id`` of shape ``(batch,)`` when the
    samples carry an ``id`` column. This is the place for your own collate: any function from a
    list of samples to a mapping of tensors works.

    >>> import numpy as np
    >>> b = lm_collate([{"tokens": np.arange(5), "id": 7}])
    >>> b["input_ids"].tolist(), b["labels"].tolist(), b["sample_id"].tolist()
    ([[0, 1, 2, 3]], [[1, 2, 3, 4]], [7])
    """
    tokens = torch.stack([torch.tensor(np.asarray(s[key]), dtype=torch.int64) for s in samples])
    seq_len = tokens.shape[1] - 1
    batch = {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_len).expand(len(samples), seq_len).contiguous(),
    }
    if all("id" in s for s in samples):
        batch["sample_id"] = torch.tensor([int(s["id"]) for s in samples])
    return batch


def leader_env(leaders: Sequence[int], dp_rank: int, local_world_size: int) -> dict[str, str]:
    """The environment streaming must see on the leader of replica ``dp_rank``.

    ``leaders`` are the leaders' global ranks ordered by dp_rank; a global rank's node is
    ``rank // local_world_size`` (torchrun's numbering). Streaming assumes every node holds the
    same number of its ranks and that its ranks are numbered node by node, so the leaders must
    be spread evenly over the nodes that hold any, with consecutive dp_ranks per node.

    >>> leader_env([0, 8], 1, local_world_size=8)  # one leader on each of two nodes
    {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '1', 'LOCAL_RANK': '0'}
    """
    nodes: dict[int, list[int]] = {}
    for dp, rank in enumerate(leaders):
        nodes.setdefault(rank // local_world_size, []).append(dp)
    per_node = {len(dps) for dps in nodes.values()}
    if len(per_node) != 1:
        counts = {node: len(dps) for node, dps in sorted(nodes.items())}
        raise ValueError(
            f"data-parallel leaders are spread unevenly over nodes ({counts} leaders per node); streaming "
            "needs the same number on every node that holds one: put the data dims of the mesh outermost "
            "or innermost, or give StreamingSource and CollectiveLoader the other placement= (\"spread\", "
            "the default, puts replica d's leader on pipeline stage d * pp // dp; \"first_stage\" puts "
            "every leader on the first stage)"
        )
    count = per_node.pop()
    for index, (node, dps) in enumerate(sorted(nodes.items())):
        if dps != list(range(index * count, (index + 1) * count)):
            raise ValueError(
                f"the leaders on node {node} are dp_ranks {dps}; streaming needs consecutive dp_ranks per node "
                f"({list(range(index * count, (index + 1) * count))})"
            )
    return {
        "RANK": str(dp_rank),
        "WORLD_SIZE": str(len(leaders)),
        "LOCAL_WORLD_SIZE": str(count),
        "LOCAL_RANK": str(dp_rank % count),
    }


class _LeadersBarrier:
    """Sends streaming's group-less ``barrier()`` calls, and only those, to the leaders' group.

    Streaming looks ``torch.distributed.barrier`` up on the module at call time, so the module
    attribute must change, and every thread sees it. The redirection is therefore per thread
    (only a thread inside :meth:`scope`) and per call (only a call without a group): another
    thread's barrier, or one on an explicit group, reaches the real barrier unchanged. One
    wrapper stays installed while any thread is inside a scope, so scopes that overlap in several
    threads put back the real barrier, not each other's wrapper.

    Each redirected barrier is an agreement (:func:`~collective_loader.transport.agree`), and a
    scope ends with one more: a leader whose construction raises posts its error as that
    agreement instead, so the other leaders, waiting in their next barrier or at the end, raise
    :class:`~collective_loader.errors.LeaderError` with its message at once rather than at the
    timeout. Every leader runs the same barriers, so the agreements match.
    """

    _OFF = object()  # this thread is in no scope

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scopes = 0
        self._real: Callable[..., Any] = dist.barrier
        self._target = threading.local()

    @contextlib.contextmanager
    def scope(self, group: dist.ProcessGroup | None, failed: Failure) -> Iterator[None]:
        """Inside, this thread's group-less barriers run over ``group`` (no-ops without one);
        when a member fails inside its scope, the others raise ``failed(rank, text)``."""
        with self._lock:
            if self._scopes == 0:
                self._real = dist.barrier
                dist.barrier = self._barrier
            self._scopes += 1
        outer = (
            getattr(self._target, "group", self._OFF), getattr(self._target, "settled", False),
            getattr(self._target, "failed", None),
        )
        self._target.group, self._target.settled, self._target.failed = group, False, failed
        try:
            yield
        except Exception as e:
            if group is not None and not self._target.settled:  # the others wait to hear from us
                with contextlib.suppress(RuntimeError):
                    agree(group, Kind.SOURCE_ERROR, f"{type(e).__name__}: {e}")
            raise
        else:
            if group is not None:
                self._agree(group)
        finally:
            self._target.group, self._target.settled, self._target.failed = outer
            with self._lock:
                self._scopes -= 1
                if self._scopes == 0:
                    dist.barrier = self._real

    def _barrier(self, *args: Any, **kwargs: Any) -> Any:
        target = getattr(self._target, "group", self._OFF)
        explicit = (args[0] if args else kwargs.get("group")) is not None
        if target is self._OFF or explicit:
            return self._real(*args, **kwargs)
        if target is None:  # one leader: nobody to wait for
            return None
        self._agree(target)
        return None

    def _agree(self, group: dist.ProcessGroup) -> None:
        kind, message, origin = agree(group, Kind.DATA, "")
        if kind != Kind.DATA:
            self._target.settled = True  # the failing member has spoken: no more agreements
            raise self._target.failed(origin, message)


_leaders_barrier = _LeadersBarrier()


def _leader_failed(origin: int, text: str) -> Exception:
    return LeaderError(f"leader rank {origin} failed while the leaders built their datasets: {text}")


@contextlib.contextmanager
def leaders_world(
    env: Mapping[str, str], group: dist.ProcessGroup | None, failed: Failure = _leader_failed
) -> Iterator[None]:
    """Inside: ``os.environ`` holds ``env``, and this thread's group-less
    ``torch.distributed.barrier()`` calls (streaming's) run over ``group`` (no-ops without one),
    each an agreement: when a member raises inside, the others raise ``failed(rank, text)`` at
    their next barrier or at the end. Other threads' barriers and barriers on an explicit group
    are not touched. Restored on exit, also on an exception. The environment is the process's:
    build one dataset at a time."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with _leaders_barrier.scope(group, failed):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StreamingSource:
    """Builds a ``StreamingDataset`` and its ``DataLoader`` on the leaders; pass it to
    ``CollectiveLoader`` as the source.

    Construct it on **every** rank (it creates a process group of the leaders, which every rank
    must join); the dataset itself is built only when ``CollectiveLoader`` calls it, on leaders.

    Args:
        mesh: the same ``DeviceMesh`` given to ``CollectiveLoader``.
        batch_size: per-replica batch size of one step (given to streaming and the DataLoader).
        collate: samples -> batch; :func:`lm_collate` by default.
        num_workers: DataLoader worker processes per leader.
        roles: dim roles, as for ``CollectiveLoader``.
        placement: where the leaders sit, as for ``CollectiveLoader`` (``"spread"`` by default;
            give both the same).
        clean_stale: first remove the shared memory and lock files killed runs left on this
            node (:func:`remove_stale`); blocks that a live process maps are kept.
        timeout: seconds the leaders wait for each other while building.
        dataloader_kwargs: more DataLoader arguments (``pin_memory``, ``prefetch_factor``, …).
        **dataset_kwargs: passed to ``StreamingDataset`` unchanged (``local``, ``remote``,
            ``streams``, ``shuffle``, ``shuffle_algo``, ``shuffle_seed``,
            ``num_canonical_nodes``, ``epoch_size``, …).
    """

    def __init__(
        self,
        mesh: Any,
        *,
        batch_size: int,
        collate: Callable[[Sequence[Sample]], Mapping[str, Any]] = lm_collate,
        num_workers: int = 0,
        roles: Mapping[str, str] | None = None,
        placement: str = "spread",
        clean_stale: bool = False,
        timeout: float = 600.0,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        **dataset_kwargs: Any,
    ) -> None:
        if "batch_size" in (dataloader_kwargs or {}) or "replication" in dataset_kwargs:
            raise ValueError("give batch_size once, to StreamingSource; replication is what this class replaces")
        layout = MeshLayout.from_mesh(mesh, roles, placement)
        self.place = layout.place(dist.get_rank())
        leaders = layout.leaders()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        # pure arithmetic from the layout and the node size, done on every rank: a placement
        # streaming cannot express is refused everywhere, not on the leaders alone (the others
        # would wait for them in a group creation until killed)
        self._env = leader_env(leaders, self.place.dp_rank, local_world_size)
        self._group = (
            new_group(sorted(leaders), "gloo", timeout, "collective_loader:streaming_leaders") if len(leaders) > 1 else None
        )
        self.batch_size = batch_size
        self._collate = collate
        self._num_workers = num_workers
        self._clean_stale = clean_stale
        self._dataloader_kwargs = dict(dataloader_kwargs or {})
        self._dataset_kwargs = dataset_kwargs

    def __call__(self) -> "LeaderStream":
        """Build the dataset and DataLoader (leaders only; ``CollectiveLoader`` calls this)."""
        if not self.place.is_leader:
            raise RuntimeError(f"rank {self.place.rank} is not a leader; only leaders build the dataset")
        from collective_loader.streaming_dataset import DownloadFailureRaisingDataset

        with leaders_world(self._env, self._group):
            if self._clean_stale:
                if self.place.dp_rank % int(self._env["LOCAL_WORLD_SIZE"]) == 0:  # the node's first leader
                    remove_stale()
                dist.barrier()  # the leaders' barrier: nobody looks for blocks while they are removed
            dataset = DownloadFailureRaisingDataset(batch_size=self.batch_size, **self._dataset_kwargs)
        loader = DataLoader(
            dataset, batch_size=self.batch_size, num_workers=self._num_workers, collate_fn=self._collate,
            **self._dataloader_kwargs,
        )
        return LeaderStream(dataset, loader, self.batch_size * self.place.dp_size, self._group)


class LeaderStream:
    """A leader's dataset and DataLoader, with a state that counts the batches taken from it.

    Its state is streaming's own (``StreamingDataset.state_dict``) for the *global* number of
    samples consumed, ``batches taken x global batch``, plus the global batch size, which a
    resume must keep (``supports_elastic_resume``: the DP degree may change with it). Streaming
    is asked once per epoch; the per-batch snapshots are arithmetic on that answer (each call
    of streaming's ``state_dict`` after a resume maps one more shared-memory block until exit).
    """

    supports_elastic_resume = True

    def __init__(self, dataset: Any, loader: DataLoader, global_batch: int, leaders: dist.ProcessGroup | None) -> None:
        self.dataset: Any = dataset
        self.loader: DataLoader | None = loader
        self.global_batch = global_batch
        self._leaders = leaders
        self._taken = 0
        self._epoch_state: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        assert self.loader is not None, "LeaderStream used after close()"
        self._taken, self._epoch_state = 0, None
        batches = iter(self.loader)
        try:
            for batch in batches:
                if self._epoch_state is None:  # the epoch has started: streaming knows its offset now
                    self._epoch_state = self.dataset.state_dict(num_samples=0, from_beginning=False)
                self._taken += 1
                yield batch
        except GeneratorExit:  # left early (CollectiveLoader.close): workers exit now, not at gc
            stop_workers(batches, self.loader)
            raise

    def state_dict(self) -> dict[str, Any]:
        if self._epoch_state is None:
            self._epoch_state = self.dataset.state_dict(num_samples=0, from_beginning=False)
        state = dict(self._epoch_state)
        state["sample_in_epoch"] += self._taken * self.global_batch
        return {**state, "global_batch": self.global_batch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("global_batch") != self.global_batch:
            raise ValueError(
                f"the state was saved with a global batch of {state.get('global_batch')} samples; this run's is "
                f"{self.global_batch} (batch_size x dp_size): streaming resumes exactly only with the same global batch"
            )
        self.dataset.load_state_dict({k: v for k, v in state.items() if k != "global_batch"})

    def close(self) -> None:
        """Release the dataset's shared memory and lock files now rather than at interpreter exit.

        Every leader calls it (``CollectiveLoader.close`` does); it first waits, at most
        ``CLOSE_WAIT`` seconds, for the other leaders, which share the node's blocks and locks.
        """
        if self.dataset is None:
            return
        stop_workers(getattr(self.loader, "_iterator", None), self.loader)  # persistent_workers
        dataset, self.dataset, self.loader = self.dataset, None, None
        if self._leaders is not None:
            try:
                dist.monitored_barrier(group=self._leaders, timeout=datetime.timedelta(seconds=CLOSE_WAIT))
            except RuntimeError as e:
                warnings.warn(f"not every leader closed its dataset; leaving streaming's files in place: {e}", stacklevel=2)
                return
        release(dataset)


def release(dataset: Any) -> None:
    """Free a ``StreamingDataset``'s shared memory blocks and remove its lock files now.

    Streaming only does the first at interpreter exit and never the second. Call it once every
    process on the node that uses the dataset's blocks is done with them.
    """
    iterator = getattr(dataset, "_iterator", None)
    if iterator is not None:
        # an epoch left early still has streaming's download threads reading the blocks: stop
        # them first (streaming's own call for this; it waits until they have exited)
        iterator.exit()
    for shm in _shared_memories(dataset):
        atexit.unregister(shm.cleanup)  # streaming registers one per block; it would run again
        shm.cleanup()
    for path in (dataset._shared_barrier.filelock_path, dataset._cache_filelock_path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_stale(shm_dir: str = "/dev/shm", tmp: str | None = None) -> list[str]:
    """Remove what this user's killed streaming runs left on this node; return the names removed.

    A live dataset keeps its shared-memory blocks (``NNNNNN_*`` in ``shm_dir``) mapped; a block
    that no process maps (read from ``/proc/*/maps``) was left by a run that was killed with its
    resource tracker. A lock file ``NNNNNN_*_filelock`` in the temp dir is stale when its
    prefix's ``NNNNNN_locals`` block is gone. Only files this user owns are candidates: whether
    another user's job is alive cannot be read (its maps are closed to us), and its files are not
    ours to remove. Kept also: every block while a process that may be ours cannot be inspected
    (see :func:`_mapped_shared_memory`). Never raises: a file that cannot be removed is kept, with
    a warning.
    """
    tmp = tmp or tempfile.gettempdir()
    # listed before /proc is read: a block created meanwhile is mapped by a process the scan may
    # have passed already, so it is no candidate
    blocks = _own_entries(shm_dir, r"\d{6}_\w+")
    mappings = _mapped_shared_memory()
    removed = []
    for name, st in blocks:
        if not mappings.may_map(name, st) and _remove(os.path.join(shm_dir, name)):
            removed.append(name)
    for name, _ in _own_entries(tmp, r"\d{6}_\w+_filelock"):
        if not os.path.exists(os.path.join(shm_dir, f"{name[:6]}_locals")) and _remove(os.path.join(tmp, name)):
            removed.append(name)
    return removed


def _own_entries(directory: str, pattern: str) -> list[tuple[str, os.stat_result]]:
    """Names in ``directory`` matching ``pattern`` whose file this process's user owns, sorted."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        warnings.warn(f"cannot list {directory} to remove stale streaming files: {e}", stacklevel=3)
        return []
    entries = []
    for name in names:
        if not re.fullmatch(pattern, name):
            continue
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:  # removed meanwhile
            continue
        if st.st_uid == os.geteuid():
            entries.append((name, st))
    return entries


def _remove(path: str) -> bool:
    """Remove ``path``; False, with a warning unless someone removed it first, when it cannot be."""
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        warnings.warn(f"kept {path}: {e}", stacklevel=3)
        return False
    return True


class _Mappings(NamedTuple):
    """What ``/proc`` tells about who maps ``/dev/shm`` files."""

    names: frozenset[str]  # mapped by a process whose maps we could read
    unseen: bool  # some process's maps could not be read
    unseen_ours: bool  # ... and that process may be one of ours

    def may_map(self, name: str, st: os.stat_result) -> bool:
        """Whether some process may have our block ``name`` (stat ``st``) mapped.

        A process we cannot inspect can open our block when it runs as us, or when the block's
        mode lets group or others in (streaming's are 0600).
        """
        return name in self.names or self.unseen_ours or (self.unseen and bool(st.st_mode & 0o077))


def _mapped_shared_memory() -> _Mappings:
    """Which ``/dev/shm`` files the processes on this machine have mapped, as far as we can see.

    A process whose maps we cannot read (another user's, or one we lack a capability for) may
    map anything it can open. It counts as possibly ours when it runs as our user and holds no
    capability we lack (a process of ours that is not dumpable, e.g. after changing its
    credentials); a process holding capabilities we lack is a system daemon we did not start
    (a container's init), and root's processes do not keep another user's blocks mapped
    (streaming maps another job's blocks only for the moment it reads their prefix).
    """
    me = _credentials("self")
    names: set[str] = set()
    unseen = unseen_ours = False
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if "/dev/shm/" in line:
                        names.add(line.split("/dev/shm/", 1)[1].split()[0])
        except PermissionError:  # alive, not ours to read
            unseen = True
            unseen_ours = unseen_ours or _may_be_ours(_credentials(pid), me)
        except OSError:  # the process ended
            continue
    return _Mappings(frozenset(names), unseen, unseen_ours)


def _credentials(pid: str) -> tuple[int, int] | None:
    """``(fsuid, permitted capabilities)`` of a process (``/proc/<pid>/status`` is readable by
    all), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["Uid"].split()[3]), int(fields["CapPrm"], 16)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _may_be_ours(theirs: tuple[int, int] | None, me: tuple[int, int] | None) -> bool:
    """Whether a process we cannot inspect may be one of ours; unknown credentials may be."""
    if theirs is None or me is None:
        return True
    (their_uid, their_caps), (my_uid, my_caps) = theirs, me
    return their_uid == my_uid and not their_caps & ~my_caps


def _shared_memories(obj: Any, depth: int = 3) -> list[Any]:
    """Streaming ``SharedMemory`` blocks reachable from ``obj`` through attributes."""
    from streaming.base.shared.memory import SharedMemory

    if isinstance(obj, SharedMemory):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    return [shm for value in vars(obj).values() for shm in _shared_memories(value, depth - 1)]
