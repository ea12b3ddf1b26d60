"""Unit and property tests for :mod:`collective_loader.plan.wire` (header, encode/decode, hostile input).

Pure and process-free: every test builds payloads in memory on the CPU.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collective_loader.errors import BatchError, WireError
from collective_loader.plan import wire
from collective_loader.plan.wire import (
    ALIGN,
    HEADER_WORDS,
    MAGIC,
    MAX_DEPTH,
    VERSION,
    Header,
    Kind,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = list(wire._DTYPES.values())


# --- helpers ----------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s values in row-major order (0-dim and non-contiguous tensors included)."""
    if t.numel() == 0:
        return b""
    # a fresh 1-D tensor: contiguous() keeps odd strides on size-1 dims, which view() rejects
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().resolve_conj().resolve_neg().reshape(-1))
    return bytes(flat.view(torch.uint8).numpy())


def assert_same(got, expected, path="batch"):
    """Deep equality: tensors bit-exact with equal dtype/shape, floats by bits (NaN by isnan),
    bool/int/float/str/None by type and value, tuples expected back as lists."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == expected.dtype, path
        assert tuple(got.shape) == tuple(expected.shape), path
        assert raw(got) == raw(expected), path
    elif isinstance(expected, dict):
        assert isinstance(got, dict), path
        assert list(got) == list(expected), path  # key order preserved
        for k in expected:
            assert_same(got[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is list, path
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert type(got) is float, path
        if math.isnan(expected):
            assert math.isnan(got), path
        else:
            assert struct.pack("<d", got) == struct.pack("<d", expected), (path, got, expected)
    else:
        assert type(got) is type(expected), (path, type(got), type(expected))
        assert got == expected, path


def pack(batch) -> tuple[torch.Tensor, int]:
    """``(payload, meta_nbytes)`` of ``batch``'s message, written by :meth:`wire.Encoded.write`:
    the payload is a view of the message, after its header."""
    p = wire.encode(batch)
    message = torch.zeros(wire.HEADER_BYTES + p.nbytes, dtype=torch.uint8)
    p.write(message, Kind.DATA, 0)
    return message[wire.HEADER_BYTES :], len(p.meta)


def unpack(payload: torch.Tensor, meta_nbytes: int) -> dict:
    """The batch :func:`wire.decode` finds in ``payload``."""
    return wire.decode(payload, meta_nbytes).batch(payload)


def roundtrip(batch):
    buf, meta_nbytes = pack(batch)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    return unpack(buf, meta_nbytes)


def payload_with_meta(tree, data_nbytes: int = 256) -> tuple[torch.Tensor, int]:
    """A payload whose meta is ``json.dumps(tree)`` (or raw bytes) followed by zeroed data."""
    meta = tree if isinstance(tree, bytes) else json.dumps(tree).encode()
    buf = torch.zeros(wire._align(len(meta)) + data_nbytes, dtype=torch.uint8)
    if meta:
        buf[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    return buf, len(meta)


def unpack_or_wire_error(buf, meta_nbytes):
    """``unpack`` must return a dict or raise WireError; any other exception fails the test."""
    try:
        out = unpack(buf, meta_nbytes)
    except WireError:
        return None
    assert isinstance(out, dict)
    return out


# --- strategies -------------------------------------------------------------------------------


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        flat = flat & 1  # only 0/1 are valid bools
    t = flat.view(dtype).reshape(shape)
    variant = draw(st.sampled_from(["plain", "transpose", "step", "grad"]))
    if variant == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1).contiguous().transpose(0, -1)  # same values, non-contiguous
    elif variant == "step" and t.dim() >= 1:
        big = torch.zeros((2 * t.shape[0],) + tuple(t.shape[1:]), dtype=dtype)
        big[::2] = t
        t = big[::2]  # same values as t, strided along dim 0
    elif variant == "grad" and (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize > 1:
        t = t.clone().requires_grad_(True)
    return t


floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, 0.0, math.inf, -math.inf, math.nan])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | floats
    | st.text(max_size=8)
    | st.sampled_from(["", "ünïcödé", "日本語", "\U0001f600", "\x00", "\ud800", "a.b[0]"])
)


def plain_values(depth: int):
    if depth == 0:
        return scalars
    inner = plain_values(depth - 1)
    return scalars | st.lists(inner, max_size=3) | st.tuples(inner, inner)


def batches(depth: int):
    leaf = tensors() | plain_values(3)
    value = leaf if depth == 0 else (leaf | batches(depth - 1))
    return st.dictionaries(st.text(max_size=6), value, max_size=4)


# --- round trip -------------------------------------------------------------------------------


@FAST
@given(batches(3))
def test_roundtrip_random_batches(batch):
    assert_same(roundtrip(batch), batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 3), (2, 3, 5)], ids=str)
def test_roundtrip_every_dtype_and_shape(dtype, shape):
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = torch.arange(numel * itemsize, dtype=torch.int64).remainder(251).to(torch.uint8)
    if dtype == torch.bool:
        data = data & 1
    t = data.view(dtype).reshape(shape)
    out = roundtrip({"x": t})
    assert out["x"].dtype == dtype
    assert tuple(out["x"].shape) == shape
    assert raw(out["x"]) == raw(t)


def test_roundtrip_special_float_bits():
    bits = torch.tensor([0x7FC00001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001], dtype=torch.int64)
    t = bits.to(torch.int32).view(torch.float32)  # payload NaNs, inf, -0.0, denormal
    out = roundtrip({"f": t})["f"]
    assert out.view(torch.int32).tolist() == bits.to(torch.int32).tolist()


def test_roundtrip_plain_values_exact():
    batch = {
        "none": None,
        "t": True,
        "f": False,
        "i": -(2**70),
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "nzero": -0.0,
        "s": "ünï\U0001f600\x00",
        "l": [1, [2.5, ["x", None]], (3, 4)],
    }
    out = roundtrip(batch)
    assert_same(out, batch)
    assert out["l"] == [1, [2.5, ["x", None]], [3, 4]]
    assert math.copysign(1.0, out["nzero"]) == -1.0


def test_roundtrip_non_contiguous_views():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    batch = {
        "t": base.t(),
        "step": base[::2, 1::3],
        "expand": torch.arange(3).expand(4, 3),
        "rows": base[::2],
        "scalar": base[1, 1],
    }
    out = roundtrip(batch)
    for k, v in batch.items():
        assert torch.equal(out[k], v), k
        assert out[k].is_contiguous()
    assert out["t"].tolist() == base.t().tolist()
    assert out["step"].tolist() == [[1.0, 4.0], [13.0, 16.0]]
    assert out["scalar"].dim() == 0 and out["scalar"].item() == 7.0


_BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6)


@pytest.mark.parametrize(
    "t",
    [
        _BASE[:, 2],
        torch.arange(8, dtype=torch.int64)[::2],
        _BASE[:, ::2],
        torch.tensor([1.0]).expand(3),
        torch.zeros(6, 1)[::2],
        torch.arange(8.0)[8::2],
    ],
    ids=["column", "1d-step", "cols-step", "1d-expand", "n1-step", "empty-1d-step"],
)
def test_flattenable_strided_tensor_roundtrip(t):
    # reshape(-1) of these is a view with a stride other than 1, which view(uint8) refuses
    assert t.element_size() > 1 and t.reshape(-1).stride(0) != 1
    out = roundtrip({"x": t})["x"]
    assert torch.equal(out, t)


def test_roundtrip_requires_grad_and_conj_and_neg_views():
    g = torch.tensor([1.5, -2.0], requires_grad=True)
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    n = torch._neg_view(torch.tensor([1.0, 2.0], dtype=torch.float64))
    out = roundtrip({"g": g, "c": c, "n": n, "c128": torch.tensor([1j], dtype=torch.complex128).conj()})
    assert out["g"].tolist() == [1.5, -2.0] and not out["g"].requires_grad
    assert out["c"].tolist() == [1 - 2j, 3 + 4j] and not out["c"].is_conj()
    assert out["n"].tolist() == [-1.0, -2.0] and not out["n"].is_neg()
    assert out["c128"].tolist() == [-1j]


def test_unpack_returns_views_of_the_payload():
    buf, meta_nbytes = pack({"a": torch.arange(5), "b": {"c": torch.ones(2, 2)}})
    out = unpack(buf, meta_nbytes)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for t in (out["a"], out["b"]["c"]):
        assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def test_docstring_example():
    buf, meta_nbytes = pack({"ids": torch.arange(4), "meta": {"name": "a", "n": (1, 2)}})
    out = unpack(buf, meta_nbytes)
    assert out["ids"].tolist() == [0, 1, 2, 3]
    assert out["meta"] == {"name": "a", "n": [1, 2]}


# --- layout of the payload --------------------------------------------------------------------


@FAST
@given(batches(2))
def test_tensor_offsets_aligned_and_disjoint(batch):
    p = wire.encode(batch)
    data_start = -(-len(p.meta) // ALIGN) * ALIGN
    end = data_start
    for offset, t in p.tensors:  # in plan order, which is the payload order
        assert offset % ALIGN == 0
        assert offset >= end  # after the meta and after the previous tensor
        end = offset + t.numel() * t.element_size()
    assert p.nbytes >= end
    buf, meta_nbytes = pack(batch)
    assert buf.numel() == p.nbytes and meta_nbytes == len(p.meta)
    assert bytes(buf[:meta_nbytes].numpy()) == p.meta


def test_plan_offsets_exact():
    p = wire.encode(
        {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(65, dtype=torch.uint8), "c": torch.zeros(0)}
    )
    start = -(-len(p.meta) // ALIGN) * ALIGN
    assert [o for o, _ in p.tensors] == [start, start + 64, start + 192]
    assert p.nbytes == start + 192


# --- header -----------------------------------------------------------------------------------


@given(
    kind=st.sampled_from(list(Kind)),
    step=st.integers(0, 2**62),
    payload=st.integers(0, 2**40),
    data=st.data(),
)
@FAST
def test_header_roundtrip(kind, step, payload, data):
    meta = data.draw(st.integers(0, min(payload, wire.MAX_META_BYTES)))
    words = torch.tensor(Header(kind, step, payload, meta).words(), dtype=torch.int64)
    assert words.shape == (HEADER_WORDS,)
    assert words.tolist()[:6] == [MAGIC, VERSION, int(kind), step, payload, meta]
    assert _read(words, max_payload_bytes=payload) == Header(kind, step, payload, meta)


def _read(words: torch.Tensor, max_payload_bytes: int) -> Header:
    return Header.read(words.view(torch.uint8), max_payload_bytes)


def _words(**over):
    base = dict(magic=MAGIC, version=VERSION, kind=int(Kind.DATA), step=3, payload=1000, meta=100)
    base.update(over)
    w = [base[k] for k in ("magic", "version", "kind", "step", "payload", "meta")]
    return torch.tensor(w + [0] * (HEADER_WORDS - 6), dtype=torch.int64)


def test_header_decode_accepts_boundaries():
    assert _read(_words(payload=1000, meta=1000), 1000) == Header(Kind.DATA, 3, 1000, 1000)
    assert _read(_words(payload=0, meta=0, step=0), 0) == Header(Kind.DATA, 0, 0, 0)


@pytest.mark.parametrize(
    "over, cap, match",
    [
        (dict(magic=MAGIC + 1), 10**6, "magic"),
        (dict(magic=0), 10**6, "magic"),
        (dict(version=VERSION + 1), 10**6, "version"),
        (dict(kind=0), 10**6, "kind"),
        (dict(kind=max(Kind) + 1), 10**6, "kind"),
        (dict(step=-1), 10**6, "step"),
        (dict(payload=1001), 1000, "cap"),
        (dict(payload=-1, meta=0), 1000, "payload"),
        (dict(payload=100, meta=101), 1000, "meta"),
        (dict(meta=-1), 1000, "meta"),
        (dict(payload=2**30, meta=wire.MAX_META_BYTES + 1), 2**31, "meta"),
    ],
)
def test_header_decode_rejects(over, cap, match):
    with pytest.raises(WireError, match=match):
        _read(_words(**over), cap)


@pytest.mark.parametrize(
    "buf",
    [
        torch.zeros(wire.HEADER_BYTES - 1, dtype=torch.uint8),
        torch.zeros(wire.HEADER_BYTES, dtype=torch.int8),
        torch.zeros(2, wire.HEADER_BYTES, dtype=torch.uint8),
    ],
    ids=["short", "int8", "2-D"],
)
def test_read_message_rejects_what_is_not_a_message_buffer(buf):
    with pytest.raises(WireError, match="a message is at least"):
        wire.read_message(buf)


def test_a_corrupt_or_hostile_peer_message_is_refused_not_evaluated():
    """What the leaders gather and agree with is a wire message: a pickle (what
    ``all_gather_object`` sends, here one that would run code), random bytes, a message whose
    description was altered, or one without the text an agreement carries, raise WireError."""
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('evaluated')",))

    hostile = torch.frombuffer(bytearray(pickle.dumps(Boom()).ljust(wire.HEADER_BYTES, b"\0")), dtype=torch.uint8)
    good = wire.message({"message": "disk on fire"}, Kind.SOURCE_ERROR, step=2, nbytes=4096)
    altered = good.clone()
    altered[wire.HEADER_BYTES : wire.HEADER_BYTES + 4] = torch.frombuffer(bytearray(b"[[[["), dtype=torch.uint8)
    random = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for buf, match in ((hostile, "magic"), (random, "magic"), (altered, "description")):
        with pytest.raises(WireError, match=match):
            wire.read_message(buf)
    with pytest.raises(WireError, match="carry a text"):
        wire.read_text(wire.message({"value": 3}))
    assert wire.read_text(good)[1] == "disk on fire"


# --- hostile / corrupt payloads ---------------------------------------------------------------


def _valid_payload():
    return pack(
        {"ids": torch.arange(6).view(2, 3), "m": {"x": [1.5, "s", None], "f": torch.ones(3, dtype=torch.float16)}}
    )


@FUZZ
@given(st.data())
def test_fuzz_overwrite_meta_bytes(data):
    buf, meta_nbytes = _valid_payload()
    buf = buf.clone()
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        i = data.draw(st.integers(0, meta_nbytes - 1))
        buf[i] = data.draw(st.integers(0, 255))
    unpack_or_wire_error(buf, meta_nbytes)


@FUZZ
@given(st.data())
def test_fuzz_truncate_and_wrong_meta_size(data):
    buf, meta_nbytes = _valid_payload()
    cut = data.draw(st.integers(0, buf.numel()))
    m = data.draw(st.integers(-5, buf.numel() + 5) | st.just(meta_nbytes))
    out = unpack_or_wire_error(buf[:cut].clone(), m)
    if m == meta_nbytes and cut == buf.numel():
        assert out is not None


@pytest.mark.parametrize("drop", [1, 8, 64, 511, 512])
def test_truncated_tensor_data_raises(drop):
    buf, meta_nbytes = pack({"a": torch.arange(64, dtype=torch.int64)})  # 512 data bytes at the end
    with pytest.raises(WireError, match="overruns"):
        unpack(buf[: buf.numel() - drop].clone(), meta_nbytes)


@pytest.mark.parametrize("keep", [0, 1, 10, -1])
def test_truncated_meta_raises(keep):
    buf, meta_nbytes = pack({"a": torch.arange(64, dtype=torch.int64)})
    with pytest.raises(WireError, match="does not decode"):
        unpack(buf, keep % meta_nbytes)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["T", "s", "o", "M", "V", "x"]), c, max_size=3),
    max_leaves=12,
)


def mostly(valid, hostile):
    """``valid`` three times in four, else ``hostile`` (one_of alone leans on the hostile branch)."""
    return st.integers(0, 3).flatmap(lambda i: valid if i else hostile)


dtype_names = mostly(
    st.sampled_from(sorted(wire._DTYPES)),
    st.sampled_from(["float128", "complex32", "qint8", "", "torch.float32"]) | json_values,
)
shape_entries = st.integers(-3, 5) | st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1]) | json_values
shapes = mostly(st.lists(st.integers(0, 4), max_size=4), st.lists(shape_entries, max_size=18) | json_values)
offsets = mostly(
    st.integers(0, 8).map(lambda i: i * ALIGN),
    st.integers(-128, 512) | st.sampled_from([2**40, 2**62, 2**63, 2**70, -(2**63)]) | json_values,
)


@st.composite
def hostile_nodes(draw, depth=2):
    kinds = ["T", "T", "T", "V", "M", "junk"] if depth else ["T", "T", "T", "V", "junk"]
    kind = draw(st.sampled_from(kinds))
    if kind == "T":
        node = {"T": draw(dtype_names), "s": draw(shapes), "o": draw(offsets)}
        if draw(st.integers(0, 9)) == 0:
            del node[draw(st.sampled_from(["T", "s", "o"]))]
        return node
    if kind == "V":
        return {"V": draw(json_values)}
    if kind == "M":
        return draw(hostile_mappings(depth))
    return draw(json_values)


@st.composite
def hostile_mappings(draw, depth=2):
    key = mostly(st.text(max_size=3), json_values)
    items = draw(st.lists(st.tuples(key, hostile_nodes(depth=depth - 1)), min_size=1, max_size=3))
    return {"M": [list(i) for i in items]}


@FUZZ
@given(mostly(hostile_mappings(), hostile_nodes()), st.integers(0, 512))
def test_fuzz_hand_crafted_meta(tree, data_nbytes):
    buf, meta_nbytes = payload_with_meta(tree, data_nbytes)
    out = unpack_or_wire_error(buf, meta_nbytes)
    if out is not None:
        for t in _tensors_in(out):  # whatever decodes lies inside the buffer
            assert t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert t.data_ptr() + t.numel() * t.element_size() <= buf.data_ptr() + buf.numel()


@FUZZ
@given(dtype_names, shapes, offsets, st.integers(0, 512))
def test_fuzz_single_tensor_node(name, shape, offset, data_nbytes):
    buf, meta_nbytes = payload_with_meta({"M": [["a", {"T": name, "s": shape, "o": offset}]]}, data_nbytes)
    out = unpack_or_wire_error(buf, meta_nbytes)
    if out is not None:  # it decoded: then every field was valid and the view is where it says
        t = out["a"]
        assert list(t.shape) == shape and t.dtype == wire._DTYPES[name]
        start = buf.data_ptr() + wire._align(meta_nbytes) + offset
        assert t.numel() == 0 or t.data_ptr() == start
        assert start + t.numel() * t.element_size() <= buf.data_ptr() + buf.numel()


def _tensors_in(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors_in(v)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 256))
def test_fuzz_random_meta_bytes(meta, data_nbytes):
    buf, meta_nbytes = payload_with_meta(meta, data_nbytes)
    unpack_or_wire_error(buf, meta_nbytes)


def T(name="float32", shape=(1,), offset=0):
    return {"M": [["a", {"T": name, "s": list(shape) if isinstance(shape, tuple) else shape, "o": offset}]]}


@pytest.mark.parametrize(
    "tree, match",
    [
        (T(shape=(2**40, 2**40)), "overruns"),
        (T(shape=(2**20,) * 16), "overruns"),
        (T(shape=(1,) * 17), "bad shape"),
        (T(shape=(-1,)), "bad shape"),
        (T(shape=[True]), "bad shape"),
        (T(shape=[1.0]), "bad shape"),
        (T(shape="1"), "bad shape"),
        (T(shape=None), "bad shape"),
        (T(offset=-64), "offset"),
        (T(offset=1), "offset"),
        (T(offset=1.0), "offset"),
        (T(offset=True), "offset"),
        (T(offset="0"), "offset"),
        (T(offset=2**70), "overruns"),
        (T(offset=256), "overruns"),
        (T(name="float128"), "dtype"),
        (T(name="complex32"), "dtype"),
        (T(name="torch.float32"), "dtype"),
        (T(name=5), "dtype"),
        (T(name=None), "dtype"),
        ({"M": [["a", {"T": "float32", "s": [1]}]]}, "malformed"),
        ({"M": [["a", {"T": "float32", "s": [1], "x": 0}]]}, "offset"),
        ({"M": [["a", {"T": "float32", "s": [1], "o": 0, "x": 1}]]}, "malformed"),
        ({"M": [["a", 5]]}, "malformed"),
        ({"M": [["a", [1]]]}, "malformed"),
        ({"M": [["a", {}]]}, "malformed"),
        ({"M": [["a", {"x": 1}]]}, "malformed"),
        ({"M": [["a", {"V": 1, "M": []}]]}, "malformed"),
        ({"M": [["a"]]}, "malformed"),
        ({"M": [[1, {"V": 1}]]}, "malformed"),
        ({"M": [["a", {"V": 1}, 3]]}, "malformed"),
        ({"M": "x"}, "malformed"),
        ({"M": {"a": {"V": 1}}}, "malformed"),
        ({"M": [["a", {"V": {"k": 1}}]]}, "unexpected value"),
        ({"V": 1}, "not a mapping"),
        ([1, 2], "malformed"),
        ("x", "malformed"),
        (None, "malformed"),
    ],
)
def test_hand_crafted_meta_rejected(tree, match):
    buf, meta_nbytes = payload_with_meta(tree, 128)
    with pytest.raises(WireError, match=match):
        unpack(buf, meta_nbytes)


def test_huge_announced_shape_raises_quickly_without_allocating():
    buf, meta_nbytes = payload_with_meta(T(name="complex128", shape=(2**40, 2**40)), 64)
    with pytest.raises(WireError, match="overruns"):
        unpack(buf, meta_nbytes)


def test_zero_numel_huge_dims_are_views():
    buf, meta_nbytes = payload_with_meta(T(shape=(0, 2**40, 2**40)), 64)
    out = unpack(buf, meta_nbytes)["a"]
    assert tuple(out.shape) == (0, 2**40, 2**40) and out.numel() == 0


def test_zero_numel_shape_with_dim_over_int64_raises_wire_error():
    buf, meta_nbytes = payload_with_meta(T(shape=(0, 2**63)), 64)
    with pytest.raises(WireError):
        unpack(buf, meta_nbytes)


@pytest.mark.parametrize(
    "text",
    [
        '{"M":[["a",' * 10_000 + "1" + "]]}" * 10_000,
        '{"V":' + "[" * 10_000 + "]" * 10_000 + "}",
        '{"M":[["a",{"V":' + "[" * 100 + "]" * 100 + "}]]}",
        '{"M":[["a",' * 100 + '{"V":1}' + "]]}" * 100,
        '{"a":' * 10_000 + "1" + "}" * 10_000,
    ],
    ids=["maps-10k", "lists-10k", "lists-100", "maps-100", "dicts-10k"],
)
def test_deep_nesting_rejected(text):
    buf, meta_nbytes = payload_with_meta(text.encode(), 64)
    with pytest.raises(WireError):
        unpack(buf, meta_nbytes)


@pytest.mark.parametrize("meta", [b"\xff\xfe", b'{"M":[', b"", b"NaN", b'{"M":[]}x'])
def test_undecodable_meta_rejected(meta):
    buf, meta_nbytes = payload_with_meta(meta, 64)
    with pytest.raises(WireError):
        unpack(buf, meta_nbytes)


def test_unpack_rejects_bad_payload_tensor_and_meta_size():
    buf, meta_nbytes = _valid_payload()
    with pytest.raises(WireError, match="1-D uint8"):
        unpack(buf.to(torch.int8), meta_nbytes)
    with pytest.raises(WireError, match="1-D uint8"):
        unpack(buf[: buf.numel() // 64 * 64].view(-1, 64), meta_nbytes)
    with pytest.raises(WireError, match="meta size"):
        unpack(buf, -1)
    with pytest.raises(WireError, match="meta size"):
        unpack(buf, buf.numel() + 1)
    big = torch.zeros(wire.MAX_META_BYTES + 64, dtype=torch.uint8)
    with pytest.raises(WireError, match="meta size"):
        unpack(big, wire.MAX_META_BYTES + 1)


def test_empty_batch_roundtrip():
    buf, meta_nbytes = pack({})
    assert unpack(buf, meta_nbytes) == {}


# --- encoding errors --------------------------------------------------------------------------


def _nested(depth: int, leaf):
    batch = leaf
    for _ in range(depth):
        batch = {"k": batch}
    return batch


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: {"outer": {"inner": object()}}, "outer.inner"),
        (lambda: {"arr": np.arange(3)}, "arr"),
        (lambda: {"s": {1, 2}}, "s"),
        (lambda: {"b": b"bytes"}, "b"),
        (lambda: {"l": [1, [2, object()]]}, "l[1][1]"),
        (lambda: {"sp": torch.eye(3).to_sparse()}, "sp"),
        (lambda: {"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)}, "q"),
        (lambda: {"c32": torch.zeros(2, dtype=torch.complex32)}, "c32"),
        (lambda: {"m": {1: torch.ones(1)}}, "m"),
        (lambda: {"d": {"x": {"y": np.float32(1.0)}}}, "d.x.y"),
    ],
    ids=["object", "numpy", "set", "bytes", "list-item", "sparse", "quantized", "complex32", "int-key", "np-scalar"],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_encoding_errors_name_the_key(make, key):
    with pytest.raises(BatchError) as e:
        pack(make())
    assert repr(key) in str(e.value)


@pytest.mark.parametrize("batch", [[("a", torch.ones(1))], torch.ones(1), "ids", None])
def test_non_mapping_batch_rejected(batch):
    with pytest.raises(BatchError, match="mapping"):
        pack(batch)


def test_mapping_nesting_boundary():
    ok = _nested(MAX_DEPTH, {"t": torch.arange(2)})  # MAX_DEPTH + 1 mappings: the deepest at depth 16
    with pytest.raises(BatchError, match="deeper"):
        pack(ok)
    deepest = _nested(MAX_DEPTH - 1, {"t": torch.arange(2), "v": 1})  # deepest mapping at depth 15
    assert_same(roundtrip(deepest), deepest)


def test_list_nesting_boundary():
    def lists(n):
        v = 1
        for _ in range(n):
            v = [v]
        return v

    assert roundtrip({"v": lists(MAX_DEPTH - 1)}) == {"v": lists(MAX_DEPTH - 1)}
    with pytest.raises(BatchError, match="'v"):
        pack({"v": lists(MAX_DEPTH + 1)})


def test_circular_values_rejected():
    loop: list = []
    loop.append(loop)
    with pytest.raises(BatchError):
        pack({"loop": loop})
    d: dict = {}
    d["self"] = d
    with pytest.raises(BatchError):
        pack({"d": d})


def test_huge_int_rejected():
    with pytest.raises(BatchError):
        pack({"n": 10**5000})


def test_oversized_meta_rejected():
    with pytest.raises(BatchError, match="limit"):
        wire.encode({"s": "x" * (wire.MAX_META_BYTES + 1)})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nested_tensor_rejected_with_batch_error():
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(BatchError, match="nt"):
        pack({"nt": nt})


def test_jagged_nested_tensor_rejected():
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(BatchError, match="nt"):
        pack({"nt": nt})


def test_meta_device_tensor_rejected_with_batch_error():
    with pytest.raises(BatchError, match="m"):
        pack({"m": torch.empty(3, device="meta")})


def test_pack_and_unpack_hold_no_reference_cycles():
    """Without the cyclic collector, a decoded batch's payload and a packed batch's tensors are
    freed as soon as the last reference goes (a cycle kept every payload alive until gc)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        source = torch.arange(1000)
        alive_source = weakref.ref(source)
        buf, meta_nbytes = pack({"a": source, "b": {"c": torch.ones(3)}, "d": [1, "x"]})
        del source
        assert alive_source() is None
        out = unpack(buf, meta_nbytes)
        alive_buf = weakref.ref(buf)
        del buf
        assert alive_buf() is None  # the decoded views keep the bytes, not the decoder's locals
        assert torch.equal(out["a"], torch.arange(1000))
    finally:
        gc.enable()


