"""Scale without a cluster: one process plays one rank of a world of 1k to 64k ranks.

    python bench/scale.py            # bench/results/scale.{json,md} (run time: bench/README.md)
    python bench/scale.py --quick    # 1k and 16k ranks only: bench/results/scale_quick.*

Each (mesh, rank) runs in a fresh process (``--one MESH RANK``, JSON on its last stdout line):
``init_process_group("fake", rank=, world_size=)`` (torch's fake backend, as TorchTitan's dry
run uses it: ``torchtitan/distributed/utils.py``'s ``init_fake_mode``), the mesh by
``init_device_mesh``, then the real :class:`~collective_loader.CollectiveLoader` over a
one-batch in-memory source. What is measured on that rank:

* construction wall time and peak RSS above the process's resident memory just before it (after
  the imports, the world and the mesh: Linux's peak is reset there);
* every ``dist.new_group`` call (the library's ``transport.new_group`` goes through it): how many,
  how long they took, and the groups this rank is a member of, with their sizes;
* every collective issued while constructing: op, group size, bytes;
* per step, from the plan: the message each of its delivery channels carries (the library's own
  ``Mode.pack`` on a batch of ``ROWS`` rows of ``SEQ`` tokens), and the leaders' agreement.

What a fake world cannot give, and what this does instead:

* the fake backend answers every collective with the rank's own data (an all-reduce returns the
  input, a broadcast leaves the buffer as it is): every agreement therefore sees "no rank failed",
  and the configuration check sees its own digest, i.e. equal configs;
* gloo groups cannot be created on the fake backend's store (it segfaults in torch 2.14.1), so
  every ``new_group(backend="gloo")`` is made ``backend="fake"``: the group's ranks are checked and
  named by torch as for gloo, but gloo's connection to each peer (a store read and a TCP pair per
  member, see ``bench/leader_collectives.py``) is not made;
* a middle stage outside delivery reads its leader's configuration digest from the job's store:
  with no leader, this process posts it (the digest of its own config) when the loader's control
  group is created, as the leader would.
* the loader is not closed: rank 0 hosts the job's store, and its ``close()`` (the one at
  interpreter exit too) waits for every rank outside delivery to close its loader; the process
  ends with ``os._exit`` once it has printed its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from harness import MIB, REPO, Run, export, table  # bench/harness.py: run as python bench/<name>.py
from scale_rank import DIMS, ROWS, SEQ, one_rank

from collective_loader.plan.mesh import MeshLayout

# pp x dp x tp, pp outermost (TorchTitan's order); dp grows, so everything per replica grows with it
MESHES = {1024: (16, 8, 8), 4096: (16, 32, 8), 16384: (16, 128, 8), 65536: (16, 512, 8)}
TIMEOUT = 300.0  # seconds one rank's process may take
TARGET_SECONDS, TARGET_MIB = 2.0, 200  # at 16,384 ranks (issue 40)


def roles(layout: MeshLayout) -> dict[str, int]:
    """One rank of each role: a leader on the first and on the last stage, a first-stage peer of
    replica 0, a middle stage (outside delivery: no ``every_stage`` keys), a last-stage peer."""
    g = layout.replica_groups()[0]
    assert g.last is not None and g.middle is not None
    return {
        "leader, first stage": layout.leaders()[0],
        "leader, last stage": layout.leaders()[-1],
        "first-stage peer": next(r for r in g.first if r != g.leader),
        "middle stage": next(r for r in g.middle if r != g.leader),
        "last-stage peer": next(r for r in g.last if r != g.leader),
    }


# --- the parent ---------------------------------------------------------------------------------


def run_rank(world: int, rank: int, package: str) -> dict[str, Any]:
    """``one_rank`` in a fresh process (killed after ``TIMEOUT``), importing ``collective_loader``
    from the directory ``package``."""
    shape = ",".join(map(str, MESHES[world]))
    path = os.pathsep.join([package, os.environ.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, __file__, "--one", shape, str(rank)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path},
    )
    if out.returncode:
        raise RuntimeError(f"world {world} rank {rank} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def per_step(r: dict[str, Any]) -> tuple[int, int, int]:
    """``(collectives, bytes sent, bytes received)`` one step costs this rank, from the plan:
    a leader's agreement (24 bytes, when dp > 1) and one broadcast per channel (the message to each
    other member, as :class:`~collective_loader.delivery.transport.Channel` counts it); a member
    receives its channel's message; a rank outside delivery reads the store, no collective."""
    collectives = sent = received = 0
    if r["leader"] and r["dp"] > 1:
        collectives, sent, received = 1, 24, 24
    for ch in r["channels"]:
        collectives += 1 + ch["apart"]
        if r["leader"]:
            sent += ch["message"] * (ch["members"] - 1)
        else:
            received += ch["message"]
    return collectives, sent, received


