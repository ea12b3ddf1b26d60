"""Which thread issues which collective, on which group: the rule that keeps a GPU job from hanging.

A user's script under torchrun, as a new user writes it: ``dist.init_process_group()`` with no
backend (torch then serves both devices: ``cpu:gloo,cuda:nccl``) and a CPU mesh. Every
collective the loader issues is recorded with its thread and its group's backend:

* host transport (default): whatever runs off the training thread runs on gloo groups, and no
  group of another backend exists;
* device transport: every collective on a device group (its tensor bytes) is issued by the
  training thread.

On a CUDA mesh the device groups are NCCL: this is the test that they are never used off the
training thread. A CPU mesh never touches CUDA, whatever the default group's backend string.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from collective_loader import CollectiveLoader

    calls = []

    def recording(fn):
        def wrapper(*args, group=None, **kwargs):
            calls.append({
                "fn": fn.__name__,
                "main": threading.current_thread() is threading.main_thread(),
                "backend": str(dist.get_backend(group)),
                "group": group.group_desc if group is not None else "default",
            })
            return fn(*args, group=group, **kwargs)
        return wrapper

    for name in ("broadcast", "scatter", "all_reduce", "all_gather"):
        setattr(dist, name, recording(getattr(dist, name)))

    dist.init_process_group()  # no backend named
    default_backend = str(dist.get_backend())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    batches = [{"x": torch.full((2, 8), i), "y": torch.full((2, 8), -i)} for i in range(6)]
    rank = dist.get_rank()
    for transport in ("host", "device"):
        calls.clear()
        loader = CollectiveLoader(batches, mesh, inputs=("x",), labels=("y",), transport=transport, timeout=60)
        got = [{k: v.clone() for k, v in b.items()} for b in loader]
        loader.close()
        wrong = [
            i for i, b in enumerate(got)
            if any(not torch.equal(v, batches[i][k]) or v.device.type != "cpu" for k, v in b.items())
        ]
        # one file per rank: four ranks' long lines on one pipe can interleave
        with open(os.path.join(sys.argv[1], f"{rank}-{transport}.json"), "w") as f:
            json.dump({
                "rank": rank, "transport": transport, "default_backend": default_backend,
                "steps": len(got), "wrong": wrong, "keys": sorted(got[0]) if got else [], "calls": calls,
            }, f)
    dist.destroy_process_group()
    """
)


def _records(tmp_path) -> list[dict]:
    script, results = tmp_path / "train.py", tmp_path / "results"
    script.write_text(SCRIPT)
    results.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            str(script),
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    records = [json.loads(path.read_text()) for path in sorted(results.glob("*.json"))]
    assert len(records) == 8, sorted(p.name for p in results.iterdir())
    return records


def test_collectives_by_thread_and_group(tmp_path):
    records = _records(tmp_path)
    for r in records:
        # torch picks a backend per device when none is named; the loader must not care
        assert r["default_backend"] != "gloo", r["default_backend"]
        assert r["steps"] == 6 and not r["wrong"], (r["rank"], r["transport"], r["wrong"])
        want = ["x"] if r["rank"] in (0, 1) else ["y"]  # pp=2: ranks 0, 1 are the first stage
        assert r["keys"] == want, (r["rank"], r["keys"])
        calls = r["calls"]
        off_main = [c for c in calls if not c["main"]]
        assert off_main, "the transfer thread issued no collective: the check below would prove nothing"
        if r["transport"] == "host":
            # nothing but gloo, on any thread
            assert {c["backend"] for c in calls} == {"gloo"}, calls
        else:
            data = [c for c in calls if c["group"].endswith("_data")]
            assert data, "no collective on a device group"
            assert all(c["main"] for c in data), [c for c in data if not c["main"]]
            # the device groups' backend is the mesh device's (gloo for a CPU mesh), not the default's
            assert {c["backend"] for c in data} == {"gloo"}
            assert all(c["backend"] == "gloo" for c in off_main), off_main
