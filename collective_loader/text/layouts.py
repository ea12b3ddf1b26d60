"""Where a sample's tokens are: the MDS layouts LLM Foundry writes, read into token ids.

LLM Foundry (``llmfoundry/data/text_data.py``) writes one of:

* a ``tokens`` column of **bytes**: token ids written with ``ndarray.tobytes()``
  (``columns={"tokens": "bytes"}``), read back with ``np.frombuffer(..., dtype=token_encoding_type)``;
  the type is int8 ... uint64, **int64 when none is given**. Nothing in the shard says which type
  was written: pass it as :class:`TokenColumn`'s ``dtype``.
* a ``tokens`` column of **ndarray** (``columns={"tokens": "ndarray:uint16"}``): the array's own
  integer type says how to read it.
* a ``text`` column of **str**, tokenized where the data is loaded: :class:`TextColumn` with a
  tokenizer (:mod:`collective_loader.text.tokenizer`).

A sample's tokens are one document (packed with :mod:`collective_loader.text.packing`) or, without
packing, one row of ``seq_len + 1`` tokens (LLM Foundry's ``--concat_tokens`` windows). A sample
that does not fit its layout raises ``ValueError`` naming the column, what it holds, and what to pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol, runtime_checkable

import numpy as np

from collective_loader.text.tokenizer import TextEncoder
from collective_loader.types import Sample

INTEGER_TYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")  # LLM Foundry's


def _columns(sample: Sample) -> str:
    return ", ".join(sorted(k for k in sample if not k.startswith("_"))) or "none"


def _holds(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an ndarray of {value.dtype} with shape {value.shape}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{len(value)} bytes"
    return f"a {type(value).__name__}"


@dataclass(frozen=True)
class TokenColumn:
    """Token ids in ``column``: bytes of ``dtype`` (LLM Foundry's ``token_encoding_type``, int64 when
    ``None`` as there), or an integer ndarray (its own type; ``dtype`` is not used).

    >>> TokenColumn(dtype="uint16").read({"tokens": np.array([1, 2, 3], np.uint16).tobytes()})
    array([1, 2, 3])
    >>> TokenColumn().read({"tokens": np.array([7, 8], np.int32)})
    array([7, 8])
    """

    column: str = "tokens"
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and str(self.dtype) not in INTEGER_TYPES:
            raise ValueError(
                f"TokenColumn(dtype={self.dtype!r}): token ids are integers; pass one of {', '.join(INTEGER_TYPES)} "
                "(the token_encoding_type the bytes were written with)"
            )

    def read(self, sample: Sample) -> np.ndarray:
        """The sample's token ids, ``(tokens,)`` int64."""
        if self.column not in sample:
            raise ValueError(
                f"the samples have no column {self.column!r} (they hold: {_columns(sample)}); pass "
                "TokenColumn(column=...) naming the token column, or TextColumn(column=..., tokenizer=...) for text"
            )
        value = sample[self.column]
        if isinstance(value, (list, tuple)):  # ids in a plain list (not an MDS encoding, but a collate's input)
            value = np.asarray(value) if value else np.zeros(0, np.int64)
        if isinstance(value, (bytes, bytearray, memoryview)):
            dtype = np.dtype(self.dtype or "int64")
            if len(value) % dtype.itemsize:
                raise ValueError(
                    f"column {self.column!r} holds {len(value)} bytes, not a whole number of {dtype} token ids "
                    f"({dtype.itemsize} bytes each): pass TokenColumn(dtype=...) with the token_encoding_type it was "
                    f"written with (int64 is assumed when none is given, as LLM Foundry does)"
                )
            ids = np.frombuffer(value, dtype=dtype)
        elif isinstance(value, np.ndarray):
            if value.dtype.kind not in "iu" or value.ndim != 1:
                raise ValueError(
                    f"column {self.column!r} holds {_holds(value)}; token ids are a 1-D integer array "
                    "(write them as ndarray:<int type>, or as bytes and pass TokenColumn(dtype=...))"
                )
            ids = value
        elif isinstance(value, str):
            raise ValueError(
                f"column {self.column!r} holds text (a str); pass TextColumn(column={self.column!r}, tokenizer=...) "
                "to tokenize it where the data is loaded"
            )
        else:
            raise ValueError(
                f"column {self.column!r} holds {_holds(value)}; TokenColumn reads bytes (LLM Foundry's tokens column, "
                "with dtype=) or an integer ndarray"
            )
        if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and len(ids) and int(ids.max()) > np.iinfo(np.int64).max:
            raise ValueError(
                f"column {self.column!r} holds uint64 token ids beyond int64: were they written as {ids.dtype}?"
            )
        ids = ids.astype(np.int64)
        if len(ids) and int(ids.min()) < 0:
            raise ValueError(
                f"column {self.column!r} read as {ids.dtype if self.dtype is None else self.dtype} holds a negative token "
                f"id ({int(ids.min())}): pass TokenColumn(dtype=...) with the type the ids were written as"
            )
        return ids

    def documents(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Each sample's token ids, ``(tokens,)`` int64."""
        return [self.read(s) for s in samples]


@dataclass(frozen=True)
class TextColumn:
    """Text in ``column`` (str), tokenized with ``tokenizer``, with BOS / EOS added as configured.

    ``tokenizer``: a ``tokenizers.Tokenizer``, a ``transformers`` tokenizer, TorchTitan's
    ``BaseTokenizer`` (``encode(text, add_bos=, add_eos=)``), or the path of a ``tokenizer.json``
    (or of a directory holding one, with its ``tokenizer_config.json``); see
    :class:`~collective_loader.text.tokenizer.TextEncoder` for where the BOS / EOS ids come from and
    ``bos_token`` / ``eos_token`` for a tokenizer that does not name them. It is pickled to
    DataLoader workers, which tokenize.
    """

    tokenizer: Any
    column: str = "text"
    add_bos: bool = True
    add_eos: bool = True
    bos_token: str | None = None
    eos_token: str | None = None

    def encoder(self) -> TextEncoder:
        return TextEncoder(self.tokenizer, self.add_bos, self.add_eos, self.bos_token, self.eos_token)

    @cached_property
    def _encoder(self) -> TextEncoder:
        # this layout's own, made once: documents() called sample by sample does not build (and
        # resolve, e.g. read a tokenizer.json) a new one each call; a pickled copy resolves again
        return self.encoder()

    def documents(self, samples: Sequence[Sample], encoder: TextEncoder | None = None) -> list[np.ndarray]:
        """Each sample's text tokenized, ``(tokens,)`` int64, with ``encoder`` if given, else
        this layout's own (made at the first call)."""
        texts = []
        for sample in samples:
            if self.column not in sample:
                raise ValueError(
                    f"the samples have no column {self.column!r} (they hold: {_columns(sample)}); pass "
                    "TextColumn(column=...) naming the text column, or TokenColumn(column=...) for token ids"
                )
            value = sample[self.column]
            if not isinstance(value, str):
                raise ValueError(
                    f"column {self.column!r} holds {_holds(value)}, not text; for token ids pass "
                    f"TokenColumn(column={self.column!r}, dtype=...) (bytes: the token_encoding_type they were written with)"
                )
            texts.append(value)
        return [np.asarray(ids, dtype=np.int64) for ids in (encoder or self._encoder)(texts)]


ColumnLayout = TokenColumn | TextColumn


@runtime_checkable
class TokenLayout(Protocol):
    """What packing reads a sample's tokens through: :class:`TokenColumn` and :class:`TextColumn`
    are two, and any object with this method is one.

    >>> isinstance(TokenColumn(), TokenLayout), isinstance(TextColumn("unused"), TokenLayout)
    (True, True)
    """

    def documents(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """Each sample's token ids, ``(tokens,)`` int64; ``ValueError`` naming the column for a
        sample that does not fit the layout."""
        ...


SAMPLE_INDEX = "_sample_index"  # the key under which the leader's dataset gives each sample's index


@dataclass
class TokenizedBatch:
    """One sample-batch tokenized, as a DataLoader worker hands it to its leader: ``samples``
    ``(n,)`` int64, each sample's index in the dataset; ``tokens``, each one's ids ``(tokens,)`` int64."""

    samples: np.ndarray
    tokens: list[np.ndarray]


class DocumentCollate:
    """The DataLoader's ``collate_fn`` when packing: samples -> :class:`TokenizedBatch` (the tokenizing
    happens here, in the DataLoader's workers). Samples carry their index under :data:`SAMPLE_INDEX`.

    >>> DocumentCollate(TokenColumn())([{"tokens": np.array([3, 4]), SAMPLE_INDEX: 9}]).samples.tolist()
    [9]
    """

    def __init__(self, layout: ColumnLayout) -> None:
        self.layout = layout
        self._encoder = layout.encoder() if isinstance(layout, TextColumn) else None  # resolved once per process

    def __call__(self, samples: Sequence[Sample]) -> TokenizedBatch:
        if isinstance(self.layout, TextColumn):
            tokens = self.layout.documents(samples, self._encoder)
        else:
            tokens = self.layout.documents(samples)
        return TokenizedBatch(np.array([int(s[SAMPLE_INDEX]) for s in samples], dtype=np.int64), tokens)