def report(results: list[dict[str, Any]], run: Run, quick: bool, before: str | None) -> None:
    ours = [r for r in results if not r["version"]]
    rows, worlds = [], sorted({r["world"] for r in ours})
    for r in ours:
        collectives, sent, received = per_step(r)
        built_bytes = sum(b for _, _, b in r["collectives"])
        members = ", ".join(f"{d.removeprefix('collective_loader:')} {n}" for d, n in r["member_of"])
        rows.append(
            (
                f"{r['world']:,}",
                "×".join(map(str, r["shape"])),
                r["role"],
                r["rank"],
                f"{r['seconds']:.3f}",
                f"{r['new_group_seconds']:.3f}",
                f"{r['peak_above_base'] / MIB:.1f}",
                r["new_group_calls"],
                members,
                f"{len(r['collectives'])}, {built_bytes:,} B",
                f"{collectives}, {sent:,} / {received:,} B",
            )
        )
    at16k = [r for r in ours if r["world"] == 16384]
    worst = max(at16k, key=lambda r: r["seconds"]) if at16k else None
    body = [
        f"Each row is one rank of a fake world (`init_process_group('fake')`), in a process of its own; mesh "
        f"pp × dp × tp, pp outermost, default options (`placement='spread'`, no `every_stage` keys: the middle "
        f"stages are outside delivery); per step a batch of {ROWS} rows of {SEQ} int64 tokens for each of "
        "`input_ids`, `position_ids` (first stage) and `labels` (last stage). What the fake world skips: "
        "`bench/scale.py`'s docstring. *Construction*: `CollectiveLoader(...)` alone (the mesh is built before "
        "it); *in new_group*: the part of it inside `dist.new_group` (fake groups: gloo's connection to each "
        "peer is not made); *peak RSS*: above the process's resident memory just before construction; "
        "*groups it is in*: desc and size; *collectives at construction*: count and bytes of their tensors; "
        "*per step*: collectives, bytes sent / received (a leader's broadcast counted once per other member).",
        "",
        *table(
            "ranks | mesh | role | rank | construction s | in new_group s | peak RSS MiB | new_group calls | "
            "groups it is in (size) | collectives at construction | per step",
            rows,
        ),
    ]
    mesh_rows = [
        (f"{w:,}", f"{r['mesh_seconds']:.3f}", r["mesh_new_group_calls"])
        for w in worlds
        for r in [next(x for x in ours if x["world"] == w)]
    ]
    body += [
        "The mesh itself (`init_device_mesh`, torch's own cost, before the loader; the first sampled rank):",
        "",
        *table("ranks | init_device_mesh s | new_group calls", mesh_rows),
    ]
    largest = [r for r in ours if r["world"] == worlds[-1]]
    calls = sum(r["new_group_calls"] for r in largest)
    body += [
        f"At {worlds[-1]:,} ranks a rank's construction costs "
        f"{max(r['seconds'] for r in largest) / worlds[-1] * 1e6:.1f} µs and "
        f"{max(r['peak_above_base'] for r in largest) / worlds[-1]:.0f} B of peak memory per rank of the world "
        f"(the slowest and largest sampled rank), of which `new_group` takes "
        f"{sum(r['new_group_seconds'] for r in largest) / calls * 1e6:.0f} µs per call (a fake group; a "
        "non-member's call is the same Python on gloo, a member's adds gloo's connections).",
        "",
    ]
    if worst is not None:
        ok = worst["seconds"] <= TARGET_SECONDS and max(r["peak_above_base"] for r in at16k) <= TARGET_MIB * MIB
        body += [
            f"Target at 16,384 ranks (≤ {TARGET_SECONDS:.0f} s, ≤ {TARGET_MIB} MiB above the baseline on every "
            f"sampled rank): **{'met' if ok else 'missed'}** (slowest {worst['seconds']:.3f} s, largest peak "
            f"{max(r['peak_above_base'] for r in at16k) / MIB:.1f} MiB).",
            "",
        ]
    if before:
        old = {(r["world"], r["rank"]): r for r in results if r["version"] == before}
        slope = max(old[r["world"], r["rank"]]["seconds"] for r in largest) / worlds[-1]
        body += [
            f"Before this change construction was O(N) too, at {slope * 1e6:.1f} µs per rank of the world: "
            "`MeshLayout.replica_groups()` built a `Place` for every rank, and ran four times (the leaders, the "
            "groups, the configuration check, the placement check); it now runs once, as coordinate arithmetic.",
            "",
            f"Before this change (`--before {before}`: the package as of {before}, the same ranks, run alternately "
            "with the working tree):",
            "",
            *table(
                "ranks | role | construction s, before | construction s, now | peak RSS MiB, before | now",
                [
                    (
                        f"{r['world']:,}",
                        r["role"],
                        f"{old[r['world'], r['rank']]['seconds']:.3f}",
                        f"{r['seconds']:.3f}",
                        f"{old[r['world'], r['rank']]['peak_above_base'] / MIB:.1f}",
                        f"{r['peak_above_base'] / MIB:.1f}",
                    )
                    for r in ours
                ],
            ),
        ]
    body += FORMULAS
    name = "scale_quick" if quick else "scale"
    run.write(
        name, "Scale: one rank of a 1k to 64k-rank world (fake backend)", {"meta": run.meta(), "ranks": results}, body
    )


