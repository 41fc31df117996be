"""Property tests of the format's parsers and of the state-tree encoding.

(a) ``parse_manifest`` / ``parse_rank_index`` on arbitrary bytes and on arbitrary or perturbed
    JSON raise nothing but :class:`CorruptCheckpointError`, and what they accept is in bounds;
(b) ``encode_tree`` -> JSON -> shard -> ``decode_tree`` gives back exactly the value;
(c) ``decode_tree`` on arbitrary JSON raises nothing but :class:`CorruptCheckpointError` and only
    ever asks the tensor loader for non-negative integer indexes;
(d) a manifest (and a rank index) survives ``to_json`` -> ``dumps`` -> parse unchanged.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crashproof.checkpoint.format._dtypes import dtype_from_name
from crashproof.checkpoint.format._fields import MAX_NDIM, MAX_WORLD_SIZE, dumps
from crashproof.checkpoint.format._hashing import digest
from crashproof.checkpoint.format._manifest import FileEntry, Manifest, parse_manifest
from crashproof.checkpoint.format._names import FORMAT_NAME, index_name, shard_name
from crashproof.checkpoint.format._rank_index import RankIndex, TensorEntry, parse_rank_index
from crashproof.checkpoint.format._shard_file import read_shard, tensor_bytes, write_shard
from crashproof.checkpoint.format._state_tree import _TAGS, decode_tree, encode_tree
from crashproof.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedStateError
from crashproof.storage import MemoryStorage

# Flat inputs are cheap to generate; nested JSON costs hypothesis more, so fewer of those.
SETTINGS = settings(max_examples=200, deadline=None)
NESTED = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPE_NAMES = [
    name
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
        "float64", "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn",
        "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
]  # fmt: skip
TAGS = list(_TAGS)  # hostile trees use every tag the decoder knows

# -- strategies -----------------------------------------------------------------------------------

awkward_ints = st.sampled_from(
    [0, 1, -1, 2**31, 2**62, 2**62 + 1, 2**63, 2**64, -(2**63), 10**30, 10**400, -(10**400)]
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | awkward_ints
    | st.floats()  # includes nan and +-inf, which json writes as NaN / Infinity and reads back
    | st.text(max_size=12)
    | st.sampled_from(["", "..", "../x", "/etc/passwd", "a/b", FORMAT_NAME, "full", "xxh3_128"])
)
json_keys = st.text(max_size=8) | st.sampled_from(
    [*TAGS, "value", "format", "files", "size", "checksum", "tensors", "shape", "offset"]
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(json_keys, children, max_size=4)
    ),
    max_leaves=16,
)
plain_names = st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9._-]{0,30}\Z").filter(lambda n: ".." not in n)
file_names = plain_names | st.sampled_from(
    ["..", "../x", "/abs", "a/b", "", ".hidden", "x\x00y", "a\\b", "../" * 3 + "etc"]
)


@st.composite
def perturbed(draw: st.DrawFn, value: Any, rate: int = 12) -> Any:
    """``value`` with about one node in ``rate`` replaced by arbitrary JSON, and some keys
    dropped or added."""
    if draw(st.integers(0, rate - 1)) == 0:
        return draw(json_values)
    if isinstance(value, dict):
        out = {k: draw(perturbed(v, rate)) for k, v in value.items() if draw(st.integers(0, rate))}
        if draw(st.integers(0, rate)) == 0:
            out[draw(json_keys)] = draw(json_values)
        return out
    if isinstance(value, list):
        return [draw(perturbed(v, rate)) for v in value]
    return value


file_entries = st.builds(FileEntry, size=st.integers(0, 2**62), checksum=st.text(max_size=32))


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    # A valid manifest lists exactly the rank indexes and shards 0 .. world_size - 1.
    world_size = draw(st.integers(1, 6) | st.sampled_from([64, 1000]))
    ranks = {index_name(rank): draw(file_entries) for rank in range(world_size)}
    others = {shard_name(rank): draw(file_entries) for rank in range(world_size)}
    return Manifest(
        step=draw(st.integers(0, 2**62)),
        world_size=world_size,
        kind="full",
        created_unix=draw(st.floats(allow_nan=False, allow_infinity=False)),
        library_version=draw(st.text(max_size=10)),
        torch_version=draw(st.text(max_size=10)),
        hash_algorithm=draw(st.sampled_from(["xxh3_128", "sha256"]) | st.text(max_size=8)),
        files={**others, **ranks},
        metadata=draw(
            st.dictionaries(
                st.text(max_size=8),
                st.recursive(
                    st.none()
                    | st.booleans()
                    | st.integers()
                    | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=8,
                ),
                max_size=3,
            )
        ),
    )  # fmt: skip


@st.composite
def tensor_entry_objs(draw: st.DrawFn, shard_size: int) -> dict[str, Any]:
    """A tensor entry, each field hostile with probability 1/10 and otherwise consistent and in
    bounds of a shard of ``shard_size`` bytes, so both the checks and acceptance are exercised."""

    def hostile() -> bool:
        return draw(st.integers(0, 9)) == 0

    hostile_dims = st.sampled_from([2**31, 2**40, 2**62, 2**62 + 1, -1])
    dtype = draw(st.sampled_from(["float128", "object", ""] if hostile() else DTYPE_NAMES))
    n_dims = MAX_NDIM + 1 if draw(st.integers(0, 30)) == 0 else draw(st.integers(0, 4))
    shape = [draw(hostile_dims if hostile() else st.integers(0, 5)) for _ in range(n_dims)]
    itemsize = dtype_from_name(dtype, where="").itemsize if dtype in DTYPE_NAMES else 4
    nbytes = math.prod(shape) * itemsize
    if hostile():
        nbytes = draw(st.sampled_from([nbytes + 1, nbytes - 1, 0, -1, 2**62]))
    offset = draw(
        st.sampled_from([shard_size, shard_size + 1, -1, 2**62, 2**63])
        if hostile()
        else st.integers(0, max(shard_size - max(nbytes, 0), 0))
    )
    return {
        "name": draw(st.text(max_size=8)),
        "dtype": dtype,
        "shape": shape,
        "offset": offset,
        "nbytes": nbytes,
        "checksum": digest(b""),
    }


@st.composite
def rank_index_objs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, int]]:
    shard_size = draw(st.integers(0, 4096) | st.sampled_from([2**40, 2**62]))
    shard_file = draw(
        file_names if draw(st.integers(0, 4)) == 0 else st.just("rank_00000.safetensors")
    )
    obj = {
        "format_version": 1,
        "rank": draw(st.integers(0, 3)),
        "step": draw(st.integers(0, 100)),
        "shard_file": shard_file,
        "tensors": draw(st.lists(tensor_entry_objs(shard_size), max_size=4)),
        "state": draw(json_values),
    }
    sizes = {shard_file: shard_size} if draw(st.integers(0, 7)) else {}
    if draw(st.integers(0, 2)) == 0:
        obj = draw(perturbed(obj, draw(st.sampled_from([8, 40]))))
    return obj, sizes


def _parse_manifest_checked(data: bytes) -> Manifest | None:
    try:
        return parse_manifest(data, "m.json")
    except CorruptCheckpointError:
        return None


def _check_accepted_manifest(manifest: Manifest) -> None:
    assert manifest.kind == "full"
    assert 1 <= manifest.world_size <= MAX_WORLD_SIZE
    assert manifest.step >= 0
    assert math.isfinite(manifest.created_unix)
    # Exactly the rank indexes and shards of the world size are listed, nothing else.
    assert set(manifest.files) == {
        name for rank in range(manifest.world_size) for name in (index_name(rank), shard_name(rank))
    }
    for name, entry in manifest.files.items():
        # Joined to a checkpoint directory, every name stays a direct child of it.
        assert os.path.dirname(os.path.normpath(os.path.join("/ckpt/step_1", name))) == (
            "/ckpt/step_1"
        )
        assert ".." not in name and "/" not in name and "\\" not in name and "\x00" not in name
        assert 0 <= entry.size <= 2**62
        assert isinstance(entry.checksum, str)


def _check_accepted_index(index: RankIndex, sizes: dict[str, int] | None) -> None:
    assert index.rank >= 0 and index.step >= 0
    assert "/" not in index.shard_file and ".." not in index.shard_file
    for t in index.tensors:
        itemsize = dtype_from_name(t.dtype, where="").itemsize
        assert len(t.shape) <= MAX_NDIM
        assert all(isinstance(d, int) and d >= 0 for d in t.shape)
        assert t.nbytes == math.prod(t.shape) * itemsize
        assert t.offset >= 0
        # Even a 0-byte tensor's shape can be made (torch's stride maths does not overflow).
        torch.empty(t.shape, dtype=dtype_from_name(t.dtype, where=""), device="meta")
        if sizes is not None:
            assert t.offset + t.nbytes <= sizes[index.shard_file]


# -- (a) the parsers on hostile input ----------------------------------------------------------


@SETTINGS
@given(st.binary(max_size=512))
@example(b"")
@example(b"\xef\xbb\xbf{}")
@example(b"\xff\xfe{\x00}\x00")
@example(b"[" * 100_000)
@example(b'{"format":"crashproof-checkpoint","format_version":1e999}')
def test_parse_manifest_on_arbitrary_bytes_raises_only_corrupt(data: bytes) -> None:
    manifest = _parse_manifest_checked(data)
    if manifest is not None:
        _check_accepted_manifest(manifest)


@st.composite
def perturbed_manifests(draw: st.DrawFn) -> Any:
    base = draw(manifests()).to_json()
    if draw(st.booleans()):
        base["files"][draw(file_names)] = {"size": 1, "checksum": "x"}
    return draw(perturbed(base, draw(st.sampled_from([8, 40]))))


@NESTED
@given(json_values | perturbed_manifests())
def test_parse_manifest_on_arbitrary_json_raises_only_corrupt(obj: Any) -> None:
    manifest = _parse_manifest_checked(json.dumps(obj).encode())
    if manifest is not None:
        _check_accepted_manifest(manifest)


@SETTINGS
@given(st.binary(max_size=512), st.none() | st.dictionaries(file_names, st.integers(0, 2**62)))
def test_parse_rank_index_on_arbitrary_bytes_raises_only_corrupt(
    data: bytes, sizes: dict[str, int] | None
) -> None:
    try:
        index = parse_rank_index(data, "r.json", file_sizes=sizes)
    except CorruptCheckpointError:
        return
    _check_accepted_index(index, sizes)


@NESTED
@given(
    json_values.map(lambda obj: (obj, None))
    | st.tuples(json_values, st.dictionaries(file_names, st.integers(0, 2**62)))
    | rank_index_objs().map(lambda pair: (pair[0], pair[1] or None))
    | rank_index_objs()
)
def test_parse_rank_index_raises_only_corrupt_and_accepts_only_in_bounds_tensors(
    obj_and_sizes: tuple[Any, dict[str, int] | None],
) -> None:
    obj, sizes = obj_and_sizes
    try:
        index = parse_rank_index(json.dumps(obj).encode(), "r.json", file_sizes=sizes)
    except CorruptCheckpointError:
        return
    _check_accepted_index(index, sizes)


@pytest.mark.parametrize("created", [10**400, -(10**400)])
def test_manifest_with_integer_created_unix_beyond_float_range_is_corrupt(created: int) -> None:
    obj = Manifest(1, 1, "full", 0.0, "0", "0", "xxh3_128", {index_name(0): FileEntry(2, "x")})
    data = obj.to_json()
    data["created_unix"] = created
    with pytest.raises(CorruptCheckpointError, match="created_unix"):
        parse_manifest(dumps(data), "m.json")


@pytest.mark.parametrize(
    "world_size, ranks",
    [(1, []), (2, [0]), (1, [0, 1]), (2, [0, 2]), (1, [1]), (0, []), (0, [0])],
)
def test_manifest_whose_world_size_disagrees_with_its_rank_indexes_is_corrupt(
    world_size: int, ranks: list[int]
) -> None:
    files = {index_name(r): FileEntry(2, "x") for r in ranks}
    obj = Manifest(1, world_size, "full", 0.0, "0", "0", "xxh3_128", files)
    with pytest.raises(CorruptCheckpointError, match="world size"):
        parse_manifest(dumps(obj.to_json()), "m.json")


@pytest.mark.parametrize(
    "shape", [[0, 2**62, 2**62], [2**62, 0], [0, 2**31, 2**31, 2**31], [2**40, 0, 2**40]]
)
def test_parse_rank_index_rejects_shapes_that_cannot_be_allocated(shape: list[int]) -> None:
    """A 0-byte tensor whose dims would overflow torch's stride maths is refused when parsed."""
    entry = {"name": "w", "dtype": "float32", "shape": shape, "offset": 0,
             "nbytes": 0, "checksum": digest(b"")}  # fmt: skip
    obj = {"format_version": 1, "rank": 0, "step": 1, "shard_file": "s.safetensors",
           "tensors": [entry], "state": None}  # fmt: skip
    with pytest.raises(UnsafeCheckpointError):
        parse_rank_index(dumps(obj), "r.json", file_sizes={"s.safetensors": 8})


