"""Megatron's indexed datasets (``.bin``/``.idx`` written here by megatron-core's
``IndexedDatasetBuilder``) read on the leaders only, through real megatron-core (0.16 on Python
3.11, 0.19 in .ci/megatron_lane).

In one process: ``gpt_dataset``'s train, validation and test splits equal, sample for sample,
what ``BlendedMegatronDatasetBuilder`` builds from the same config, for the splits ``969,30,1``,
``90,10,0`` and ``100,0,0`` (one prefix, two blended by their lengths, two by weights) and a
``blend_per_split``; a split the builder leaves out or gives no documents is refused, naming it.

On a 4-rank gloo world (default: dp=2 x tp=2, pp=1, one prefix, split ``969,30,1``) every rank
trains, micro-batch for micro-batch, what Megatron's own data path gives its data-parallel rank
(the builder's train split in this process, in Megatron-LM's pretraining-sampler order), its loss
masks hiding exactly the ends of documents (the tokenizer's ``eod``, which megatron-core 0.18
moved), while only the two leaders open the files (every ``open`` of a file under the data
directory counted per rank with an audit hook); a resume from the loader's state is exact, and on
another data-parallel size (elastic) continues at the same sample. The slow variant: a weighted
blend of two prefixes (split ``90,10,0``) on pp=2 x dp=2 (one leader on each end of the pipeline),
resumed elastically on dp=4 (after the default test, in its world: 8 s more, most of it ranks 1
and 3 importing megatron-core)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import warnings
from typing import NamedTuple

import numpy as np
import pytest
import ranks
import torch
import torch.distributed as dist

from collective_loader import mesh_place
from collective_loader.integrations.megatron import get_batch, megatron_loader
from collective_loader.integrations.megatron_data import MegatronSamples, gpt_dataset

# megatron-core is not imported here: the ranks import this module, and only leaders should import it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")

VOCAB, SEQ, MICRO, DOCUMENTS, SEED = 100, 16, 2, 600, 1234  # 600: '969,30,1' leaves test a document
HEAD, TAIL = 3, 2  # micro-batches before the checkpoint, after it
FIELDS = ("tokens", "labels", "loss_mask", "position_ids")
# the builder's sizes of train, valid and test (Megatron-LM: train_iters * global batch, ...); a blend
# by weights needs them (megatron-core's GPTDataset never ends building a size over no documents)
SIZES = (64, 16, 8)
SPLITS = ("train", "valid", "test")


class Data(NamedTuple):
    """What a rank reads: prefixes, their weights (None: a single prefix as it is, or a blend by
    their lengths), and Megatron's split string."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None
    split: str


def tokenizer():
    """megatron-core's NullTokenizer: in 0.16 ``NullTokenizer(99)`` has vocabulary 100 and end of
    document 99, from 0.18 on vocabulary 99 and end of document 98. Everything here reads ``.eod``."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer(VOCAB - 1)


def config(data: Data):
    """The GPTDatasetConfig of both paths, as Megatron-LM's pretrain_gpt builds it from --data-path
    and --split; every option it sets explicitly."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=(list(data.prefixes), None if data.weights is None else list(data.weights)),
        split=data.split,
        tokenizer=tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
        create_attention_mask=False,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """Two prefixes of DOCUMENTS documents of 3 to 40 tokens, each ending with the tokenizer's
    end of document and holding it nowhere else, written as preprocess_data.py writes them
    (uint16 for a small vocabulary)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    eod = tokenizer().eod
    directory = tmp_path_factory.mktemp("megatron") / "data"
    os.makedirs(directory)
    prefixes = []
    for seed, name in enumerate(("web_text_document", "code_text_document")):
        prefix = str(directory / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        rng = np.random.default_rng(seed)
        with warnings.catch_warnings():  # numpy 2 on the builder's numpy.array(tensor): a DeprecationWarning
            warnings.simplefilter("ignore", DeprecationWarning)
            for _ in range(DOCUMENTS):
                doc = np.append(rng.integers(0, eod, rng.integers(2, 40)), eod)
                builder.add_document(torch.from_numpy(doc), [len(doc)])
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    return prefixes[0], prefixes[1]


def leader_dataset(data: Data, split: str = "train"):
    """What a leader builds: collective_loader's one-rank build of Megatron's ``split``."""
    return gpt_dataset(config(data), SIZES[SPLITS.index(split)], split)


@functools.cache
def megatron_datasets(data: Data) -> list:
    """Megatron's own datasets of ``data``, train, valid and test (None where the split has
    none): its builder's, built in this process (torch.distributed not initialized)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    return BlendedMegatronDatasetBuilder(GPTDataset, list(SIZES), lambda: True, config(data)).build()


