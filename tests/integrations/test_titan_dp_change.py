"""Resuming a TorchTitan job on another data-parallel degree, through TorchTitan's own checkpointer.

``TitanStreamingDataLoader``'s state is the same on every rank, so it is saved as one entry,
``dp_rank_0``, which any rank of another mesh reads; a restart on another DP degree resumes when
it keeps the global batch, and is refused on every rank, naming the flag to set, when it does not.
TorchTitan's own loaders (wrapped by ``load_once_per_replica``) keep a per-DP-rank iterator state:
another degree is refused, saying why and what works.

Default: the state form, the resume and the refusal on a 2-rank world through DCP, and the
messages. ``-m slow``: TorchTitan's real Trainer trains pp=2 x dp_shard=2 to a checkpoint, then
resumes from it on dp_shard=1 to the end of the data: every token of the dataset is trained
exactly once over the two runs (counted from what the ranks received), on fixed rows of token ids
(resumed at pp=2 x dp_shard=1) and on packed text (resumed at pp=1 x dp_shard=1); and fixed rows
from pp=1 x dp_shard=2 to pp=1 x dp_shard=4.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass

import pytest
import titan_run
import titan_text

from collective_loader.integrations.titan_streaming import GlobalBatch, TitanStreamingDataLoader, batch_flag
from collective_loader.integrations.titan_wrap import check_degree, with_mesh

SEQ = 8  # tokens per sample in the loader-level test
SAMPLES, HEAD = 24, 2  # the dataset; steps taken at dp=2 (2 samples per replica) before the checkpoint


# --- the messages ----------------------------------------------------------------------------


class Mesh:
    """What ``batch_flag`` reads of a DeviceMesh."""

    def __init__(self, pp: int) -> None:
        self.mesh_dim_names = ("pp", "batch", "cp", "tp")
        self.sizes = (pp, 2, 1, 1)

    def size(self, dim: int) -> int:
        return self.sizes[dim]


@pytest.mark.parametrize(
    "packing, pp, flag",
    [
        (None, 1, "--training.local_batch_size"),
        (None, 2, "--parallelism.pipeline_parallel_microbatch_size"),
        (object(), 2, "--dataloader.documents_per_batch"),
    ],
)
def test_a_changed_global_batch_is_refused_naming_the_flag_and_its_value(packing, pp, flag):
    assert batch_flag(packing, Mesh(pp)) == flag
    GlobalBatch(2, 4, flag).check(8, 2)  # 4 x 2 saved, 2 x 4 now: the same global batch resumes
    with pytest.raises(ValueError, match=f"global batch of 8 samples \\(4 x 2 .* is 4 \\(4 x 1\\).*: set {flag} 8$"):
        GlobalBatch(4, 1, flag).check(8, 2)
    with pytest.raises(
        ValueError, match="which 3 replicas cannot split: .*--checkpoint.exclude_from_loading dataloader"
    ):
        GlobalBatch(3, 3, flag).check(8, 2)


def test_torchtitans_own_loaders_refuse_another_degree_saying_why_and_what_works():
    check_degree("HuggingFaceTextDataLoader", 2, 2)
    check_degree("MyLoader", None, 4)  # a state without world_size: the loader's own business
    with pytest.raises(ValueError) as refused:
        check_degree("HuggingFaceTextDataLoader", 2, 4)
    text = str(refused.value)
    assert "saved with 2 data-parallel ranks and this run has 4" in text
    assert "per-rank iterator state" in text and "resume on 2 data-parallel ranks" in text
    assert "--checkpoint.exclude_from_loading dataloader" in text and "TitanStreamingDataLoader" in text


# --- the loader on a 2-rank world, through DCP -----------------------------------------------


def ids(dataloader: TitanStreamingDataLoader, steps: int | None = None) -> list[list[int]]:
    """Sample ids per micro-batch (a sample's tokens count up from its id)."""
    out = []
    for input_dict, labels in dataloader:
        assert (labels[:, 0] - 1).tolist() == input_dict["input"][:, 0].tolist()
        out.append(input_dict["input"][:, 0].tolist())
        if len(out) == steps:
            break
    return out


def rank_changes_degree(root: str) -> dict:
    """Save after HEAD steps at pp=1 x dp=2 (2 samples per replica), then on pp=2 x dp=1 resume
    with 4 samples (the same global batch) and refuse 2."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from collective_loader import mesh_place

    def build(shape: tuple[int, ...], batch: int) -> TitanStreamingDataLoader:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "batch", "cp", "tp"))
        place = mesh_place(mesh, dist.get_rank())
        config = with_mesh(
            TitanStreamingDataLoader.Config(dataset_path=f"{root}/mds", infinite=False, timeout=60), mesh
        )
        return config.build(
            dp_world_size=place.dp_size, dp_rank=place.dp_rank, tokenizer=None, seq_len=SEQ, local_batch_size=batch
        )

    checkpoint = f"{root}/checkpoint"
    first = build((1, 2, 1, 1), 2)
    head = ids(first, HEAD)
    state = first.state_dict()
    dcp.save({"dataloader": first}, checkpoint_id=checkpoint)  # as TorchTitan's checkpointer does
    first.close()
    resumed = build((2, 1, 1, 1), 4)
    dcp.load({"dataloader": resumed}, checkpoint_id=checkpoint)
    tail = ids(resumed)
    resumed.close()
    refused = build((2, 1, 1, 1), 2)
    try:
        dcp.load({"dataloader": refused}, checkpoint_id=checkpoint)
        message = ""
    except ValueError as e:
        message = str(e)
    refused.close()
    saved = sorted(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
    return {"head": head, "tail": tail, "keys": sorted(state), "saved": saved, "refused": message}


@pytest.fixture(scope="module")
def token_rows(tmp_path_factory) -> str:
    from titan_trainer_configs import write_dataset

    root = str(tmp_path_factory.mktemp("titan_dp_change"))
    write_dataset(f"{root}/mds", SAMPLES, SEQ)
    return root


@pytest.mark.timeout(300)
def test_a_streaming_state_is_one_entry_that_another_dp_degree_resumes(worlds, token_rows):
    records = worlds.get(2).run(rank_changes_degree, token_rows, timeout=240)
    for rec in records:
        assert rec["keys"] == ["dp_rank_0", "world_size"]  # the same entry on every rank
        assert rec["saved"] == ["dataloader.dp_rank_0", "dataloader.world_size"]  # written once
        assert rec["refused"].endswith(
            "global batch of 4 samples (2 x 2 data-parallel replicas) and this run's is 2 (2 x 1): streaming resumes "
            "exactly only with the same global batch: set --parallelism.pipeline_parallel_microbatch_size 4"
        ), rec["refused"]
    heads = [i for rec in records for batch in rec["head"] for i in batch]  # each replica its own samples
    tail = [i for batch in records[0]["tail"] for i in batch]
    assert records[1]["tail"] == records[0]["tail"]  # both stages of the one replica
    assert all(len(batch) == 4 for batch in records[0]["tail"])
    assert sorted(heads + tail) == list(range(SAMPLES))  # every sample once over the two degrees


# --- TorchTitan's Trainer ------------------------------------------------------------------------


@dataclass
class Data:
    root: str
    flags: list[str]
    env: dict[str, str]


def received(out: str, ranks: int) -> dict[int, list[dict]]:
    """Rank -> what it received, one record per micro-batch."""
    batches = {}
    for rank in range(ranks):
        with open(f"{out}.rank{rank}.jsonl") as f:
            batches[rank] = [json.loads(line) for line in f]
    return batches


def trainer_run(module: str, data: Data, name: str, ranks: int, flags: list[str], dump: str | None = None) -> str:
    """One Trainer run from the seed checkpoint, recording what each rank received (``titan_trainer_configs``:
    its ``ours`` config, ``titan_text_configs``: its ``mds``); returns its output prefix."""
    out = os.path.join(data.root, name)
    env = {**data.env, "CL_BATCHES": out, "CL_TOUCH_LOG": f"{out}.touches"}
    config, record = ("ours", [f"--dataloader.record={out}"]) if module == "titan_trainer_configs" else ("mds", [])
    all_flags = [*data.flags, f"--dump_folder={dump or out}", *record, *flags]
    seconds = titan_run.torchrun(ranks, module, config, all_flags, out, 600, env)
    print(f"\n{name}: {ranks} ranks, {seconds:.0f}s")
    return out


ROWS_SEQ, ROWS_BATCH, ROWS_STEPS = 64, 4, 6  # the dataset holds 6 global batches of pp=2 x dp_shard=2
SAVED = 3  # the first run stops after step 3, its checkpoint


@pytest.fixture(scope="module")
def rows_data(tmp_path_factory) -> Data:
    from titan_trainer_configs import write_dataset

    root = str(tmp_path_factory.mktemp("titan_dp_change_rows"))
    write_dataset(f"{root}/mds", ROWS_STEPS * ROWS_BATCH * 2, ROWS_SEQ)
    flags = [
        f"--dataloader.dataset_path={root}/mds",
        f"--training.seq_len={ROWS_SEQ}",
        "--training.mixed_precision_param=float32",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
    ]
    return Data(root, [*flags, titan_run.llama3_seed(tmp_path_factory)], {})


def saving_run(module: str, data: Data, name: str, flags: list[str]) -> str:
    """pp=2 x dp_shard=2 for SAVED steps; TorchTitan's checkpointer saves the last one whole."""
    return trainer_run(
        module,
        data,
        name,
        4,
        [
            *flags,
            "--parallelism.pipeline_parallel_degree=2",
            f"--training.steps={SAVED}",
            f"--checkpoint.interval={SAVED}",
            "--checkpoint.no-last_save_model_only",  # the dataloader's state too
        ],
    )


@pytest.mark.slow  # three Trainer runs (1, 4 and 2 ranks), about three minutes
@pytest.mark.timeout(1200)
def test_fixed_rows_resume_on_fewer_replicas_training_every_sample_once(rows_data):
    """pp=2 x dp_shard=2 (micro-batches of 1, 4 per step: a global batch of 2 samples per
    micro-batch) saves step 3; pp=2 x dp_shard=1 resumes with micro-batches of 2 (the same global
    batch) and 4 per step, and trains to the end of the data at step 6."""
    before = saving_run(
        "titan_trainer_configs",
        rows_data,
        "pp2-dp2",
        [f"--training.local_batch_size={ROWS_BATCH}", "--parallelism.pipeline_parallel_microbatch_size=1"],
    )
    after = trainer_run(
        "titan_trainer_configs",
        rows_data,
        "pp2-dp1-resumed",
        2,
        [
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.data_parallel_shard_degree=1",
            f"--training.local_batch_size={2 * ROWS_BATCH}",
            "--parallelism.pipeline_parallel_microbatch_size=2",
            f"--training.steps={ROWS_STEPS}",
            f"--checkpoint.load_step={SAVED}",
            "--checkpoint.load_only",
        ],
        dump=before,
    )
    first, second = received(before, 4), received(after, 2)
    for batches in (first, second):  # every rank of a replica received the same; labels belong to inputs
        for rank, got in batches.items():
            assert got == batches[rank % (len(batches) // 2)], rank
            assert all(mb["input"] == mb["labels"] for mb in got), rank
    trained = [i for replica in (0, 1) for mb in first[replica] for i in mb["input"]]
    assert len(trained) == SAVED * ROWS_BATCH * 2
    trained += [i for mb in second[0] for i in mb["input"]]
    assert sorted(trained) == list(range(ROWS_STEPS * ROWS_BATCH * 2))  # every sample (its tokens) once
    assert sorted(titan_run.losses(after, 1)) == list(range(SAVED + 1, ROWS_STEPS + 1))


@pytest.mark.slow  # three Trainer runs (1, 2 and 4 ranks), about three minutes
@pytest.mark.timeout(1200)
def test_fixed_rows_resume_on_more_replicas_training_every_sample_once(rows_data):
    """pp=1 x dp_shard=2 (local batches of 4) saves step 3; pp=1 x dp_shard=4 resumes with local
    batches of 2 (the same global batch of 8) and trains to the end of the data at step 6."""
    before = trainer_run(
        "titan_trainer_configs",
        rows_data,
        "pp1-dp2",
        2,
        [
            f"--training.local_batch_size={ROWS_BATCH}",
            f"--training.steps={SAVED}",
            f"--checkpoint.interval={SAVED}",
            "--checkpoint.no-last_save_model_only",
        ],
    )
    after = trainer_run(
        "titan_trainer_configs",
        rows_data,
        "pp1-dp4-resumed",
        4,
        [
            f"--training.local_batch_size={ROWS_BATCH // 2}",
            f"--training.steps={ROWS_STEPS}",
            f"--checkpoint.load_step={SAVED}",
            "--checkpoint.load_only",
        ],
        dump=before,
    )
    first, second = received(before, 2), received(after, 4)  # every rank is a replica of its own
    for batches in (first, second):
        assert all(mb["input"] == mb["labels"] for got in batches.values() for mb in got)
    trained = [i for got in first.values() for mb in got for i in mb["input"]]
    assert len(trained) == SAVED * ROWS_BATCH * 2
    trained += [i for got in second.values() for mb in got for i in mb["input"]]
    assert sorted(trained) == list(range(ROWS_STEPS * ROWS_BATCH * 2))  # every sample (its tokens) once
    assert sorted(titan_run.losses(after, 0)) == list(range(SAVED + 1, ROWS_STEPS + 1))


TEXT_SEQ, TEXT_BATCH = 64, 4


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Data:
    from test_titan_trainer_text import write_text

    root = str(tmp_path_factory.mktemp("titan_dp_change_text"))
    texts = titan_text.documents(120, seed=3)
    titan_text.write_tokenizer(f"{root}/tokenizer", texts, vocab_size=1024)
    write_text(f"{root}/data/text", texts)
    env = {"CL_DATA": f"{root}/data", "CL_WATCH_DIR": f"{root}/data"}
    flags = [
        f"--hf_assets_path={root}/tokenizer",
        f"--dataloader.dataset_path={root}/data/text",
        "--dataloader.text",
        f"--training.seq_len={TEXT_SEQ}",
        "--training.mixed_precision_param=float32",
        "--metrics.disable_color_printing",
        "--checkpoint.enable",
    ]
    return Data(root, [*flags, titan_run.llama3_seed(tmp_path_factory)], env)


def row_tokens(batches: list[dict]) -> list[int]:
    """The tokens of each packed row: its first input and every label that is not padding (-100);
    a row of padding only (input 0, every label -100) holds none. The data end with an EOS, so a
    row whose one real token is its first is never taken for padding."""
    out = []
    for batch in batches:
        for inputs, labels in zip(batch["input"], batch["labels"]):
            real = [label for label in labels if label != -100]
            if real or inputs[0] != 0:
                out += [inputs[0], *real]
    return out


def document_tokens(root: str) -> list[int]:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=f"{root}/tokenizer")
    return [t for text in titan_text.documents(120, seed=3) for t in tokenizer.encode(text, add_bos=True, add_eos=True)]


@pytest.mark.slow  # three Trainer runs (1, 4 and 1 ranks), about three minutes
@pytest.mark.timeout(1200)
def test_packed_text_resumes_on_one_replica_training_every_token_once(text_data):
    """pp=2 x dp_shard=2 (4 documents per leader's sample-batch: 8 per global batch) saves step 3;
    pp=1 x dp_shard=1 resumes with --dataloader.documents_per_batch 8 and trains, one micro-batch
    per step, to the end of the data (not infinite): each token of the documents exactly once."""
    before = saving_run(
        "titan_text_configs",
        text_data,
        "pp2-dp2",
        [
            f"--training.local_batch_size={TEXT_BATCH}",
            "--parallelism.pipeline_parallel_microbatch_size=1",
            f"--dataloader.documents_per_batch={TEXT_BATCH}",
        ],
    )
    after = trainer_run(
        "titan_text_configs",
        text_data,
        "pp1-dp1-resumed",
        1,
        [
            "--parallelism.data_parallel_shard_degree=1",
            f"--training.local_batch_size={TEXT_BATCH}",
            f"--dataloader.documents_per_batch={2 * TEXT_BATCH}",
            "--dataloader.no-infinite",
            "--training.steps=10000",
            f"--checkpoint.load_step={SAVED}",
            "--checkpoint.load_only",
        ],
        dump=before,
    )
    first, second = received(before, 4), received(after, 1)
    for rank, got in first.items():
        assert got == first[rank % 2], rank
    trained = row_tokens(first[0]) + row_tokens(first[1])
    resumed = row_tokens(second[0])
    assert len(first[0]) == SAVED * TEXT_BATCH and resumed
    assert Counter(trained + resumed) == Counter(document_tokens(text_data.root))
    assert max(titan_run.losses(after, 0)) == SAVED + len(second[0])
