"""Batch <-> fixed-size header + one packed byte buffer. No pickle: nothing received is evaluated.

A message on the wire is one uint8 buffer:

* the **header**, ``HEADER_WORDS`` int64 words (``HEADER_BYTES``): magic, version, kind, step,
  payload size, meta size, apart size (see :class:`Header`);
* the **payload**: a JSON *meta* document describing the batch's tree (keys, dtypes, shapes,
  byte offsets, plain values), padded to ``ALIGN`` bytes, then every tensor's bytes at an
  ``ALIGN``-aligned offset.

A payload's last ``apart_nbytes`` bytes may be left out of the buffer: the tensors that lie there
(large, contiguous host tensors; see :func:`encode`) then travel each in a collective of its
own, straight from the sender's tensor, and the receiver receives them into their places in its
payload (:meth:`PayloadLayout.apart`). The buffer then holds the header, the description and the
small tensors, and the sender copies none of the large ones.

One way each way: :func:`encode` lays a batch out (:class:`Encoded`) and :meth:`Encoded.write`
puts it in a message buffer; :func:`decode` checks a received payload's description
(:class:`PayloadLayout`) and :meth:`PayloadLayout.batch` gives the batch as views of the payload.
Nothing is cached from one message to the next: reusing the last description saved about 15 us
per encode and 8 us per decode (a 2-tensor batch), a gain ``bench/step_cost.py`` does not resolve.

The decoder checks every field against the buffer it was given before it creates a view, so
corrupt or hostile input raises :class:`~collective_loader.errors.WireError` and never allocates
more than the payload size the header announced (itself capped by the caller).

Example::

    >>> import torch
    >>> encoded = encode({"ids": torch.arange(4), "meta": {"name": "a", "n": [1, 2]}})
    >>> message = torch.empty(HEADER_BYTES + encoded.nbytes, dtype=torch.uint8)
    >>> _ = encoded.write(message, Kind.DATA, step=0)
    >>> header = Header.read(message, max_payload_bytes=1 << 20)
    >>> payload = message[HEADER_BYTES:]
    >>> decode(payload, header.meta_nbytes).batch(payload)
    {'ids': tensor([0, 1, 2, 3]), 'meta': {'name': 'a', 'n': [1, 2]}}
"""

from __future__ import annotations

import enum
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from collective_loader.errors import BatchError, CollectiveLoaderError, DeliveryError, LeaderError, WireError

MAGIC = 0x434C4C44  # "CLLD"
VERSION = 3
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
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
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

    def error(self, text: str) -> CollectiveLoaderError:
        """The exception a failure of this kind raises on every rank.

        >>> Kind.BATCH_ERROR.error("bad key")
        BatchError('bad key')
        """
        return {Kind.BATCH_ERROR: BatchError, Kind.DELIVERY_ERROR: DeliveryError}.get(self, LeaderError)(text)


_KINDS = frozenset(k.value for k in Kind)
_HEADER = struct.Struct(f"={HEADER_WORDS}q")  # the header's words as the host's int64s


@dataclass(frozen=True)
class Header:
    kind: Kind
    step: int
    payload_nbytes: int
    meta_nbytes: int
    apart_nbytes: int = 0  # the payload's last bytes, not in the message: its tensors follow one by one

    @property
    def inline_nbytes(self) -> int:
        """The payload bytes inside the message itself."""
        return self.payload_nbytes - self.apart_nbytes

    def words(self) -> tuple[int, ...]:
        """The header's ``HEADER_WORDS`` int64 words."""
        words = (MAGIC, VERSION, int(self.kind), self.step, self.payload_nbytes, self.meta_nbytes, self.apart_nbytes)
        return words + (0,) * (HEADER_WORDS - len(words))

    @classmethod
    def read(cls, message: torch.Tensor, max_payload_bytes: int) -> Header:
        """Check and decode the header a received message starts with (uint8, CPU, at least
        ``HEADER_BYTES`` long); raise :class:`WireError` if anything is off."""
        magic, version, kind, step, payload, meta, apart = _HEADER.unpack_from(message.numpy().data)[:7]
        if magic != MAGIC or version != VERSION:
            raise WireError(f"bad header magic/version {magic:#x}/{version}: not a collective_loader peer")
        if kind not in _KINDS:
            raise WireError(f"unknown header kind {kind}")
        if step < 0:
            raise WireError(f"negative step {step} in header")
        if not 0 <= payload <= max_payload_bytes:
            raise WireError(f"header announces {payload} payload bytes; the cap is {max_payload_bytes}")
        if not 0 <= meta <= min(payload, MAX_META_BYTES):
            raise WireError(f"header announces {meta} meta bytes for a payload of {payload}")
        if apart and not (apart > 0 and (payload - apart) % ALIGN == 0 and payload - apart >= data_start(meta)):
            raise WireError(f"header announces {apart} bytes apart of a payload of {payload} with {meta} meta bytes")
        return cls(Kind(kind), step, payload, meta, apart)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def data_start(meta_nbytes: int) -> int:
    """Where a payload's tensor bytes start: after its description of ``meta_nbytes``, aligned."""
    return _align(meta_nbytes)