# --- messages ---------------------------------------------------------------------------------


def test_write_returns_the_batch_a_decode_gives():
    batch = {"a": torch.arange(5), "b": {"c": torch.ones(2, 2, dtype=torch.bfloat16)}, "d": [1]}
    p = wire.encode(batch)
    out = torch.zeros(wire.HEADER_BYTES + p.nbytes, dtype=torch.uint8)
    written = p.write(out, Kind.DATA, 0)
    decoded = unpack(out[wire.HEADER_BYTES :], len(p.meta))
    assert [v.data_ptr() for v in _tensors_in(written)] == [t.data_ptr() for t in _tensors_in(decoded)]
    assert_same(written, decoded)


def test_header_read_from_a_message():
    out = torch.empty(wire.HEADER_BYTES + 64, dtype=torch.uint8)
    p = wire.encode({})
    p.write(out, Kind.END, 7)
    assert Header.read(out, 1 << 20) == Header(Kind.END, 7, p.nbytes, len(p.meta))
    out[:8] = 0
    with pytest.raises(WireError, match="magic"):
        Header.read(out, 1 << 20)


# --- tensors that travel apart ----------------------------------------------------------------


def _receive(p: wire.Encoded) -> dict:
    """What a receiver decodes from ``p``'s message and its apart tensors, each copied into its
    range of the payload, as ``Channel.recv`` and ``recv_apart`` would."""
    message = torch.zeros(wire.HEADER_BYTES + p.nbytes - p.apart_nbytes, dtype=torch.uint8)
    p.write(message, Kind.DATA, 0)
    header = Header.read(message, 1 << 30)
    payload = torch.zeros(p.nbytes, dtype=torch.uint8)
    payload[: header.inline_nbytes] = message[wire.HEADER_BYTES :]
    layout = wire.decode(payload, header.meta_nbytes)
    ranges = layout.apart(header.inline_nbytes)
    assert len(ranges) == len(p.apart)
    for where, sent in zip(ranges, p.apart):
        payload[where] = sent
    return layout.batch(payload)


