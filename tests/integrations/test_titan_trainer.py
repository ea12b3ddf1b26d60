"""TorchTitan 0.3's own Trainer, unmodified, training on our loader: ``torchrun -m torchtitan.train``
with ``--module collective_loader.integrations.titan_configs`` (through ``collective_loader.integrations.titan_cpu``, which only makes
a CPU do, and ``tests/support/titan_trainer_configs.py``, which records what each rank got).

Every run starts from one seed checkpoint (TorchTitan's own ``--checkpoint.create_seed_checkpoint``)
so that runs on different meshes start from the same weights; the dataset is written here with
streaming's ``MDSWriter``. pp=2 x dp_shard=2 trains with the losses of pp=1 x dp_shard=2 on the
same global batches, the seed's naive set-up does not (slow), a restart from TorchTitan's own
checkpoint continues with the same losses and samples, and only one process per replica opens
the dataset. ``python -m pytest -m slow tests/integrations/test_titan_trainer.py`` adds the naive set-up, tp,
dp_replicate, pp x dp_shard x tp, the 1F1B and GPipe schedules, and 16-step runs. cp does not run on a CPU:
TorchTitan's CPU attention has no context-parallel path (see ``docs/torchtitan.md``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import pytest
import titan_run
import torch

from collective_loader.integrations import titan_configs
from collective_loader.integrations.titan_batches import titan_collate
from collective_loader.integrations.titan_streaming import TitanStreamingDataLoader
from collective_loader.integrations.titan_trainer import load_mds_once_per_replica
from collective_loader.integrations.titan_wrap import with_mesh

SEQ, BATCH, DP = 64, 4, 2  # tokens per sample, TorchTitan's local batch, data-parallel replicas
STEPS, EPOCH_STEPS = 8, 6  # the dataset holds 6 global batches: 8 steps cross into a second epoch
TOLERANCE = 2e-5  # the log prints 5 decimals; float32 sums in another order differ below that


def test_the_dataloader_config_names_what_to_change():
    build = dict(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=8, local_batch_size=1)
    with pytest.raises(ValueError, match="TitanTrainer.Config"):  # the stock Trainer passes no mesh
        TitanStreamingDataLoader.Config(dataset_path="/data/mds").build(**build)
    with pytest.raises(ValueError, match="--dataloader.dataset_path"):
        with_mesh(TitanStreamingDataLoader.Config(), "a mesh").build(**build)
    with pytest.raises(ValueError, match="holds 5 tokens per sample and training.seq_len is 8.*--training.seq_len 4"):
        titan_collate([{"tokens": np.arange(5)}], seq_len=8)
    with pytest.raises(TypeError, match="TitanStreamingDataLoader.Config is not the config of a TorchTitan Trainer"):
        load_mds_once_per_replica(TitanStreamingDataLoader.Config())
    with pytest.raises(AttributeError):
        titan_configs.llama3_no_such_config  # noqa: B018  --config names must be TorchTitan's config functions
    assert "llama3_8b" in dir(titan_configs)  # what TorchTitan lists when --config names none of them


class Epochs:
    """Stands in for a CollectiveLoader: each ``iter()`` is the next of ``epochs``."""

    def __init__(self, *epochs: list[int]) -> None:
        self.epochs = iter(epochs)

    def __iter__(self):
        return iter([{"input": torch.tensor([i]), "labels": torch.tensor([i])} for i in next(self.epochs)])


@pytest.mark.parametrize(
    "infinite, epochs, want",
    [
        (False, ([1, 2], [3]), [1, 2]),  # one pass
        (True, ([1, 2], [3], [], [4]), [1, 2, 3]),  # epochs until a fresh one is empty
        (True, ([], [3], []), [3]),  # a resumed epoch may have nothing left
    ],
)
def test_the_dataloader_starts_epochs_while_infinite(infinite, epochs, want):
    dataloader = TitanStreamingDataLoader.__new__(TitanStreamingDataLoader)  # no mesh: only __iter__ runs
    dataloader.loader, dataloader.labels, dataloader.infinite = Epochs(*epochs), "labels", infinite
    assert [int(labels) for _, labels in dataloader] == want


@dataclass
class Run:
    losses: dict[int, float]  # step -> TorchTitan's logged global loss
    ids: dict[int, list[dict]]  # rank -> per micro-batch, sample ids of inputs and of labels
    openers: list[tuple[int, int]]  # (rank, pid) of every process that opened the dataset
    replica: dict[int, int]  # rank -> data-parallel replica
    seconds: float
    log: str  # torchrun's output, every rank's lines prefixed with [rank<r>]


@dataclass
class Data:
    root: str
    flags: list[str]


def torchrun(ranks: int, config: str, flags: list[str], out: str, timeout: float) -> float:
    """``torchrun -m collective_loader.integrations.titan_cpu --module titan_trainer_configs --config <config> <flags>``; its log is ``<out>.log``."""
    return titan_run.torchrun(ranks, "titan_trainer_configs", config, flags, out, timeout)


def train(
    data: Data,
    name: str,
    *,
    pp: int = 1,
    dp: int = DP,
    inner: int = 1,
    flags: tuple[str, ...] = (),
    config: str = "ours",
    steps: int = STEPS,
    dump: str | None = None,
    timeout: float = 420,
) -> Run:
    """One run of ``pp * dp * inner`` ranks (inner: cp x tp) from the seed checkpoint. The losses are
    read from TorchTitan's metrics rank, the first rank of the last stage."""
    out = os.path.join(data.root, name)
    ranks = pp * dp * inner
    flags = [
        *data.flags,
        f"--training.steps={steps}",
        f"--parallelism.pipeline_parallel_degree={pp}",
        f"--dump_folder={dump or out}",
        f"--dataloader.record={out}",
        *flags,
    ]
    seconds = torchrun(ranks, config, flags, out, timeout)
    losses = titan_run.losses(out, ranks - ranks // pp)
    ids = {}
    for rank in range(ranks):
        with open(f"{out}.rank{rank}.jsonl") as f:
            ids[rank] = [json.loads(line) for line in f]
    with open(f"{out}.opens") as f:
        openers = [(int(rank), int(pid)) for rank, pid in (line.split() for line in f)]
    # TorchTitan numbers the ranks (pp, batch, cp, tp), outermost first
    replica = {rank: rank // inner % dp for rank in range(ranks)}
    print(f"\n{name}: {ranks} ranks, {seconds:.0f}s, losses {[losses[s] for s in sorted(losses)]}")
    with open(f"{out}.log") as f:
        log = f.read()
    return Run(losses, ids, openers, replica, seconds, log)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Data:
    """The MDS dataset and the flags of every run, from the session's seed checkpoint (``titan_run.llama3_seed``)."""
    from titan_trainer_configs import write_dataset

    root = str(tmp_path_factory.mktemp("titan"))
    dataset = os.path.join(root, "mds")
    write_dataset(dataset, EPOCH_STEPS * BATCH * DP, SEQ)
    flags = [
        f"--dataloader.dataset_path={dataset}",
        f"--training.seq_len={SEQ}",
        f"--training.local_batch_size={BATCH}",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--training.mixed_precision_param=float32",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
    ]
    return Data(root, [*flags, titan_run.llama3_seed(tmp_path_factory)])


@pytest.fixture(scope="module")
def reference(data) -> Run:
    """pp=1 x dp_shard=2: the losses the other parallelisms must not change."""
    return train(data, "pp1-dp2", flags=("--checkpoint.load_only",))


@pytest.fixture(scope="module")
def pipelined(data) -> Run:
    """pp=2 x dp_shard=2 with llama3_debugmodel's Interleaved1F1B, 4 micro-batches per step;
    TorchTitan's checkpointer saves step 4."""
    return train(data, "pp2-dp2", pp=2, flags=("--checkpoint.interval=4",))


def global_batches(run: Run, per_step: int) -> list[list[int]]:
    """Per step, the sorted sample ids all replicas trained on (``per_step`` micro-batches each)."""
    firsts = [min(r for r, p in run.replica.items() if p == replica) for replica in set(run.replica.values())]
    steps = len(run.ids[0]) // per_step
    return [
        sorted(i for r in firsts for mb in run.ids[r][s * per_step : (s + 1) * per_step] for i in mb["input"])
        for s in range(steps)
    ]


def assert_trained_like(run: Run, reference: Run, per_step: int) -> None:
    """Same losses as ``reference`` on the same global batches, every rank of a replica fed alike, and
    each replica's dataset opened by one process only."""
    assert sorted(run.losses) == sorted(reference.losses) == list(range(1, len(reference.losses) + 1))
    gaps = {step: abs(run.losses[step] - reference.losses[step]) for step in reference.losses}
    assert max(gaps.values()) <= TOLERANCE, gaps
    assert global_batches(run, per_step) == global_batches(reference, 1)
    for rank, replica in run.replica.items():  # every stage and every cp/tp peer of a replica got the same
        assert run.ids[rank] == run.ids[min(r for r, p in run.replica.items() if p == replica)], rank
        assert all(mb["input"] == mb["labels"] for mb in run.ids[rank]), rank
    dp = len(set(run.replica.values()))
    assert len(run.openers) == len({pid for _, pid in run.openers}) == dp, run.openers
    assert {run.replica[rank] for rank, _ in run.openers} == set(range(dp)), run.openers


@pytest.mark.timeout(900)
def test_pipeline_parallel_trains_with_the_losses_of_pp1(reference, pipelined):
    assert sorted(pipelined.losses) == list(range(1, STEPS + 1))  # past the end of the data: a second epoch
    assert_trained_like(pipelined, reference, per_step=BATCH)  # 4 micro-batches of 1 per step
    assert pipelined.losses[STEPS] < pipelined.losses[1] - 2  # it learns: labels belong to their inputs
    steps = global_batches(pipelined, BATCH)
    assert sorted(i for step in steps[:EPOCH_STEPS] for i in step) == list(range(EPOCH_STEPS * BATCH * DP))
    assert steps[EPOCH_STEPS:] != steps[: STEPS - EPOCH_STEPS]  # the second epoch is another permutation


def test_the_loaders_decisions_appear_in_torchtitans_log(pipelined):
    """TorchTitan configures the root logger at INFO, so the loader's construction lines reach its log:
    rank 0 the whole mesh's, each replica's leader its own. torchrun prefixes each line with
    ``[default<local rank>]:`` (one node: the rank)."""
    lines = [
        line for line in pipelined.log.splitlines() if "collective_loader.loader - INFO - CollectiveLoader:" in line
    ]
    mesh = [line for line in lines if "CollectiveLoader: mesh [" in line]
    assert len(mesh) == 1 and mesh[0].startswith("[default0]:"), mesh
    assert "2 replicas" in mesh[0] and "transport=host" in mesh[0], mesh
    leaders = [int(re.match(r"\[default(\d+)\]:", line).group(1)) for line in lines if " leads replica " in line]
    assert sorted(pipelined.replica[rank] for rank in leaders) == [0, 1], lines


@pytest.mark.slow  # 45 s; the seed's set-up is reproduced in the default run by test_streaming and the demo
@pytest.mark.timeout(600)
def test_the_seeds_naive_setup_trains_on_other_samples_labels(data, reference, pipelined):
    naive = train(data, "naive-pp2-dp2", pp=2, config="naive", flags=("--checkpoint.load_only",))
    assert_naive_gap(naive, reference)
    print(
        loss_table({"pp=1 x dp_shard=2": reference, "pp=2 x dp_shard=2": pipelined, "naive pp=2 x dp_shard=2": naive})
    )


def assert_naive_gap(naive: Run, reference: Run) -> None:
    steps = len(reference.losses)
    pairs = list(zip(naive.ids[0], naive.ids[2]))  # replica 0: first stage (rank 0), last stage (rank 2)
    assert sum(a["input"] != b["labels"] for a, b in pairs) >= 0.9 * len(pairs)
    assert naive.losses[steps] - reference.losses[steps] > 1, (naive.losses, reference.losses)
    assert len(naive.openers) == len(naive.ids)  # every rank opens the dataset


# a third Trainer run (about 25 s); by default the loaders resume through DCP in
# test_titan_dataloader, test_titan_wrap and test_titan_dp_change
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_restart_from_torchtitans_checkpoint_continues_with_the_same_losses_and_samples(data, pipelined):
    resumed = train(
        data,
        "pp2-dp2-resumed",
        pp=2,
        dump=os.path.join(data.root, "pp2-dp2"),
        flags=("--checkpoint.load_step=4", "--checkpoint.load_only"),
    )
    assert sorted(resumed.losses) == list(range(5, STEPS + 1))
    assert all(abs(resumed.losses[s] - pipelined.losses[s]) <= TOLERANCE for s in resumed.losses), resumed.losses
    for rank, ids in resumed.ids.items():
        assert ids == pipelined.ids[rank][4 * BATCH :], rank  # 4 micro-batches per step
    assert len(resumed.openers) == DP


def loss_table(runs: dict[str, Run]) -> str:
    """A markdown table: one row per step, one column per run."""
    names = list(runs)
    steps = sorted(set().union(*(run.losses for run in runs.values())))
    rows = [f"| step | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    rows += [
        f"| {s} | " + " | ".join(f"{runs[n].losses[s]:.5f}" if s in runs[n].losses else "" for n in names) + " |"
        for s in steps
    ]
    return "\n" + "\n".join(rows)


SLOW = {  # name: (pp, dp, inner, flags); all against the pp=1 x dp_shard=2 reference
    "pp2-dp2-1F1B": (2, DP, 1, ("--parallelism.pipeline_parallel_schedule=1F1B",)),
    "pp2-dp2-GPipe": (2, DP, 1, ("--parallelism.pipeline_parallel_schedule=GPipe",)),
    "tp2-dp2": (1, DP, 2, ("--parallelism.tensor_parallel_degree=2",)),
    "pp2-dp_replicate2": (
        2,
        DP,
        1,
        ("--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=1"),
    ),
    "pp2-dp2-tp2": (2, DP, 2, ("--parallelism.tensor_parallel_degree=2",)),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SLOW)
def test_other_parallelisms_train_with_the_losses_of_pp1(data, reference, name):
    pp, dp, inner, flags = SLOW[name]
    run = train(data, name, pp=pp, dp=dp, inner=inner, flags=(*flags, "--checkpoint.load_only"), timeout=800)
    assert_trained_like(run, reference, per_step=BATCH if pp > 1 else 1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sixteen_steps(data):
    """The loss table of ``docs/torchtitan.md``: ``python -m pytest -m slow tests/integrations/test_titan_trainer.py -k sixteen -s``."""
    flags = ("--checkpoint.load_only",)
    runs = {
        "pp=1 x dp_shard=2": train(data, "16-pp1-dp2", steps=16, flags=flags),
        "pp=2 x dp_shard=2": train(data, "16-pp2-dp2", pp=2, steps=16, flags=flags),
        "naive pp=2 x dp_shard=2": train(data, "16-naive", pp=2, steps=16, config="naive", flags=flags),
    }
    reference, ours, naive = runs.values()
    assert_trained_like(ours, reference, per_step=BATCH)
    assert_naive_gap(naive, reference)
    print(loss_table(runs))
