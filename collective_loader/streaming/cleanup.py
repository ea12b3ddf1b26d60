"""Streaming's shared memory and lock files: a prefix of its own for each dataset the leaders
build (:func:`claim_prefix`), released when the dataset is done, removed when a killed run left
them behind."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

# The prefixes claim_prefix takes: above those streaming counts up from 0 for its own datasets (so
# a plain StreamingDataset starting beside ours, which scans from 0 and creates its choice later,
# does not race ours), below the 99999x names tests use for fake blocks.
PREFIXES = range(100_000, 900_000)


def claim_prefix(
    streams_local: Sequence[str],
    streams_remote: Sequence[str | None],
    shm_dir: str = "/dev/shm",
    tmp: str | None = None,
    prefixes: Sequence[int] = PREFIXES,
) -> tuple[int, Any]:
    """Take a shared-memory prefix for a new dataset on this node: ``(prefix, its locals block)``.

    Streaming (0.13) has every rank find the lowest prefix without a ``NNNNNN_locals`` block and
    the node's first rank create it afterwards, so two jobs that start together on one machine
    take the same one (``FileExistsError: [Errno 17] File exists: '/000000_locals'``, or the
    other job's block on another rank: "shared memory prefix=0 was not registered by local
    leader"). Here one process, the node's first leader, takes the prefix by creating its
    ``locals`` block with ``O_EXCL`` (what every dataset, streaming's own too, creates before any
    other block or lock file of its prefix): of processes that try the same prefix at once one
    gets it and the others try another, so no two datasets share a prefix. A prefix of which any
    file is left in ``shm_dir`` or lock file in the temp dir is skipped (a killed run's, which
    therefore never stops a new one). Tried from a random point of ``prefixes``.

    Streaming's check is kept: a live dataset on this node with the same local directory for a
    stream with a remote (they would evict each other's shards) raises ``ValueError``, also when
    both start together (each checks after taking its prefix). A block that no process maps (a
    killed run's) is no such dataset.
    """
    from streaming.base.shared.memory import SharedMemory
    from streaming.base.shared.prefix import _pack_locals

    tmp = tmp or tempfile.gettempdir()
    taken = _prefixes_in(shm_dir) | _prefixes_in(tmp)
    start = secrets.randbelow(len(prefixes))
    for i in range(len(prefixes)):
        prefix = prefixes[(start + i) % len(prefixes)]
        if prefix in taken:
            continue
        data = _pack_locals(list(streams_local), prefix)
        try:
            shm = SharedMemory(f"{prefix:06}_locals", True, len(data))
        except FileExistsError:  # another dataset took it meanwhile
            continue
        shm.buf[: len(data)] = data
        try:
            _check_no_live_overlap(streams_local, streams_remote, shm_dir, prefix)
        except BaseException:
            free(shm)
            raise
        return prefix, shm
    raise RuntimeError(f"no free shared-memory prefix in {prefixes} ({shm_dir}, {tmp})")


def free(shm: Any) -> None:
    """Unlink (when this process created it) and close one streaming ``SharedMemory`` block now."""
    atexit.unregister(shm.cleanup)  # streaming registers one per block; it would run again
    shm.cleanup()


def _prefixes_in(directory: str) -> set[int]:
    """The prefixes of streaming's files (``NNNNNN_...``) in ``directory``."""
    try:
        return {int(n[:6]) for n in os.listdir(directory) if re.match(r"\d{6}_", n)}
    except OSError:
        return set()


def _check_no_live_overlap(
    streams_local: Sequence[str], streams_remote: Sequence[str | None], shm_dir: str, mine: int
) -> None:
    """Streaming's refusal of a local directory that another live dataset on this node uses for
    a stream with a remote; blocks nobody maps (killed runs') do not count."""
    from streaming.base.shared.prefix import _unpack_locals

    cached = {local for local, remote in zip(streams_local, streams_remote) if remote is not None}
    if not cached:
        return
    mappings: _Mappings | None = None
    for name in sorted(os.listdir(shm_dir)):
        if not re.fullmatch(r"\d{6}_locals", name) or int(name[:6]) == mine:
            continue
        try:
            with open(os.path.join(shm_dir, name), "rb") as f:
                st = os.fstat(f.fileno())
                their_locals, _ = _unpack_locals(f.read())
        except (OSError, ValueError, UnicodeDecodeError):  # gone, not ours to read, or not streaming's
            continue
        shared = cached.intersection(their_locals)
        if not shared:
            continue
        mappings = mappings or _mapped_shared_memory()
        if mappings.may_map(name, st):
            raise ValueError(
                f"Reused local directory: {sorted(shared)} is the local directory of a live dataset on this node "
                f"(shared memory {name}). Provide a different one."
            )


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
        free(shm)
    for path in (dataset._shared_barrier.filelock_path, dataset._cache_filelock_path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_stale(shm_dir: str = "/dev/shm", tmp: str | None = None, min_age: float = 0.0) -> list[str]:
    """Remove what this user's killed streaming runs left on this node; return the names removed.

    A live dataset keeps its shared-memory blocks (``NNNNNN_*`` in ``shm_dir``) mapped; a block
    that no process maps (read from ``/proc/*/maps``) was left by a run that was killed with its
    resource tracker. A lock file ``NNNNNN_*_filelock`` in the temp dir is stale when its
    prefix's ``NNNNNN_locals`` block is gone. Only files this user owns are candidates: whether
    another user's job is alive cannot be read (its maps are closed to us), and its files are not
    ours to remove. Kept also: every block while a process that may be ours cannot be inspected
    (see :func:`_mapped_shared_memory`), and every block changed less than ``min_age`` seconds
    ago: a process that has just created a block maps it a moment later, and a scan in that
    moment must not take it for a dead one (another job on the machine starting at the same time;
    ``StreamingSource(clean_stale=True)`` gives 2 s). Never raises: a file that cannot be removed
    is kept, with a warning.
    """
    tmp = tmp or tempfile.gettempdir()
    # listed before /proc is read: a block created meanwhile is mapped by a process the scan may
    # have passed already, so it is no candidate
    blocks = _own_entries(shm_dir, r"\d{6}_\w+")
    mappings = _mapped_shared_memory()
    young = time.time() - min_age
    removed = []
    for name, st in blocks:
        if st.st_ctime < young and not mappings.may_map(name, st) and _remove(os.path.join(shm_dir, name)):
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