# --- encoding ---------------------------------------------------------------------------------


@dataclass
class Encoded:
    """Where everything of one batch goes in a payload (:func:`encode`); :meth:`write` puts it
    in a message.

    ``layout``: the description as a receiver decodes it (None only for :data:`NOTHING`).
    ``apart``: the tensors that travel apart, each as its bytes (a flat uint8 view of the
    tensor as given, no copy), in payload order; they fill the payload's last ``apart_nbytes``.
    """

    meta: bytes
    tensors: list[tuple[int, torch.Tensor]]  # (byte offset, tensor as given)
    nbytes: int
    layout: PayloadLayout | None = None
    apart: list[torch.Tensor] = field(default_factory=list)
    apart_nbytes: int = 0

    def header(self, kind: Kind, step: int) -> Header:
        """The header of this payload's message announcing ``kind`` at ``step``."""
        return Header(kind, step, self.nbytes, len(self.meta), self.apart_nbytes)

    def write(self, out: torch.Tensor, kind: Kind, step: int) -> dict[str, Any]:
        """Fill ``out`` (uint8, CPU, on an ``ALIGN`` boundary of its storage, at least
        ``HEADER_BYTES + header.inline_nbytes`` long) with the message: the header, then the
        payload but the tensors that travel apart. Returns the batch as its sender holds it: its
        tensors are views of ``out``, those that travel apart the tensors as given.

        Example::

            >>> out = torch.empty(256, dtype=torch.uint8)
            >>> encoded = encode({"x": torch.ones(2)})
            >>> encoded.write(out, Kind.DATA, step=3)
            {'x': tensor([1., 1.])}
            >>> header = Header.read(out, max_payload_bytes=1 << 20)
            >>> header.step, header.payload_nbytes == encoded.nbytes
            (3, True)
        """
        data = out.numpy().data  # once: every torch call costs a few us per step
        _HEADER.pack_into(data, 0, *self.header(kind, step).words())
        data[HEADER_BYTES : HEADER_BYTES + len(self.meta)] = self.meta
        if self.layout is None:
            return {}
        views = self.layout._views(out, self.nbytes - self.apart_nbytes, HEADER_BYTES)
        for i, (_, tensor) in enumerate(self.tensors):
            view = views[i]
            if view is None:  # travels apart: the batch keeps the tensor as given
                views[i] = tensor
            else:  # a copy into a typed view of the destination: any strides, conj/neg views and devices work
                view.copy_(tensor.detach() if tensor.requires_grad else tensor, non_blocking=True)
        return _fill(self.layout.template, cast(list[torch.Tensor], views))


NOTHING = Encoded(b"", [], 0)  # the payload of a message that is its header alone