def megatron_dataset(data: Data):
    """Megatron's train dataset of ``data``."""
    return megatron_datasets(data)[0]


def masks_exactly_the_ends_of_documents(batch: dict, eod: int) -> int:
    """Assert that ``batch``'s loss mask is 0 exactly where its input token is an end of document
    (Megatron's eod_mask_loss; the corpus holds ``eod`` nowhere else); on a stage that has labels
    but no tokens, the input token of each position after the first is the label before it. The
    number of ends of documents checked."""
    if "loss_mask" not in batch:
        return 0
    mask = batch["loss_mask"]
    if "tokens" in batch:
        ends = batch["tokens"] == eod
    else:
        mask, ends = mask[:, 1:], batch["labels"][:, :-1] == eod
    assert torch.equal(mask, (~ends).to(mask.dtype)), (mask, ends)
    return int(ends.sum())


def megatron_micro_batches(data: Data, dp_rank: int, dp_size: int, consumed: int, count: int) -> list[dict]:
    """What Megatron's own path gives a data-parallel rank: its dataset, sliced as Megatron-LM's
    MegatronPretrainingSampler slices each global micro-batch of micro * dp samples."""
    dataset = megatron_dataset(data)
    out = []
    for m in range(count):
        first = consumed + m * MICRO * dp_size + dp_rank * MICRO
        samples = [dataset[i] for i in range(first, first + MICRO)]
        out.append({k: torch.stack([s[k] for s in samples]) for k in FIELDS})
    return out


_opens: list[str] = []
_watched = [""]


def _count_opens(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], str) and args[0].startswith(_watched[0]):
        _opens.append(args[0])


def run_rank(
    data: Data, mesh: tuple[tuple[str, ...], tuple[int, ...]], elastic: tuple[tuple[str, ...], tuple[int, ...]]
) -> dict:
    """On ``mesh``: HEAD micro-batches, the loader's state, TAIL more; a new loader resumed from
    that state; then one on ``elastic`` resumed from it. What this rank received of each (the
    fields its stage gets), and the data files this process opened before the elastic run."""
    if not _watched[0]:
        _watched[0] = os.path.dirname(data.prefixes[0])
        sys.addaudithook(_count_opens)  # for the life of this rank's process: only this test's files count
    _opens.clear()

    def run(dims, shape, state=None, steps=HEAD + TAIL):
        mesh = ranks.make_mesh(dims, shape)
        place = mesh_place(mesh, dist.get_rank())

        def source():  # the leaders only
            return MegatronSamples(leader_dataset(data), MICRO, place.dp_rank, place.dp_size)

        loader = megatron_loader(source, mesh, timeout=60)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        got, saved = [], None
        for step in range(steps):
            b = get_batch(it)
            got.append({k: getattr(b, k) for k in FIELDS if getattr(b, k) is not None})
            if step + 1 == HEAD:
                saved = loader.state_dict()
        loader.close()
        return place, got, saved

    place, full, saved = run(*mesh)
    _, resumed, _ = run(*mesh, state=saved, steps=TAIL)
    opened = sorted(set(_opens))
    elastic_place, elastic_got, _ = run(*elastic, state=saved, steps=TAIL)
    return {
        "place": place,
        "full": full,
        "resumed": resumed,
        "elastic_place": elastic_place,
        "elastic": elastic_got,
        "opens": opened,
    }


