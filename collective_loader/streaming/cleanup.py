"""Streaming's shared memory and lock files: released when a dataset is done, removed when a
killed run left them behind."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import tempfile
import warnings
from typing import Any, NamedTuple


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
