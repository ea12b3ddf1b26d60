"""Batch <-> fixed-size header + one packed byte buffer. No pickle: nothing received is evaluated.

A message on the wire is one uint8 buffer (:func:`write_message`):

* the **header**, ``HEADER_WORDS`` int64 words (``HEADER_BYTES``): magic, version, kind, step,
  payload size, meta size (see :class:`Header`);
* the **payload**: a JSON *meta* document describing the batch's tree (keys, dtypes, shapes,
  byte offsets, plain values), padded to ``ALIGN`` bytes, then every tensor's bytes at an
  ``ALIGN``-aligned offset.

The decoder checks every field against the buffer it was given before it creates a view, so
corrupt or hostile input raises :class:`~collective_loader.errors.WireError` and never allocates
more than the payload size the header announced (itself capped by the caller).

Example::

    >>> import torch
    >>> buf, meta_nbytes = pack({"ids": torch.arange(4), "meta": {"name": "a", "n": [1, 2]}})
    >>> unpack(buf, meta_nbytes)
    {'ids': tensor([0, 1, 2, 3]), 'meta': {'name': 'a', 'n': [1, 2]}}
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from collective_loader.errors import BatchError, WireError

MAGIC = 0x434C4C44  # "CLLD"
VERSION = 2
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
ALIGN = 64
MAX_DEPTH = 16
MAX_DIMS = 16
MAX_META_BYTES = 1 << 20
MAX_DIM_SIZE = 1 << 48

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.uint16, torch.uint32, torch.uint64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    )
}
_NAMES = {d: n for n, d in _DTYPES.items()}
_ITEMSIZE = {d: torch.empty(0, dtype=d).element_size() for d in _DTYPES.values()}


class Kind(enum.IntEnum):
    """What a step's header announces."""

    DATA = 1
    END = 2
    SOURCE_ERROR = 3  # payload: {"message": str}; receivers raise LeaderError
    BATCH_ERROR = 4  # payload: {"message": str}; receivers raise BatchError
    DELIVERY_ERROR = 5  # payload: {"message": str}; a leader could not deliver: DeliveryError
    PHASE_ERROR = 6  # agreements only, never sent to a delivery group: a construction phase failed on some rank

    @property
    def is_error(self) -> bool:
        return self not in (Kind.DATA, Kind.END)


@dataclass(frozen=True)
class Header:
    kind: Kind
    step: int
    payload_nbytes: int
    meta_nbytes: int

    def encode(self) -> torch.Tensor:
        """The header as an int64 tensor of ``HEADER_WORDS`` words."""
        words = [MAGIC, VERSION, int(self.kind), self.step, self.payload_nbytes, self.meta_nbytes]
        return torch.tensor(words + [0] * (HEADER_WORDS - len(words)), dtype=torch.int64)

    @classmethod
    def decode(cls, words: torch.Tensor, max_payload_bytes: int) -> Header:
        """Check and decode a received header; raise :class:`WireError` if anything is off."""
        if words.dtype != torch.int64 or words.dim() != 1 or words.numel() != HEADER_WORDS:
            raise WireError(f"header must be {HEADER_WORDS} int64 words, got {words.numel()} {words.dtype}")
        magic, version, kind, step, payload, meta = (int(w) for w in words.tolist()[:6])
        if magic != MAGIC or version != VERSION:
            raise WireError(f"bad header magic/version {magic:#x}/{version}: not a collective_loader peer")
        if kind not in {k.value for k in Kind}:
            raise WireError(f"unknown header kind {kind}")
        if step < 0:
            raise WireError(f"negative step {step} in header")
        if not 0 <= payload <= max_payload_bytes:
            raise WireError(f"header announces {payload} payload bytes; the cap is {max_payload_bytes}")
        if not 0 <= meta <= min(payload, MAX_META_BYTES):
            raise WireError(f"header announces {meta} meta bytes for a payload of {payload}")
        return cls(Kind(kind), step, payload, meta)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def data_start(meta_nbytes: int) -> int:
    """Where a payload's tensor bytes start: after its description of ``meta_nbytes``, aligned."""
    return _align(meta_nbytes)