STAGE_FIELDS = {"both": set(FIELDS), "first": {"tokens", "position_ids"}, "last": {"labels", "loss_mask"}}


def check(data: Data, results: list[dict]) -> None:
    files = {prefix + suffix for prefix in data.prefixes for suffix in (".bin", ".idx")}
    eod, ends = tokenizer().eod, 0
    for rank, r in enumerate(results):
        place, elastic = r["place"], r["elastic_place"]
        want = megatron_micro_batches(data, place.dp_rank, place.dp_size, consumed=0, count=HEAD + TAIL)
        for step, (got, expected) in enumerate(zip(r["full"], want, strict=True)):
            assert set(got) == STAGE_FIELDS[place.stage], (rank, step, sorted(got))
            for k in got:  # every rank, tp peers included: its replica's micro-batch, exactly
                assert torch.equal(got[k], expected[k]), (rank, step, k)
            ends += masks_exactly_the_ends_of_documents(got, eod)
        for a, b in zip(r["resumed"], r["full"][HEAD:], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rank
        consumed = HEAD * MICRO * place.dp_size  # the state's consumed_samples, on any dp the same
        want = megatron_micro_batches(data, elastic.dp_rank, elastic.dp_size, consumed=consumed, count=TAIL)
        for a, b in zip(r["elastic"], want, strict=True):
            assert set(a) == STAGE_FIELDS[elastic.stage] and all(torch.equal(a[k], b[k]) for k in a), rank
        # the leaders (one per replica) open the .bin and .idx files; the others nothing
        assert set(r["opens"]) == (files if place.is_leader else set()), (rank, r["opens"])
    assert sum(r["place"].is_leader for r in results) == results[0]["place"].dp_size
    assert ends > 0, "no end of document reached a rank that has the loss mask: the mask check checked nothing"


@pytest.mark.timeout(240)
def test_leaders_read_indexed_data_as_megatron_does_with_exact_and_elastic_resume(worlds, corpus):
    """dp=2 x tp=2, one prefix; elastic on dp=1 x tp=4 (rank 0 alone leads: ranks 1 and 3 never
    import megatron-core, 5 s of CPU each)."""
    data = Data((corpus[0],), None, "969,30,1")  # Megatron-LM's default split
    check(data, worlds.get(4).run(run_rank, data, (("dp", "tp"), (2, 2)), (("dp", "tp"), (1, 4)), timeout=200))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_blend_on_both_pipeline_ends_as_megatron_blends_it(worlds, corpus):
    """pp=2 x dp=2 (replica 0's leader on the first stage, replica 1's on the last), a blend of two
    prefixes by weights 0.3 / 0.7 (megatron-core's BlendedDataset, each prefix's GPTDataset sized
    as its builder sizes them); elastic on dp=4, where every rank leads."""
    data = Data(corpus, (0.3, 0.7), "90,10,0")
    check(data, worlds.get(4).run(run_rank, data, (("pp", "dp"), (2, 2)), (("dp",), (4,)), timeout=260))


# --- each split, one process: collective_loader's build against the builder's -----------------

SAMPLES_READ = 64  # per dataset compared: its indices are compared whole, these samples read


def same_dataset(got, want, eod: int, where: str) -> int:
    """Assert that ``got`` is the builder's ``want``: the same class, documents and indices (a
    GPTDataset's document, sample and shuffle indices, a BlendedDataset's dataset and sample
    indices and each of its datasets), and, read through ``__getitem__``, the same samples (every
    one, or SAMPLES_READ spread over a long dataset), whose loss masks hide exactly the ends of
    documents. The number of ends of documents among them."""
    assert type(got) is type(want) and len(got) == len(want), (where, type(got), len(got), len(want))
    if hasattr(want, "datasets"):  # a BlendedDataset
        assert np.array_equal(got.dataset_index, want.dataset_index), where
        assert np.array_equal(got.dataset_sample_index, want.dataset_sample_index), where
        for i, (g, w) in enumerate(zip(got.datasets, want.datasets, strict=True)):
            same_dataset(g, w, eod, f"{where}, dataset {i}")
    else:
        assert got.dataset_path == want.dataset_path and np.array_equal(got.indices, want.indices), where
        for index in ("document_index", "sample_index", "shuffle_index"):
            assert np.array_equal(getattr(got, index), getattr(want, index)), (where, index)
    ends = 0
    for i in range(0, len(want), max(1, len(want) // SAMPLES_READ)):
        g, w = got[i], want[i]
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in FIELDS), (where, i)
        ends += masks_exactly_the_ends_of_documents(g, eod)
    return ends


BLENDS = {"one prefix": 1, "two by their lengths": 2, "two by weights 0.3 / 0.7": (0.3, 0.7)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split", ["969,30,1", "90,10,0", "100,0,0"])
@pytest.mark.parametrize("blend", BLENDS)
def test_each_split_is_the_builders_or_refused(corpus, blend, split):
    """train, valid and test of ``split`` are the builder's (its documents, indices and samples),
    and the loss masks hide exactly the ends of documents; a split the builder leaves out (None)
    or gives no documents is refused, naming it."""
    kind = BLENDS[blend]
    data = Data(corpus[:2] if kind != 1 else corpus[:1], kind if isinstance(kind, tuple) else None, split)
    eod, ends = tokenizer().eod, 0
    for name, want in zip(SPLITS, megatron_datasets(data), strict=True):
        if want is None or len(want) == 0:
            with pytest.raises(ValueError, match=f"gives the {name} split"):
                leader_dataset(data, name)
            continue
        ends += same_dataset(leader_dataset(data, name), want, eod, name)
    assert ends > 0


@pytest.mark.timeout(120)
def test_a_blend_per_split_is_the_builders(corpus):
    """Megatron-LM's --train-data-path / --valid-data-path: train from one prefix, validation from
    the other, each whole; no test blend, so test is refused."""
    import dataclasses

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    base = config(Data(corpus[:1], None, "969,30,1"))
    per_split = dataclasses.replace(
        base, blend=None, split=None, blend_per_split=[([corpus[0]], None), ([corpus[1]], None), None]
    )
    want = BlendedMegatronDatasetBuilder(GPTDataset, list(SIZES), lambda: True, per_split).build()
    for name, expected in zip(SPLITS[:2], want, strict=False):
        same_dataset(gpt_dataset(per_split, SIZES[SPLITS.index(name)], name), expected, tokenizer().eod, name)
    assert want[2] is None
    with pytest.raises(ValueError, match="blend_per_split has no blend for the test split"):
        gpt_dataset(per_split, SIZES[2], "test")


def test_a_config_without_a_blend_or_a_split_without_documents_is_refused_saying_what_to_give(corpus):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    mock = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=SEQ,
        tokenizer=tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
    )
    with pytest.raises(
        ValueError, match=r"neither blend nor blend_per_split .*GPTDatasetConfig\(blend=\(\[path_prefix\], None\)"
    ):
        gpt_dataset(mock)
    with pytest.raises(ValueError, match="split='validation': give one of 'train', 'valid', 'test'"):
        gpt_dataset(config(Data(corpus[:1], None, "969,30,1")), split="validation")
    with pytest.raises(ValueError, match=r"weights \[0.3, 0.7\] needs num_samples"):
        gpt_dataset(config(Data(corpus, (0.3, 0.7), "969,30,1")))
    with pytest.raises(ValueError, match=r"split '9999,1,0' gives the valid split documents \[600, 600\) of the 600"):
        gpt_dataset(config(Data(corpus[:1], None, "9999,1,0")), 16, "valid")