def test_large_host_tensors_travel_apart_after_the_rest_and_uncopied():
    big, small = torch.arange(3000, dtype=torch.int64), torch.ones(4, dtype=torch.float16)
    batch = {"big": big, "small": small, "more": {"big2": big.float().reshape(30, 100), "n": 3}}
    p = wire.encode(batch, apart_min=8000)
    assert [t.data_ptr() for t in p.apart] == [big.data_ptr(), batch["more"]["big2"].data_ptr()]
    assert all(t.dtype == torch.uint8 and t.dim() == 1 for t in p.apart)
    assert p.apart_nbytes == sum(wire._align(t.numel()) for t in p.apart)
    offsets = dict((id(t), o) for o, t in p.tensors)
    # the copied tensor first, the apart ones after it, each at an aligned offset
    assert offsets[id(small)] < offsets[id(big)] < offsets[id(batch["more"]["big2"])]
    assert offsets[id(big)] == p.nbytes - p.apart_nbytes
    assert all(o % ALIGN == 0 for o in offsets.values())
    out = torch.zeros(wire.HEADER_BYTES + p.nbytes - p.apart_nbytes, dtype=torch.uint8)  # the inline part only
    written = p.write(out, Kind.DATA, 0)
    assert written["big"] is big and written["more"]["big2"] is batch["more"]["big2"]  # as given: no copy
    assert written["small"].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert_same(_receive(p), batch)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(4000, dtype=torch.int64).reshape(40, 100).t(),  # not contiguous
        torch.ones(4000, requires_grad=True),
        torch.complex(torch.ones(2000), torch.ones(2000)).conj(),  # a conj view: its bytes are not its values
        torch.arange(4000, dtype=torch.int64)[:10],  # too small
    ],
    ids=["strided", "grad", "conj", "small"],
)
def test_tensors_whose_memory_is_not_their_bytes_are_copied_in(tensor):
    p = wire.encode({"t": tensor, "x": torch.arange(100)}, apart_min=100)
    assert [t.numel() for t in p.apart] == [800]  # only x travels apart
    assert_same(_receive(p), {"t": tensor, "x": torch.arange(100)})


