"""The world streaming sees on the leaders: their environment, its barriers over their group, and
a shared-memory prefix no other job on the node can take.

Streaming facts this relies on (mosaicml-streaming 0.13): ``World.detect()`` reads ``RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (and ``LOCAL_RANK``) when the dataset is built; the
constructor calls the default group's ``torch.distributed.barrier()`` three times, two of them in
``get_shm_prefix`` (looked up on ``streaming.base.dataset`` at call time), which chooses the
prefix of the dataset's shared memory and lock files; iteration makes no ``torch.distributed``
calls. So, while constructing, the environment holds the leaders' world, ``torch.distributed.barrier``
runs over a group of the leaders and the prefix is claimed by the node's first leader and handed
to the others (:func:`collective_loader.streaming.cleanup.claim_prefix`); all are restored
afterwards, also when construction raises.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from collective_loader.delivery.agreement import agree_outcome
from collective_loader.errors import LeaderError
from collective_loader.plan.wire import Kind
from collective_loader.streaming.cleanup import claim_prefix, free

Failure = Callable[[int, str], Exception]  # (failing rank, its error's text) -> what the others raise


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
            'or innermost, or give StreamingSource and CollectiveLoader the other placement= ("spread", '
            'the default, puts replica d\'s leader on pipeline stage d * pp // dp; "first_stage" puts '
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
    """Sends streaming's group-less ``barrier()`` calls, and only those, to the leaders' group,
    and has the leaders claim the prefix of each dataset they build (:meth:`_shm_prefix`).

    Streaming looks ``torch.distributed.barrier`` up on the module at call time, so the module
    attribute must change, and every thread sees it. The redirection is therefore per thread
    (only a thread inside :meth:`scope`) and per call (only a call without a group): another
    thread's barrier, or one on an explicit group, reaches the real barrier unchanged. One
    wrapper stays installed while any thread is inside a scope, so scopes that overlap in several
    threads put back the real barrier, not each other's wrapper. The same holds for streaming's
    ``get_shm_prefix``, replaced on ``streaming.base.dataset`` (imported by a scope with a group;
    one without a group replaces it when streaming is loaded already).

    Each redirected barrier is an agreement (:func:`~collective_loader.delivery.agreement.agree_outcome`), and a
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
        self._prefix_module: Any = None  # streaming.base.dataset while its get_shm_prefix is replaced
        self._real_prefix: Callable[..., Any] | None = None
        self._target = threading.local()

    @contextlib.contextmanager
    def scope(self, group: dist.ProcessGroup | None, failed: Failure) -> Iterator[None]:
        """Inside, this thread's group-less barriers run over ``group`` (no-ops without one);
        when a member fails inside its scope, the others raise ``failed(rank, text)``."""
        if group is not None:
            # every member must replace get_shm_prefix (the replacement's collectives are not
            # streaming's), also one that would import streaming only inside the scope
            with contextlib.suppress(ImportError):
                import streaming.base.dataset  # noqa: F401
        with self._lock:
            if self._scopes == 0:
                self._real = dist.barrier
                dist.barrier = self._barrier
            module: Any = sys.modules.get("streaming.base.dataset")
            if module is not None and self._prefix_module is None:
                self._prefix_module, self._real_prefix = module, module.get_shm_prefix
                module.get_shm_prefix = self._shm_prefix
            self._scopes += 1
        outer = (
            getattr(self._target, "group", self._OFF),
            getattr(self._target, "settled", False),
            getattr(self._target, "failed", None),
        )
        self._target.group, self._target.settled, self._target.failed = group, False, failed
        try:
            yield
        except Exception as e:
            if group is not None and not self._target.settled:  # the others wait to hear from us
                with contextlib.suppress(RuntimeError):
                    agree_outcome(group, Kind.PHASE_ERROR, f"{type(e).__name__}: {e}")
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
                    if self._prefix_module is not None:
                        self._prefix_module.get_shm_prefix = self._real_prefix
                        self._prefix_module = None

    def _barrier(self, *args: Any, **kwargs: Any) -> Any:
        target = getattr(self._target, "group", self._OFF)
        explicit = (args[0] if args else kwargs.get("group")) is not None
        if target is self._OFF or explicit:
            return self._real(*args, **kwargs)
        if target is None:  # one leader: nobody to wait for
            return None
        assert isinstance(target, dist.ProcessGroup)
        self._agree(target)
        return None

    def _shm_prefix(
        self, streams_local: list[str], streams_remote: list[str | None], world: Any, retry: int = 100
    ) -> tuple[int, Any]:
        """Streaming's ``get_shm_prefix`` (same arguments, same result), except that in a scope
        the prefix is claimed (:func:`~collective_loader.streaming.cleanup.claim_prefix`) by the
        node's first rank of ``world`` alone, which hands it to the node's others: the group's
        members agree that every claim succeeded (a redirected barrier), then take their node's
        prefix from one all-reduce over the group. No rank chooses by looking for the lowest
        free prefix, which another job starting at the same moment would choose too."""
        target = getattr(self._target, "group", self._OFF)
        if target is self._OFF:
            assert self._real_prefix is not None
            return self._real_prefix(streams_local, streams_remote, world, retry)
        from streaming.base.constant import LOCALS
        from streaming.base.shared.memory import SharedMemory
        from streaming.base.shared.prefix import _check_self, _get_path, _unpack_locals

        _check_self(streams_local)
        claimed = claim_prefix(streams_local, streams_remote) if world.is_local_leader else None
        try:
            self._barrier()  # an agreement: a member whose claim raised is heard here
            prefixes = torch.full((world.num_nodes,), -1, dtype=torch.int64)
            if claimed is not None:
                prefixes[world.node] = claimed[0]
            if target is not None:
                assert isinstance(target, dist.ProcessGroup)
                dist.all_reduce(prefixes, op=dist.ReduceOp.MAX, group=target)
            if claimed is not None:
                return claimed
            prefix = int(prefixes[world.node])
            if prefix < 0:
                raise RuntimeError(f"no rank of node {world.node} claimed a shared-memory prefix (no local leader)")
            shm = SharedMemory(_get_path(prefix, LOCALS), False)
            their_locals, their_prefix = _unpack_locals(bytes(shm.buf))
            if their_locals != streams_local or their_prefix != prefix:
                free(shm)
                raise RuntimeError(
                    f"the shared memory of prefix {prefix} that this node's first leader claimed holds "
                    f"{their_locals} (prefix {their_prefix}), not this dataset's {streams_local}: give every leader "
                    "the same local directories"
                )
            return prefix, shm
        except BaseException:
            if claimed is not None:
                free(claimed[1])
            raise

    def _agree(self, group: dist.ProcessGroup) -> None:
        kind, message, origin = agree_outcome(group, Kind.DATA, "")
        if kind != Kind.DATA:
            self._target.settled = True  # the failing member has spoken: no more agreements
            raise self._target.failed(origin, message)


_leaders_barrier = _LeadersBarrier()


def leaders_barrier() -> None:
    """Inside :func:`leaders_world`: a barrier of the leaders, the same agreement as each of
    streaming's own (so a leader that failed before it is reported here)."""
    _leaders_barrier._barrier()


def _leader_failed(origin: int, text: str) -> Exception:
    return LeaderError(f"leader rank {origin} failed while the leaders built their datasets: {text}")


@contextlib.contextmanager
def leaders_world(
    env: Mapping[str, str], group: dist.ProcessGroup | None, failed: Failure = _leader_failed
) -> Iterator[None]:
    """Inside: ``os.environ`` holds ``env``, and this thread's group-less
    ``torch.distributed.barrier()`` calls (streaming's) run over ``group`` (no-ops without one),
    each an agreement: when a member raises inside, the others raise ``failed(rank, text)`` at
    their next barrier or at the end. A dataset built in this thread gets a shared-memory prefix
    that its node's first rank (of ``env``'s world) claims and hands to the node's others over
    ``group`` (:meth:`_LeadersBarrier._shm_prefix`): no other job on the machine can take it.
    Other threads' barriers and barriers on an explicit group are not touched. Restored on exit,
    also on an exception. The environment is the process's: build one dataset at a time."""
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