# --- encoding ---------------------------------------------------------------------------------


@dataclass
class Plan:
    """Where everything of one batch goes in the payload; :func:`write` fills a buffer from it."""

    meta: bytes
    tensors: list[tuple[int, torch.Tensor]]  # (byte offset, tensor as given)
    nbytes: int


def _check_value(value: Any, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise BatchError(f"value at {path!r} is nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_value(item, f"{path}[{i}]", depth + 1)
        return
    raise BatchError(
        f"cannot deliver {type(value).__module__}.{type(value).__qualname__} at {path!r}: a batch holds "
        "tensors, mappings, and ints, floats, strings, bools, None and lists of them"
    )


def plan(batch: Mapping[str, Any]) -> Plan:
    """Lay out ``batch`` (a mapping, nested mappings allowed) in one payload.

    Tuples are delivered as lists. Raises :class:`BatchError` naming the key of anything that
    cannot be delivered.
    """
    tensors: list[tuple[int, torch.Tensor]] = []
    offsets = [0]  # running data size, relative to the data start

    def node(value: Any, path: str, depth: int) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_nested or value.layout != torch.strided:
                kind = "nested" if value.is_nested else str(value.layout)
                raise BatchError(f"tensor at {path!r} is {kind}; only dense tensors are delivered")
            if value.device.type == "meta":
                raise BatchError(f"tensor at {path!r} is on the meta device and has no data to deliver")
            name = _NAMES.get(value.dtype)
            if name is None:
                raise BatchError(f"tensor at {path!r} has dtype {value.dtype}, which is not delivered")
            offset = offsets[0]
            tensors.append((offset, value))
            offsets[0] = _align(offset + value.numel() * value.element_size())
            return {"T": name, "s": list(value.shape), "o": offset}
        if isinstance(value, Mapping):
            if depth >= MAX_DEPTH:
                raise BatchError(f"mapping at {path!r} is nested deeper than {MAX_DEPTH}")
            items = []
            for key, item in value.items():
                if not isinstance(key, str):
                    raise BatchError(f"mapping keys must be str, got {key!r} at {path!r}")
                items.append([key, node(item, f"{path}.{key}" if path else key, depth + 1)])  # noqa: F821 (deleted after use, below)
            return {"M": items}
        _check_value(value, path, depth)
        return {"V": value}

    if not isinstance(batch, Mapping):
        raise BatchError(f"a batch must be a mapping of str to tensors, got {type(batch).__qualname__}")
    try:
        tree = node(batch, "", 0)
    finally:
        del node  # the recursive closure is a reference cycle that would hold the batch until gc
    try:
        meta = json.dumps(tree, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:  # e.g. a circular list
        raise BatchError(f"batch cannot be encoded: {e}") from None
    if len(meta) > MAX_META_BYTES:
        raise BatchError(f"batch description is {len(meta)} bytes; the limit is {MAX_META_BYTES}")
    start = _align(len(meta))
    return Plan(meta, [(start + o, t) for o, t in tensors], start + offsets[0])


def write(plan_: Plan, out: torch.Tensor) -> None:
    """Fill ``out`` (uint8, ``plan_.nbytes`` long, any device) with the planned payload."""
    meta = torch.frombuffer(bytearray(plan_.meta), dtype=torch.uint8) if plan_.meta else torch.empty(0, dtype=torch.uint8)
    out[: len(plan_.meta)].copy_(meta, non_blocking=True)
    for offset, tensor in plan_.tensors:
        # copy into a typed view of the destination: any strides, conj/neg views and devices work
        nbytes = tensor.numel() * tensor.element_size()
        out[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach(), non_blocking=True)


NOTHING = Plan(b"", [], 0)  # the payload of a message that is its header alone


def write_message(kind: Kind, step: int, plan_: Plan, out: torch.Tensor) -> int:
    """Fill ``out`` (uint8, CPU) with one message, the header then the payload; return its size.

    Example::

        >>> out = torch.empty(256, dtype=torch.uint8)
        >>> n = write_message(Kind.DATA, 3, plan({"x": torch.ones(2)}), out)
        >>> header = Header.decode(out[:HEADER_BYTES].view(torch.int64), 1 << 20)
        >>> header.step, n == HEADER_BYTES + header.payload_nbytes
        (3, True)
        >>> unpack(out[HEADER_BYTES:n], header.meta_nbytes)
        {'x': tensor([1., 1.])}
    """
    out[:HEADER_BYTES].view(torch.int64).copy_(Header(kind, step, plan_.nbytes, len(plan_.meta)).encode())
    write(plan_, out[HEADER_BYTES : HEADER_BYTES + plan_.nbytes])
    return HEADER_BYTES + plan_.nbytes


def pack(batch: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """``(payload, meta_nbytes)`` for ``batch`` on the CPU."""
    p = plan(batch)
    out = torch.zeros(p.nbytes, dtype=torch.uint8)
    write(p, out)
    return out, len(p.meta)


# --- decoding ---------------------------------------------------------------------------------


def unpack(payload: torch.Tensor, meta_nbytes: int, meta: torch.Tensor | None = None) -> dict[str, Any]:
    """Decode a payload; tensors are views into ``payload``. Raises :class:`WireError`.

    ``meta``: the description (uint8, host), when it travelled apart from the tensor bytes
    (the device transport); ``payload``'s first ``meta_nbytes`` bytes are then not read, so a
    GPU payload is decoded without a copy to the host.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise WireError(f"payload must be a contiguous 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}")
    if payload.storage_offset() % ALIGN:
        raise WireError(f"payload starts at byte {payload.storage_offset()} of its storage, not on a {ALIGN}-byte boundary")
    size = payload.numel()
    if not 0 <= meta_nbytes <= min(size, MAX_META_BYTES):
        raise WireError(f"meta size {meta_nbytes} does not fit a payload of {size} bytes")
    if meta is not None and meta.numel() < meta_nbytes:
        raise WireError(f"description of {meta.numel()} bytes is shorter than the {meta_nbytes} announced")
    try:
        described = payload[:meta_nbytes] if meta is None else meta[:meta_nbytes]
        tree = json.loads(bytes(described.cpu().numpy()).decode())
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise WireError(f"batch description does not decode: {e}") from None
    data_start = _align(meta_nbytes)

    def value(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"value nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [value(x, depth + 1) for x in v]
        raise WireError(f"unexpected value of type {type(v).__name__} in batch description")

    def node(n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"batch nested deeper than {MAX_DEPTH}")
        if not isinstance(n, dict) or len(n) != (3 if "T" in n else 1):
            raise WireError(f"malformed node in batch description: {str(n)[:80]}")
        if "M" in n:
            items = n["M"]
            if not isinstance(items, list):
                raise WireError("malformed mapping in batch description")
            out = {}
            for item in items:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise WireError(f"malformed mapping item in batch description: {str(item)[:80]}")
                out[item[0]] = node(item[1], depth + 1)  # noqa: F821 (deleted after use, below)
            return out
        if "V" in n:
            return value(n["V"], depth)
        if "T" in n:
            return tensor(n.get("T"), n.get("s"), n.get("o"))
        raise WireError(f"malformed node in batch description: {str(n)[:80]}")

    def tensor(name: Any, shape: Any, offset: Any) -> torch.Tensor:
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise WireError(f"unknown dtype {str(name)[:40]!r} in batch description")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_DIM_SIZE for s in shape)
        ):
            raise WireError(f"bad shape {str(shape)[:80]} in batch description")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset % ALIGN:
            raise WireError(f"bad tensor offset {str(offset)[:40]} in batch description")
        offset += data_start
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if offset + nbytes > size:
            raise WireError(f"tensor of shape {shape} at offset {offset} overruns the {size}-byte payload")
        try:
            return payload[offset : offset + nbytes].view(dtype).view(shape)
        except (RuntimeError, TypeError) as e:  # e.g. a storage offset torch cannot view as dtype
            raise WireError(f"tensor of shape {shape} at offset {offset} cannot be viewed: {e}") from None

    try:
        result = node(tree, 0)
    finally:
        del node  # the recursive closure is a reference cycle that would hold the payload until gc
    if not isinstance(result, dict):
        raise WireError("batch description is not a mapping")
    return result