def test_without_apart_min_everything_is_copied_in():
    p = wire.encode({"t": torch.zeros(1 << 20)})
    assert p.apart == [] and p.apart_nbytes == 0


def test_zero_size_tensors_never_travel_apart():
    batch = {"a": torch.arange(100), "e": torch.empty(0, 5), "b": torch.arange(100), "e2": torch.empty(3, 0)}
    p = wire.encode(batch, apart_min=1)
    assert len(p.apart) == 2
    assert_same(_receive(p), batch)


@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    apart_min=st.integers(1, 2000),
    dtype=st.sampled_from(DTYPES),
)
@FAST
def test_any_split_between_message_and_apart_round_trips(sizes, apart_min, dtype):
    batch = {f"t{i}": torch.arange(n).to(dtype) for i, n in enumerate(sizes)}
    p = wire.encode(batch, apart_min=apart_min)
    assert p.apart_nbytes == sum(wire._align(t.numel()) for t in p.apart)
    assert_same(_receive(p), batch)


def test_header_carries_the_apart_bytes():
    header = Header(Kind.DATA, 1, 4096, 100, 2048)
    assert header.inline_nbytes == 2048
    assert _read(torch.tensor(header.words(), dtype=torch.int64), 4096) == header


@pytest.mark.parametrize(
    "apart, match",
    [(-64, "apart"), (1000 - 64 * 3 + 1, "apart"), (1000 - 64, "apart"), (2000, "apart")],
    ids=["negative", "unaligned", "inside the description", "more than the payload"],
)
def test_header_rejects_impossible_apart_bytes(apart, match):
    words = _words(payload=1024, meta=100)
    words[6] = apart
    with pytest.raises(WireError, match=match):
        _read(words, 1 << 20)


def test_a_tensor_across_the_messages_end_is_rejected():
    p = wire.encode({"a": torch.arange(100)})  # data from 64 to 864
    layout = p.layout
    assert len(p.meta) <= 64 and layout is not None
    assert layout.apart(p.nbytes) == [] and layout.apart(64) == [slice(64, 864)]
    with pytest.raises(WireError, match="across"):
        layout.apart(128)