FORMULAS = [
    "## How each figure grows",
    "",
    "N ranks, dp replicas, pp stages, g = the size of a group; here N = 128 dp (pp 16, tp 8).",
    "",
    "| figure | formula | why |",
    "|---|---|---|",
    "| `new_group` calls (every rank) | 1 + [dp > 1] + dp × (2 + [pp > 1] + [middle stages get `every_stage` keys]) "
    "= 2 + 3 dp here (26, 98, 386, 1,538) | `dist.new_group` is collective over the world: every rank creates "
    "every group, in one order (docs/design.md) |",
    "| their rank lists | Σ g over all groups ≈ 3 N (control N, each replica's ranks, each stage group) | "
    "each call passes its group's ranks; torch checks each (O(g) per call, member or not) |",
    "| groups a rank is in | control (N), its replica's ranks in delivery (2 tp: the first and the last stage), "
    "its stage's group (tp, or tp + 1 with a leader from the other end), leaders (dp, leaders only); a middle "
    "stage: control only | constant in N but the control group (N) and the leaders' (dp) |",
    "| construction time, memory | O(N) with a small constant: one pass over the ranks "
    "(`MeshLayout.replica_groups()`, computed once) plus the rank lists above; O(dp) `new_group` calls | the floor "
    "`new_group` sets (each rank lists every group's ranks) |",
    "| collectives at construction | 4 all-reduces of 24 B over the control group (one per phase: config, "
    "config check, placement, source), 1 broadcast of a 32 B digest over the replica, 1 more over the leaders "
    "(leaders) | constant in N: the config is compared by digest |",
    "| gloo connections a real world adds (skipped here) | per member group g − 1 store reads and TCP pairs "
    "(gloo connects every pair at creation unless `TORCH_GLOO_LAZY_INIT=1`; pytorch/gloo#419): control N − 1, "
    "so N − 1 per rank and N (N − 1) store reads in all | what stands in the way at real scale: the control "
    "group spans the world (bench/results/leader_collectives.md measures a member's `new_group` against W) |",
    "| per step, leader | 1 all-reduce of 24 B over the dp leaders + 1 broadcast per delivery group of its "
    "message (64 B header + description + tensor bytes) | the bytes do not grow with N; the all-reduce's "
    "latency grows with dp (bench/results/leader_collectives.md) |",
    "| per step, member | 1 broadcast received; outside delivery: store reads of its leader's bulletin | constant |",
    "",
    "## What torch 2.14.1 offers to cut `new_group`'s cost, and why the loader does not use it",
    "",
    "- `new_group(use_local_synchronization=True)`: non-members return before torch counts the group "
    "(`_world.group_count`), and members name the group by hashing its ranks with that count; once ranks "
    "have skipped different groups (a leader is in more than its peers), the members of a later group compute "
    "different names and rendezvous under different store keys (a hang), and the trainer's own later groups, "
    "named by the same count, diverge too.",
    "- `split_group`: raises `No device associated with the default pg` unless the default group was made "
    "with `device_id=` (a GPU); on a gloo (CPU) world it is not available. It would make every replica's "
    "first-stage group in one call (the groups of one kind are disjoint).",
    "- The mesh's own groups (`mesh.get_group(dim)`; `init_device_mesh` made them without a `new_group` call "
    "here): a delivery group is one stage's ranks plus a leader that may sit on the other end stage, and the "
    "leaders under `placement='spread'` sit on two stages, so neither is a mesh dim; on a GPU mesh those "
    "groups are NCCL, and the loader's are gloo.",
    "",
    "What is left is `new_group`'s own floor: every rank passes every group's ranks (≈ 3 N integers) in "
    "O(dp) calls (their time per call: above), and gloo's connections for the groups it is in.",
    "",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1k and 16k ranks only")
    parser.add_argument("--before", metavar="REV", help="also build the package as of REV (git archive) on each rank")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "RANK"), help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.one:
        shape, rank = tuple(int(s) for s in a.one[0].split(",")), int(a.one[1])
        print(json.dumps(one_rank(shape, rank)), flush=True)
        os._exit(0)  # no close: rank 0 hosts the store and waits there for ranks a fake world does not have
    run = Run("scale.py")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        packages = {"": REPO} | ({a.before: export(a.before, tmp)} if a.before else {})
        for world in (1024, 16384) if a.quick else sorted(MESHES):
            layout = MeshLayout.build(DIMS, MESHES[world], range(world))
            for role, rank in roles(layout).items():
                for version, package in packages.items():
                    r = run_rank(world, rank, package) | {"role": role, "version": version}
                    print(
                        f"{world:>6} {role:<20} rank {rank:>6} {version or 'working tree':<12} "
                        f"{r['seconds']:.3f} s, {r['peak_above_base'] / MIB:.1f} MiB",
                        flush=True,
                    )
                    results.append(r)
    report(results, run, a.quick, a.before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