# -- (b) state trees round-trip exactly --------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = getattr(torch, draw(st.sampled_from(DTYPE_NAMES)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    numel = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = bytearray(draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize)))
    if dtype == torch.bool:
        raw = bytearray(b % 2 for b in raw)
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


def _int_scalars(t: type[np.integer[Any]]) -> st.SearchStrategy[Any]:
    info = np.iinfo(t)
    return st.builds(t, st.integers(int(info.min), int(info.max)))


np_scalars = (
    st.builds(np.bool_, st.booleans())
    | st.one_of(
        *(
            _int_scalars(t)
            for t in (
                np.int8,
                np.int16,
                np.int32,
                np.int64,
                np.uint8,
                np.uint16,
                np.uint32,
                np.uint64,
            )
        )
    )
    | st.builds(np.float16, st.floats(width=16))
    | st.builds(np.float32, st.floats(width=32))
    | st.builds(np.float64, st.floats())  # a subclass of float, yet it must come back as np.float64
    | st.builds(np.complex64, st.complex_numbers(width=64))
    | st.builds(np.complex128, st.complex_numbers())
)
ARRAY_DTYPES = [np.float16, np.float32, np.float64, np.complex64, np.complex128, np.int8,
                np.int32, np.int64, np.uint8, np.bool_]  # fmt: skip
