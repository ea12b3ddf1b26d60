"""Megatron's indexed datasets (``.bin``/``.idx`` written here by megatron-core's
``IndexedDatasetBuilder``) read on the leaders only, through real megatron-core: on a 4-rank gloo
world (dp=2 x tp=2, pp=1) every rank trains, micro-batch for micro-batch, what Megatron's own data
path gives its data-parallel rank (``BlendedMegatronDatasetBuilder``'s GPTDataset in this process,
in Megatron-LM's pretraining-sampler order), while only the two leaders open the files (every
``open`` of a file under the data directory counted per rank with an audit hook); a resume from
the loader's state is exact, and on dp=1 x tp=4 (elastic) continues at the same sample."""

from __future__ import annotations

import functools
import os
import sys
import warnings

import numpy as np
import pytest
import ranks
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from collective_loader import mesh_place  # noqa: E402
from collective_loader.integrations.megatron import get_batch, megatron_loader  # noqa: E402
from collective_loader.integrations.megatron_data import MegatronSamples, gpt_dataset  # noqa: E402

VOCAB, SEQ, MICRO, DOCUMENTS, SEED = 100, 16, 2, 60, 1234
HEAD, TAIL = 3, 2  # micro-batches before the checkpoint, after it
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def config(prefix: str):
    """The GPTDatasetConfig of both paths; every option Megatron-LM's pretrain_gpt sets explicitly."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=([prefix], None),
        split="100,0,0",
        tokenizer=NullTokenizer(VOCAB - 1),  # token VOCAB - 1 is its end of document
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
        create_attention_mask=False,
    )


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    """DOCUMENTS documents of 3 to 40 tokens, each ending with the end-of-document token, written
    as preprocess_data.py writes them (uint16 for a small vocabulary)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("megatron") / "data" / "corpus_text_document")
    os.makedirs(os.path.dirname(prefix))
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():  # numpy 2 on the builder's numpy.array(tensor): a DeprecationWarning
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(DOCUMENTS):
            doc = np.append(rng.integers(0, VOCAB - 1, rng.integers(2, 40)), VOCAB - 1)
            builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


@functools.cache
def megatron_dataset(prefix: str):
    """Megatron's own GPTDataset of ``prefix``: its builder's train split, built in this process."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    return BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config(prefix)).build()[0]


def megatron_micro_batches(prefix: str, dp_rank: int, dp_size: int, consumed: int, count: int) -> list[dict]:
    """What Megatron's own path gives a data-parallel rank: its GPTDataset, sliced as Megatron-LM's
    MegatronPretrainingSampler slices each global micro-batch of micro * dp samples."""
    dataset = megatron_dataset(prefix)
    out = []
    for m in range(count):
        first = consumed + m * MICRO * dp_size + dp_rank * MICRO
        samples = [dataset[i] for i in range(first, first + MICRO)]
        out.append({k: torch.stack([s[k] for s in samples]) for k in FIELDS})
    return out


_opens: list[str] = []


def _count_opens(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str) and args[0].startswith(_watched[0]):
        _opens.append(args[0])


_watched = [""]


def run_rank(prefix: str) -> dict:
    """dp=2 x tp=2: HEAD micro-batches, the loader's state, TAIL more; a new loader resumed from
    that state; then a dp=1 x tp=4 loader resumed from it (elastic). Also the data files this
    process opened before the last (where every rank but 0 stays a receiver)."""
    if not _watched[0]:
        _watched[0] = os.path.dirname(prefix)
        sys.addaudithook(_count_opens)  # for the life of this rank's process: only this test's files count
    _opens.clear()

    def run(dims, shape, state=None, steps=HEAD + TAIL):
        mesh = ranks.make_mesh(dims, shape)
        place = mesh_place(mesh, dist.get_rank())

        def source():  # the leaders only
            return MegatronSamples(gpt_dataset(prefix, config(prefix)), MICRO, place.dp_rank, place.dp_size)

        loader = megatron_loader(source, mesh, timeout=60)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        got, saved = [], None
        for step in range(steps):
            got.append(get_batch(it))
            if step + 1 == HEAD:
                saved = loader.state_dict()
        loader.close()
        return place, got, saved

    place, full, saved = run(("dp", "tp"), (2, 2))
    _, resumed, _ = run(("dp", "tp"), (2, 2), state=saved, steps=TAIL)
    opened = sorted(set(_opens))
    # one replica: rank 0 alone leads, so no other rank imports megatron-core (5 s of CPU each)
    elastic_place, elastic, _ = run(("dp", "tp"), (1, 4), state=saved, steps=TAIL)
    return {
        "dp_rank": place.dp_rank,
        "leader": place.is_leader,
        "full": [{k: getattr(b, k) for k in FIELDS} for b in full],
        "resumed": [{k: getattr(b, k) for k in FIELDS} for b in resumed],
        "elastic_dp_rank": elastic_place.dp_rank,
        "elastic": [{k: getattr(b, k) for k in FIELDS} for b in elastic],
        "opens": opened,
    }


@pytest.mark.timeout(240)
def test_leaders_read_indexed_data_as_megatron_does_with_exact_and_elastic_resume(worlds, prefix):
    results = worlds.get(4).run(run_rank, prefix, timeout=200)
    files = {prefix + ".bin", prefix + ".idx"}
    for rank, r in enumerate(results):
        want = megatron_micro_batches(prefix, r["dp_rank"], 2, consumed=0, count=HEAD + TAIL)
        for step, (got, expected) in enumerate(zip(r["full"], want, strict=True)):
            for k in FIELDS:  # every rank, tp peers included: its replica's micro-batch, exactly
                assert torch.equal(got[k], expected[k]), (rank, step, k)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(r["resumed"], r["full"][HEAD:], strict=True) for k in FIELDS)
        consumed = HEAD * MICRO * 2  # the state's consumed_samples, at dp=1 the same
        want = megatron_micro_batches(prefix, r["elastic_dp_rank"], 1, consumed=consumed, count=TAIL)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(r["elastic"], want, strict=True) for k in FIELDS), rank
        # the leaders (one per replica) open the .bin and .idx, each loader once; the others nothing
        assert set(r["opens"]) == (files if r["leader"] else set()), (rank, r["opens"])
    assert sum(r["leader"] for r in results) == 2