def message(batch: Mapping[str, Any], kind: Kind = Kind.DATA, step: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """``batch`` as one whole message (header and payload, every tensor copied in), for what ranks
    tell each other outside the delivery steps: the leaders' gathers, agreements, the bulletin.
    ``nbytes``: the buffer's fixed size (zero-padded), for a receiver that cannot learn the size
    first; a message that does not fit raises :class:`BatchError`.

    >>> header, batch = read_message(message({"message": "disk on fire"}, Kind.SOURCE_ERROR, step=3))
    >>> header.kind.name, header.step, batch
    ('SOURCE_ERROR', 3, {'message': 'disk on fire'})
    """
    encoded = encode(batch)
    size = HEADER_BYTES + encoded.nbytes
    if nbytes is not None and size > nbytes:
        raise BatchError(f"a message of {size} bytes does not fit the {nbytes} bytes it is given")
    out = torch.zeros(size if nbytes is None else nbytes, dtype=torch.uint8)
    encoded.write(out, kind, step)
    return out


def read_message(buf: torch.Tensor, max_payload_bytes: int = MAX_META_BYTES) -> tuple[Header, dict[str, Any]]:
    """The header and batch of a :func:`message` received as ``buf`` (uint8, CPU; may be longer);
    :class:`WireError` for anything that is not one. Tensors are views of ``buf``."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < HEADER_BYTES:
        raise WireError(f"a message is at least {HEADER_BYTES} bytes of uint8, got {buf.dtype} {tuple(buf.shape)}")
    header = Header.read(buf, min(max_payload_bytes, buf.numel() - HEADER_BYTES))
    if header.apart_nbytes:
        raise WireError("a whole message has no bytes apart")
    payload = buf[HEADER_BYTES : HEADER_BYTES + header.payload_nbytes]
    return header, decode(payload, header.meta_nbytes).batch(payload)


def read_text(buf: torch.Tensor) -> tuple[Header, str]:
    """The header and text of a ``message({"message": text}, ...)`` received as ``buf`` (an
    error or an agreement's outcome); :class:`WireError` for anything else."""
    header, batch = read_message(buf)
    text = batch.get("message")
    if not isinstance(text, str):
        raise WireError(f"a message that should carry a text carries {sorted(batch)}")
    return header, text


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


class _Walk:
    """One batch's description tree and its tensors, each with its node in the tree, whose
    offset :meth:`place` fills in."""

    def __init__(self) -> None:
        self.tensors: list[tuple[dict[str, Any], torch.Tensor]] = []

    def place(self, apart_min: int | None) -> tuple[list[tuple[int, torch.Tensor]], int, list[torch.Tensor], int]:
        """Give every tensor its data offset (relative to the data start): the tensors that
        travel apart (:func:`_goes_apart`) after all the others, each group in tree order.
        Returns ``(offsets and tensors in tree order, data bytes, the apart tensors' bytes,
        the apart data bytes)``."""
        placed: list[tuple[int, torch.Tensor]] = []
        later: list[tuple[int, dict[str, Any], torch.Tensor, int]] = []
        nbytes = 0
        for node, tensor in self.tensors:
            size = tensor.numel() * tensor.element_size()
            if apart_min is not None and size >= apart_min and _goes_apart(tensor):
                later.append((len(placed), node, tensor, size))
                placed.append((0, tensor))  # its offset follows below
                continue
            node["o"] = nbytes
            placed.append((nbytes, tensor))
            nbytes = _align(nbytes + size)
        inline_end = nbytes
        for i, node, tensor, size in later:
            node["o"] = nbytes
            placed[i] = (nbytes, tensor)
            nbytes = _align(nbytes + size)
        return placed, nbytes, [t.reshape(-1).view(torch.uint8) for _, _, t, _ in later], nbytes - inline_end

    def node(self, value: Any, path: str, depth: int) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_nested or value.layout != torch.strided:
                kind = "nested" if value.is_nested else str(value.layout)
                raise BatchError(f"tensor at {path!r} is {kind}; only dense tensors are delivered")
            if value.device.type == "meta":
                raise BatchError(f"tensor at {path!r} is on the meta device and has no data to deliver")
            name = _NAMES.get(value.dtype)
            if name is None:
                raise BatchError(f"tensor at {path!r} has dtype {value.dtype}, which is not delivered")
            node = {"T": name, "s": list(value.shape), "o": 0}  # the offset: see place()
            self.tensors.append((node, value))
            return node
        if isinstance(value, Mapping):
            if depth >= MAX_DEPTH:
                raise BatchError(f"mapping at {path!r} is nested deeper than {MAX_DEPTH}")
            items = []
            for key, item in value.items():
                if not isinstance(key, str):
                    raise BatchError(f"mapping keys must be str, got {key!r} at {path!r}")
                items.append([key, self.node(item, f"{path}.{key}" if path else key, depth + 1)])
            return {"M": items}
        _check_value(value, path, depth)
        return {"V": value}


def _goes_apart(tensor: torch.Tensor) -> bool:
    """Whether a large ``tensor`` may travel in a collective of its own, from its own memory: on
    the host, contiguous, and its bytes are its values."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def encode(batch: Mapping[str, Any], apart_min: int | None = None) -> Encoded:
    """Lay out ``batch`` (a mapping, nested mappings allowed) in one payload.

    ``apart_min``: tensors of at least this many bytes (host, contiguous) travel apart, each in
    a collective of its own straight from its memory, instead of being copied into the message
    (None: every tensor is copied in). Tuples are delivered as lists. Raises
    :class:`BatchError` naming the key of anything that cannot be delivered.

    Example::

        >>> ids = torch.zeros(4, 1024, dtype=torch.int64)    # 32 KiB
        >>> p = encode({"ids": ids, "n": torch.ones(2)}, apart_min=16 << 10)
        >>> p.apart_nbytes, p.apart[0].data_ptr() == ids.data_ptr(), p.nbytes - p.apart_nbytes
        (32768, True, 192)
    """
    if apart_min is not None and apart_min < 1:
        raise ValueError(f"apart_min must be >= 1 or None, got {apart_min}")
    if not isinstance(batch, Mapping):
        raise BatchError(f"a batch must be a mapping of str to tensors, got {type(batch).__qualname__}")
    walk = _Walk()
    tree = walk.node(batch, "", 0)
    tensors, nbytes, apart, apart_nbytes = walk.place(apart_min)
    try:
        meta = json.dumps(tree, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:  # e.g. a circular list
        raise BatchError(f"batch cannot be encoded: {e}") from None
    if len(meta) > MAX_META_BYTES:
        raise BatchError(f"batch description is {len(meta)} bytes; the limit is {MAX_META_BYTES}")
    start = data_start(len(meta))
    # the layout a receiver decodes, from the very bytes it receives: the sender's batch is the same
    layout = _describe(meta, start + nbytes)
    return Encoded(meta, [(start + o, t) for o, t in tensors], start + nbytes, layout, apart, apart_nbytes)


# --- decoding ---------------------------------------------------------------------------------


class _Slot:
    """A tensor's place in a :class:`PayloadLayout`'s template: the index of its view."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True)
class PayloadLayout:
    """A checked batch description: the batch's tree and where each tensor lies in a payload.

    Made from the description's bytes and the payload's size (:func:`decode`), never from the
    payload's data. It holds no tensor: keeping one keeps no buffer in use.
    """

    meta: bytes
    tensors: tuple[
        tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int], ...
    ]  # dtype, shape, strides, byte offset, numel
    template: Any  # the batch's tree: dicts, plain values, a _Slot per tensor
    end: int  # the payload bytes its tensors need

    def batch(self, payload: torch.Tensor) -> dict[str, Any]:
        """The batch, its tensors views of ``payload`` (uint8, 1-D, at least ``end`` bytes, on an
        ``ALIGN`` boundary of its storage: :func:`decode` checked them); its lists are new."""
        return _fill(self.template, self._views(payload))

    def _views(self, payload: torch.Tensor, upto: int | None = None, start: int = 0) -> list[Any]:
        """Every tensor, in description order, as a view of ``payload``.

        ``upto``: only the tensors that lie below this payload offset; those at or beyond it
        (that travel apart: :meth:`apart`) are ``None``, and ``payload`` may end there.
        ``start``: the payload begins at this byte of ``payload`` (a message's, after its header).
        """
        storage, base, device = payload.untyped_storage(), payload.storage_offset() + start, payload.device
        return [
            None
            if upto is not None and offset >= upto and numel
            else torch.empty(0, dtype=dtype, device=device).set_(
                storage, (base + offset) // _ITEMSIZE[dtype], shape, strides
            )
            for dtype, shape, strides, offset, numel in self.tensors
        ]

    def apart(self, inline_end: int) -> list[slice]:
        """The byte ranges of the payload that travel apart when its first ``inline_end`` bytes
        are in the message: one per tensor at or beyond it (zero-size ones excepted), in
        description order, the order the sender sends them in. Raises :class:`WireError` for a
        tensor that lies across ``inline_end``."""
        ranges = []
        for dtype, _, _, offset, numel in self.tensors:
            end = offset + numel * _ITEMSIZE[dtype]
            if not numel or end <= inline_end:
                continue
            if offset < inline_end:
                raise WireError(
                    f"a tensor at payload bytes {offset}-{end} lies across the message's end at {inline_end}"
                )
            ranges.append(slice(offset, end))
        return ranges


def _fill(node: Any, views: list[torch.Tensor]) -> Any:
    kind = type(node)
    if kind is dict:
        return {k: _fill(v, views) for k, v in node.items()}
    if kind is _Slot:
        return views[node.index]
    if kind is list:
        return [_fill(v, views) for v in node]
    return node


class _Reader:
    """Checks a decoded description against a payload of ``size`` bytes and builds its template."""

    def __init__(self, data_start: int, size: int) -> None:
        self.data_start, self.size = data_start, size
        self.tensors: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int]] = []
        self.end = 0

    def value(self, v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"value nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.value(x, depth + 1) for x in v]
        raise WireError(f"unexpected value of type {type(v).__name__} in batch description")

    def node(self, n: Any, depth: int) -> Any:
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
                out[item[0]] = self.node(item[1], depth + 1)
            return out
        if "V" in n:
            return self.value(n["V"], depth)
        if "T" in n:
            return self.tensor(n.get("T"), n.get("s"), n.get("o"))
        raise WireError(f"malformed node in batch description: {str(n)[:80]}")

    def tensor(self, name: Any, shape: Any, offset: Any) -> _Slot:
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
        offset += self.data_start
        numel = math.prod(shape)
        nbytes = numel * _ITEMSIZE[dtype]
        if offset + nbytes > self.size:
            raise WireError(f"tensor of shape {shape} at offset {offset} overruns the {self.size}-byte payload")
        if numel:  # every dim >= 1: the contiguous strides are bounded by numel
            strides, step = [], 1
            for s in reversed(shape):
                strides.append(step)
                step *= s
            strides.reverse()
        else:  # whatever torch makes of an empty tensor's shape (dims up to MAX_DIM_SIZE)
            try:
                strides = list(torch.empty(0, dtype=dtype).view(shape).stride())
            except (RuntimeError, TypeError) as e:
                raise WireError(f"tensor of shape {shape} at offset {offset} cannot be viewed: {e}") from None
        self.tensors.append((dtype, tuple(shape), tuple(strides), offset, numel))
        self.end = max(self.end, offset + nbytes)
        return _Slot(len(self.tensors) - 1)


def _describe(meta: bytes, size: int) -> PayloadLayout:
    """Decode and check a batch description (``meta``) for a payload of ``size`` bytes whose
    tensor data starts after it (:func:`data_start`). Raises :class:`WireError`."""
    try:
        tree = json.loads(meta.decode())
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise WireError(f"batch description does not decode: {e}") from None
    reader = _Reader(data_start(len(meta)), size)
    template = reader.node(tree, 0)
    if not isinstance(template, dict):
        raise WireError("batch description is not a mapping")
    return PayloadLayout(meta, tuple(reader.tensors), template, reader.end)


def decode(payload: torch.Tensor, meta_nbytes: int, meta: torch.Tensor | None = None) -> PayloadLayout:
    """The checked :class:`PayloadLayout` of a received ``payload`` (uint8, 1-D, contiguous, on an
    ``ALIGN`` boundary of its storage) whose description is its first ``meta_nbytes`` bytes;
    ``.batch(payload)`` then gives the batch, its tensors views of ``payload``. Raises
    :class:`WireError`.

    ``meta``: the description (uint8, host), when it travelled apart from the tensor bytes
    (the device transport); ``payload``'s first ``meta_nbytes`` bytes are then not read, so a
    GPU payload is decoded without a copy to the host. A receiver learns from the layout, before
    it views the tensors, where those that travel apart go (:meth:`PayloadLayout.apart`).
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise WireError(
            f"payload must be a contiguous 1-D uint8 tensor, got {payload.dtype} of shape {tuple(payload.shape)}"
        )
    if payload.storage_offset() % ALIGN:
        raise WireError(
            f"payload starts at byte {payload.storage_offset()} of its storage, not on a {ALIGN}-byte boundary"
        )
    size = payload.numel()
    if not 0 <= meta_nbytes <= min(size, MAX_META_BYTES):
        raise WireError(f"meta size {meta_nbytes} does not fit a payload of {size} bytes")
    if meta is not None and meta.numel() < meta_nbytes:
        raise WireError(f"description of {meta.numel()} bytes is shorter than the {meta_nbytes} announced")
    described = (payload if meta is None else meta)[:meta_nbytes]
    return _describe(described.cpu().numpy().tobytes(), size)