np_arrays = hnp.arrays(
    dtype=st.sampled_from(ARRAY_DTYPES),
    shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3),  # 0-d arrays too
)
# Arrays that are not C-contiguous are saved as a C-contiguous copy with the same values.
np_any_arrays = (
    np_arrays
    | np_arrays.map(lambda a: a.T)
    | np_arrays.filter(lambda a: a.ndim > 0).map(lambda a: a[::-1])
)
tree_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308])
    | st.complex_numbers()
    | st.sampled_from([complex(math.nan, -0.0), complex(-0.0, math.inf), complex(-math.inf, 0.0)])
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool])
    | tensors()
    | np_scalars
    | np_any_arrays
)
dict_keys = (
    st.integers()
    | st.text(max_size=6)
    | st.text(max_size=6).map(lambda s: "$" + s)
    | st.sampled_from(TAGS)
    | st.complex_numbers(allow_nan=False)
    | st.tuples(st.integers(), st.text(max_size=4))
    | st.booleans()
    | st.none()
)
trees = st.recursive(
    tree_leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6), children, max_size=4)
        | st.dictionaries(dict_keys, children, max_size=4)
    ),
    max_leaves=20,
)


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _same(a: Any, b: Any) -> bool:
    """Exact equality: same types all the way down, nan equals nan, -0.0 differs from 0.0,
    tensors and arrays bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bytes(tensor_bytes(a.contiguous())) == bytes(tensor_bytes(b.contiguous()))
        )
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        if a.dtype != b.dtype:
            return False
        if a.dtype.kind in "fc":  # each part as a float: a nan's payload is not kept
            return _same_float(float(a.real), float(b.real)) and _same_float(
                float(a.imag), float(b.imag)
            )
        return a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return _same_float(a, b)
    if isinstance(a, complex):
        return _same_float(a.real, b.real) and _same_float(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        # Equal as dicts (order aside: the canonical JSON sorts plain string keys), with each
        # key of the same type and each value exactly the same.
        b_keys = {k: k for k in b}
        return len(a) == len(b) and all(
            k in b_keys and _same(k, b_keys[k]) and _same(v, b[k]) for k, v in a.items()
        )
    return bool(a == b)


@NESTED
@given(trees)
@example({"$tensor": 0, 1: -0.0, (2, "x"): (math.nan,), "": {"$float": "nan"}})
@example([math.inf, -math.inf, -0.0, b"\x00\xff", {"a": {"$x": None}}, ()])
@example(
    [np.float64(1.5), np.float64(-0.0), np.array(1.5), np.array(2 + 1j), 1 - 2j, {"$complex": 0j}]
)
@example({"e": torch.empty(0, 3), "f": np.empty((2, 0), np.float32), "g": torch.tensor(1.5)})
def test_state_tree_round_trips_exactly_through_json_and_shard(value: Any) -> None:
    found: list[tuple[str, torch.Tensor]] = []
    encoded = encode_tree(value, found)
    text = dumps(encoded)  # allow_nan=False: a raw nan/inf leaking out of encode fails here
    storage = MemoryStorage()
    named = [(f"t{i}", t.contiguous()) for i, (_, t) in enumerate(found)]
    entries, file_entry = write_shard(storage, "s.safetensors", named)
    stream = storage.open("s.safetensors")
    try:
        loaded = read_shard(stream, entries, file_entry, "s.safetensors")
    finally:
        stream.close()
    decoded = decode_tree(json.loads(text), lambda i: loaded[i], "r.json")
    assert _same(decoded, value), (decoded, value)


@pytest.mark.parametrize(
    "value", [np.float64(1.5), np.complex128(1 - 2j), np.complex64(0.5j), 3 + 4j], ids=repr
)
def test_numpy_and_complex_scalars_keep_their_type(value: Any) -> None:
    decoded = decode_tree(json.loads(dumps(encode_tree(value, []))), None, "r.json")  # type: ignore[arg-type]
    assert type(decoded) is type(value) and decoded == value


def test_zero_dim_numpy_array_keeps_its_shape() -> None:
    found: list[tuple[str, torch.Tensor]] = []
    encoded = encode_tree(np.array(1.5, dtype=np.float32), found)
    decoded = decode_tree(encoded, lambda i: found[i][1], "r.json")
    assert decoded.shape == () and decoded.dtype == np.float32 and decoded == 1.5


@pytest.mark.parametrize("value", [np.longdouble(1.5), np.clongdouble(1 + 1j)], ids=repr)
def test_extended_precision_numpy_scalars_round_trip_or_are_refused(value: Any) -> None:
    """Either saved exactly or refused as unsupported; never silently narrowed."""
    try:
        encoded = encode_tree(value, [])
    except UnsupportedStateError:
        return
    decoded = decode_tree(json.loads(dumps(encoded)), None, "r.json")  # type: ignore[arg-type]
    assert _same(decoded, value)


@pytest.mark.parametrize(
    "make", [lambda: np.zeros(1)[::-1], lambda: np.ones((2, 1))[:, ::-1]], ids=["1", "2x1"]
)
def test_numpy_array_with_a_negative_stride_on_a_unit_dim_round_trips(make: Any) -> None:
    value = make()
    found: list[tuple[str, torch.Tensor]] = []
    encoded = encode_tree(value, found)
    decoded = decode_tree(encoded, lambda i: found[i][1], "r.json")
    assert _same(decoded, value)


def test_empty_tensor_round_trips_through_memory_storage() -> None:
    storage = MemoryStorage()
    empty = torch.empty(0, 3)
    entries, file_entry = write_shard(storage, "s.safetensors", [("e", empty)])
    (loaded,) = read_shard(storage.open("s.safetensors"), entries, file_entry, "s.safetensors")
    assert loaded.shape == (0, 3) and loaded.dtype == torch.float32


# -- (c) decode_tree on hostile JSON -----------------------------------------------------------

tagged_json = st.recursive(
    json_scalars | st.sampled_from(["nan", "inf", "-inf", "float32", "bfloat16", "|i1", "<f8", "O", "M8", "V4", "U3", "i4,i4", "AAE=", "!!", "c16", "b"]),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(json_keys, children, max_size=3)
    | st.builds(lambda t, v: {t: v}, st.sampled_from(TAGS), children)
    | st.builds(lambda t, v: {"$npscalar": t, "value": v}, children, children)
    | st.builds(lambda k, v: {"$dict": [[k, v]]}, children, children),
    max_leaves=12,
)  # fmt: skip


@NESTED
@given(tagged_json | json_values, st.sampled_from(["float32", "bfloat16", "int64", "bool"]))
@example({"$dict": [[{"$tuple": [[1]]}, 2]]}, "float32")
@example({"$dict": [[{"$ndarray": 0}, 2]]}, "float32")
@example({"$ndarray": 0}, "bfloat16")
@example({"$tensor": True}, "float32")
@example({"$tensor": -1}, "float32")
@example({"$tensor": 1.0}, "float32")
@example({"$bytes": "é"}, "float32")
@example({"$npscalar": "O", "value": 1}, "float32")
@example({"$npscalar": "|i1", "value": 1000}, "float32")
@example({"$npscalar": "<f8", "value": 10**400}, "float32")
@example({"$npscalar": "<i8", "value": "1"}, "float32")
@example({"$complex": [1, 2]}, "float32")
@example({"$complex": [1.0]}, "float32")
@example({"$complex": {"$tuple": [1.0, 2.0]}}, "float32")
@example([[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], "float32")  # fmt: skip
def test_decode_tree_on_arbitrary_json_raises_only_corrupt(node: Any, dtype: str) -> None:
    node = json.loads(json.dumps(node))  # exactly what a file could hold
    asked: list[Any] = []

    def load_tensor(i: Any) -> torch.Tensor:
        asked.append(i)
        assert type(i) is int and i >= 0, f"tensor loader called with {i!r}"
        return torch.zeros(2, dtype=getattr(torch, dtype))

    with contextlib.suppress(CorruptCheckpointError):
        decode_tree(node, load_tensor, "r.json")
    assert all(type(i) is int and i >= 0 for i in asked)


@pytest.mark.parametrize(
    "node",
    [
        {"$npscalar": "|i1", "value": 1000},
        {"$npscalar": "<u1", "value": -1},
        {"$npscalar": "<i8", "value": 10**30},
        {"$npscalar": "<i4", "value": {"$float": "inf"}},
        {"$npscalar": "<f8", "value": 10**400},
        {"$npscalar": "<f2", "value": 1e10},
        {"$npscalar": "<f8", "value": "1.5"},
        {"$npscalar": "<i8", "value": None},
        {"$npscalar": "<i8", "value": [1]},
        {"$npscalar": "<f4", "value": {"$bytes": "AAAAAA=="}},
        {"$npscalar": "<c16", "value": {"$tuple": [1.0, 2.0]}},
    ],
)
def test_decode_tree_npscalar_out_of_range_or_not_a_number_is_corrupt(node: Any) -> None:
    with pytest.raises(CorruptCheckpointError):
        decode_tree(node, lambda i: torch.zeros(1), "r.json")


# -- (d) metadata round-trips -------------------------------------------------------------------


@NESTED
@given(manifests())
def test_manifest_round_trips_through_json(manifest: Manifest) -> None:
    parsed = parse_manifest(dumps(manifest.to_json()), "m.json")
    assert parsed == manifest
    assert dumps(parsed.to_json()) == dumps(manifest.to_json())


@NESTED
@given(
    st.lists(
        st.tuples(
            st.text(max_size=8),
            st.sampled_from(DTYPE_NAMES),
            st.lists(st.integers(0, 4), max_size=3),
            st.integers(0, 64),
        ),
        max_size=4,
        unique_by=lambda spec: spec[0],  # a name is one place in the state: one tensor
    ),
    st.integers(0, MAX_WORLD_SIZE),
    st.integers(0, 2**62),
    json_values.filter(lambda v: "NaN" not in json.dumps(v) and "Infinity" not in json.dumps(v)),
)
def test_rank_index_round_trips_through_json(
    specs: list[tuple[str, str, list[int], int]], rank: int, step: int, state: Any
) -> None:
    tensors_, pos = [], 0
    for name, dtype, shape, gap in specs:
        nbytes = math.prod(shape) * dtype_from_name(dtype, where="").itemsize
        tensors_.append(TensorEntry(name, dtype, tuple(shape), pos + gap, nbytes, digest(b"x")))
        pos += gap + nbytes
    index = RankIndex(rank, step, "rank_00000.safetensors", tensors_, state)
    parsed = parse_rank_index(
        dumps(index.to_json()), "r.json", file_sizes={"rank_00000.safetensors": pos}
    )
    assert parsed == index
