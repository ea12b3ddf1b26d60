"""The leaders' world streaming sees, for leaders on one or several nodes (no real nodes needed);
the barrier redirection's scope; the clean-up of killed runs' files beside other users' jobs."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from multiprocessing import shared_memory

import pytest
import torch.distributed as dist

from collective_loader.plan.mesh import MeshLayout
from collective_loader.streaming.leaders_world import leader_env, leaders_world


def _envs(dims, shape, local_world_size, placement="spread"):
    layout = MeshLayout.build(dims, shape, range(int(__import__("math").prod(shape))), placement=placement)
    leaders = layout.leaders()
    return [leader_env(leaders, dp, local_world_size) for dp in range(len(leaders))]


def test_spread_leaders_share_the_stages_nodes():
    # pp outermost on 2 nodes of 8, the default placement: replicas 0-1 on node 0, 2-3 on node 1
    envs = _envs(("pp", "dp", "tp"), (2, 4, 2), 8)
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["LOCAL_RANK"]) for e in envs] == [
        ("0", "4", "2", "0"),
        ("1", "4", "2", "1"),
        ("2", "4", "2", "0"),
        ("3", "4", "2", "1"),
    ]


def test_spread_leaders_uneven_over_the_stages_nodes_are_refused_where_first_stage_works():
    # pp=2 outermost, dp=3, a stage per node: spread puts replicas 0, 1 on node 0 and 2 on node 1
    with pytest.raises(ValueError, match=r"unevenly over nodes \(\{0: 2, 1: 1\}.*placement="):
        _envs(("pp", "dp", "tp"), (2, 3, 2), 6)
    assert [e["LOCAL_RANK"] for e in _envs(("pp", "dp", "tp"), (2, 3, 2), 6, "first_stage")] == ["0", "1", "2"]


def test_all_leaders_on_one_node():
    # pp outermost on 2 nodes of 8, placement "first_stage": every leader sits on the first node
    envs = _envs(("pp", "dp", "tp"), (2, 4, 2), 8, "first_stage")
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]


def test_one_leader_per_node():
    envs = _envs(("dp", "pp", "tp"), (4, 2, 4), 8)  # replica d fills node d
    assert [(e["RANK"], e["LOCAL_WORLD_SIZE"], e["LOCAL_RANK"]) for e in envs] == [
        ("0", "1", "0"),
        ("1", "1", "0"),
        ("2", "1", "0"),
        ("3", "1", "0"),
    ]


def test_two_leaders_per_node_on_four_nodes():
    envs = _envs(("dp", "tp"), (8, 4), 8)  # 32 ranks, 4 nodes of 8, leaders every 4th rank
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"] * 4
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["WORLD_SIZE"] for e in envs} == {"8"}
    # streaming's node of a leader, rank // local world, is the real node
    assert [int(e["RANK"]) // 2 for e in envs] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_uneven_leaders_refused():
    with pytest.raises(ValueError, match="unevenly"):
        leader_env([0, 1, 2, 8], 0, 8)


def test_non_consecutive_dp_ranks_refused():
    # dp_rank 0 and 2 on node 0, 1 and 3 on node 1
    with pytest.raises(ValueError, match="consecutive dp_ranks"):
        leader_env([0, 8, 1, 9], 0, 8)


def test_leaders_world_restores_env_and_barrier_on_error(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    real = dist.barrier
    with pytest.raises(RuntimeError, match="boom"):
        with leaders_world({"RANK": "1", "LOCAL_RANK": "0"}, None):
            assert os.environ["RANK"] == "1" and os.environ["LOCAL_RANK"] == "0"
            assert dist.barrier is not real
            dist.barrier()  # no leaders group: a no-op, not the default group's barrier
            raise RuntimeError("boom")
    assert os.environ["RANK"] == "5" and "LOCAL_RANK" not in os.environ
    assert dist.barrier is real


def test_remove_stale_keeps_mapped_blocks_and_removes_the_rest(tmp_path):
    from collective_loader.streaming.cleanup import remove_stale

    live = shared_memory.SharedMemory(name="999990_locals", create=True, size=64)  # mapped here
    dead = shared_memory.SharedMemory(name="999991_barrier", create=True, size=64)
    dead.close()  # unmapped, never unlinked: what a killed run leaves
    (tmp_path / "999990_barrier_filelock").write_text("")
    (tmp_path / "999991_barrier_filelock").write_text("")
    try:
        removed = remove_stale(tmp=str(tmp_path))
        assert "999991_barrier" in removed and "999991_barrier_filelock" in removed
        assert "999990_locals" not in removed and os.path.exists("/dev/shm/999990_locals")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["999990_barrier_filelock"]
    finally:
        live.close()
        live.unlink()
        if os.path.exists("/dev/shm/999991_barrier"):
            os.remove("/dev/shm/999991_barrier")


# --- the barrier redirection is scoped --------------------------------------------------------


def barriers_while_constructing(timeout_s: float) -> None:
    """Both ranks are inside ``leaders_world`` (as while streaming's constructor runs); one of
    rank 0's threads, and rank 1, meanwhile take barriers on another group of the same ranks.

    Only rank 0's group-less calls from the constructing thread may go to the leaders' group:
    anything else redirected there leaves the other group's barrier waiting until its timeout.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    leaders = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    other = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    if dist.get_rank() == 1:  # the other leader, constructing on one thread only
        dist.barrier(group=other)  # meets rank 0's other thread
        with leaders_world({}, leaders):
            dist.barrier()  # meets rank 0's group-less call (streaming's)
            dist.barrier(group=other)  # meets rank 0's explicit-group call
        return
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            dist.barrier(group=other)
        except BaseException as e:  # re-raised on the main thread
            errors.append(e)

    with leaders_world({}, leaders):
        thread = threading.Thread(target=other_thread)
        thread.start()
        dist.barrier()  # what streaming calls: to the leaders
        thread.join()
        dist.barrier(group=other)  # an explicit group from the constructing thread: unchanged
    if errors:
        raise errors[0]


def test_leaders_world_redirects_only_the_constructing_threads_groupless_barriers(worlds):
    worlds.get(2).run(barriers_while_constructing, 10.0, timeout=60)


def test_leaders_world_overlapping_in_two_threads_restores_the_real_barrier():
    real = dist.barrier
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with leaders_world({}, None):
            first_in.set()
            second_in.wait(10)
        first_out.set()  # leaves before the second thread does

    def second() -> None:
        first_in.wait(10)
        with leaders_world({}, None):
            second_in.set()
            first_out.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert dist.barrier is real


# --- remove_stale beside another user's job ---------------------------------------------------

# Runs remove_stale as nobody in a fresh process. It starts as root and drops to nobody the way
# setpriv --reuid --regid --clear-groups does, after its imports: python lives under /root, which
# nobody cannot enter.
AS_NOBODY = textwrap.dedent("""
    import json, os, sys
    from collective_loader.streaming.cleanup import remove_stale
    uid, gid, shm_dir, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    with open("/proc/self/status") as f:
        assert "CapEff:\t0000000000000000" in f.read(), "still privileged"
    print(json.dumps(remove_stale(shm_dir, tmp)))
""")


def _file(path: str, uid: int, gid: int) -> str:
    """An empty file of ``uid``, mode 0600 as streaming's blocks are."""
    with open(path, "w"):
        pass
    os.chmod(path, 0o600)
    os.chown(path, uid, gid)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: to own a block nobody cannot see, and to become nobody")
def test_remove_stale_as_another_user_keeps_what_is_not_its_own():
    nobody = pwd.getpwnam("nobody")
    uid, gid = nobody.pw_uid, nobody.pw_gid
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="collective_loader_stale_"))  # pytest's tmp_path is root's only
    tmp.chmod(0o1777)  # like /tmp: anyone may create, only the owner may remove
    live = shared_memory.SharedMemory(name="999980_locals", create=True, size=64)  # root's live job
    created = [
        _file("/dev/shm/999982_barrier", 0, 0),  # root's, unmapped: nobody cannot tell whose job it is
        _file("/dev/shm/999981_locals", uid, gid),  # nobody's, unmapped: its own killed run's
        _file(str(tmp / "999980_barrier_filelock"), uid, gid),  # nobody's lock of a live prefix
        _file(str(tmp / "999981_barrier_filelock"), uid, gid),  # nobody's lock of a gone prefix
        _file(str(tmp / "999983_cache_filelock"), 0, 0),  # root's lock of a gone prefix
    ]
    try:
        proc = subprocess.run(
            [sys.executable, "-c", AS_NOBODY, str(uid), str(gid), "/dev/shm", str(tmp)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == ["999981_locals", "999981_barrier_filelock"]
        assert os.path.exists("/dev/shm/999980_locals") and os.path.exists("/dev/shm/999982_barrier")
        assert sorted(p.name for p in tmp.iterdir()) == ["999980_barrier_filelock", "999983_cache_filelock"]
    finally:
        live.close()
        live.unlink()
        for path in created:
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(tmp)


def test_remove_stale_leaves_a_block_created_while_it_scans(monkeypatch, tmp_path):
    """A job that starts while /proc is being read maps its new block after the scan has passed
    its process: the block must not be judged by that scan."""
    from collective_loader.streaming import cleanup

    scan = cleanup._mapped_shared_memory

    def scan_while_a_job_starts():
        mappings = scan()
        # the new job's block (0600, as streaming's), created after its process was read
        os.close(os.open("/dev/shm/999984_locals", os.O_CREAT | os.O_WRONLY, 0o600))
        return mappings

    monkeypatch.setattr(cleanup, "_mapped_shared_memory", scan_while_a_job_starts)
    try:
        assert "999984_locals" not in cleanup.remove_stale(tmp=str(tmp_path))
        assert os.path.exists("/dev/shm/999984_locals")
    finally:
        if os.path.exists("/dev/shm/999984_locals"):
            os.remove("/dev/shm/999984_locals")


@pytest.mark.parametrize(
    "theirs, ours",
    [
        ((1000, 0b01), True),  # our user, no capability we lack: a non-dumpable process of ours
        ((1000, 0b11), False),  # our user with a capability we lack: a daemon we did not start
        ((0, 0b01), False),  # another user (root): cannot open our 0600 blocks without privilege
        (None, True),  # credentials unknown: may be anyone
    ],
)
def test_a_process_we_cannot_inspect_counts_as_ours_only_when_it_may_be(theirs, ours):
    from collective_loader.streaming.cleanup import _may_be_ours

    assert _may_be_ours(theirs, (1000, 0b01)) is ours
