"""The leaders' world streaming sees, for leaders on one or several nodes (no real nodes needed)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from collective_loader.layout import MeshLayout
from collective_loader.streaming import leader_env, leaders_world


def _envs(dims, shape, local_world_size):
    layout = MeshLayout.build(dims, shape, range(int(__import__("math").prod(shape))))
    leaders = layout.leaders()
    return [leader_env(leaders, dp, local_world_size) for dp in range(len(leaders))]


def test_all_leaders_on_one_node():
    # pp outermost on 2 nodes of 8: every leader sits on the first node
    envs = _envs(("pp", "dp", "tp"), (2, 4, 2), 8)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]


def test_one_leader_per_node():
    envs = _envs(("dp", "pp", "tp"), (4, 2, 4), 8)  # replica d fills node d
    assert [(e["RANK"], e["LOCAL_WORLD_SIZE"], e["LOCAL_RANK"]) for e in envs] == [
        ("0", "1", "0"), ("1", "1", "0"), ("2", "1", "0"), ("3", "1", "0")
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
    from multiprocessing import shared_memory

    from collective_loader.streaming import remove_stale

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
