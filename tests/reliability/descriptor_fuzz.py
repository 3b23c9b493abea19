"""Hypothesis strategies built from protobuf descriptors: a request of any RPC, either as a
message with random field values (boundaries, out-of-range-for-the-daemon values, long
lists within the daemon's limits) or as raw bytes a message object cannot hold (integers
beyond the field's type, invalid UTF-8 in string fields, wrong wire types, truncation)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
_VARINT_TYPES = (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_BOOL, F.TYPE_ENUM)

# Field names whose values the daemon treats as filesystem paths it may create or write:
# random text for them never starts with "/", so a fuzzed ExportDrafter cannot write outside
# the test's directories (absolute paths come from the pools only).
_WRITE_PATHS = ("output_dir",)


def field_names(desc: Descriptor, _seen: set[str] | None = None) -> set[str]:
    """Every field name in the message tree (what an INVALID_ARGUMENT may name)."""
    seen = _seen if _seen is not None else set()
    names: set[str] = set()
    if desc.full_name in seen:
        return names
    seen.add(desc.full_name)
    names |= {o.name for o in desc.oneofs}
    for f in desc.fields:
        names.add(f.name)
        if f.message_type is not None:
            names |= field_names(f.message_type, seen)
    return names


_FIELD_PATH = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def named_field(details: str) -> str | None:
    """The field an error message starts with ("sampling.seed: ..." -> "seed"), or None."""
    m = _FIELD_PATH.match(details)
    if not m:
        return None
    return re.sub(r"\[\d*\]", "", m.group(1)).split(".")[-1]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, -1, 2, 7, 48, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63})
    edges = [e for e in edges if lo <= e <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(0, 64).filter(lambda v: lo <= v <= hi),
                     st.integers(lo, hi))  # fmt: skip


def _scalar(f: FieldDescriptor, pools: Mapping[str, Sequence]) -> st.SearchStrategy:
    pool = list(pools.get(f.name, ()))
    if f.type in _INT_RANGES:
        base = _ints(*_INT_RANGES[f.type])
    elif f.type == F.TYPE_BOOL:
        base = st.booleans()
    elif f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        width = 64 if f.type == F.TYPE_DOUBLE else 32
        base = st.one_of(
            st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, float("nan"),
                             float("inf"), float("-inf")]),
            st.floats(width=width),
        )  # fmt: skip
    elif f.type == F.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        base = st.one_of(st.sampled_from(known), st.sampled_from([-1, max(known) + 1, 2**31 - 1]))
    elif f.type == F.TYPE_BYTES:
        base = st.binary(max_size=64)
    elif f.type == F.TYPE_STRING:
        text = st.one_of(
            st.text(max_size=24),
            st.sampled_from(["", " ", "\x00", "..", "a" * 5000, "\u202e\ufeff", "é" * 3]),
        )
        if f.name in _WRITE_PATHS:
            text = text.filter(lambda s: not s.startswith("/"))
        base = text
    else:  # pragma: no cover - every scalar type is listed above
        raise TypeError(f"unhandled field type {f.type} of {f.full_name}")
    if not pool:
        return base
    # Mostly pool values (known ids, real paths, small numbers), so that most requests get
    # past the first check and reach the deeper code; random values the rest of the time.
    # Token ids come from the pool almost always: one bad id in a prompt refuses it.
    share = 97 if f.name == "token_ids" else 75
    pooled = st.sampled_from(pool)
    return st.integers(0, 99).flatmap(lambda r: pooled if r < share else base)


def messages(
    desc: Descriptor,
    cls_for: Callable[[Descriptor], type[Message]],
    pools: Mapping[str, Sequence] = {},  # noqa: B006 - read only
    big_lists: Mapping[str, int] = {},  # noqa: B006 - field name -> longest list drawn
    depth: int = 0,
) -> st.SearchStrategy[Message]:
    """A strategy of `desc` messages: each field unset or a random value (sub-messages to
    depth 3); a repeated field named in `big_lists` is sometimes that long."""

    def value(f: FieldDescriptor) -> st.SearchStrategy:
        return field_values(f, cls_for, pools, big_lists, depth)

    fields = {f.name: st.one_of(st.none(), value(f)) for f in desc.fields}

    def build(values: dict) -> Message:
        msg = cls_for(desc)()
        for name, v in values.items():
            if v is not None:
                _set(msg, desc.fields_by_name[name], v)
        return msg

    return st.fixed_dictionaries(fields).map(build)


def field_values(
    f: FieldDescriptor,
    cls_for: Callable[[Descriptor], type[Message]],
    pools: Mapping[str, Sequence],
    big_lists: Mapping[str, int],
    depth: int = 0,
) -> st.SearchStrategy:
    """Values for field `f`: a scalar, a message, a list (repeated) or a dict (map)."""

    def value(f: FieldDescriptor) -> st.SearchStrategy:
        if f.message_type is not None:
            if f.message_type.GetOptions().map_entry:
                k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                return st.dictionaries(_scalar(k, pools), _scalar(v, pools), max_size=3)
            if depth >= 3:
                return st.none()
            return messages(f.message_type, cls_for, pools, big_lists, depth + 1)
        return _scalar(f, pools)

    def repeated(f: FieldDescriptor) -> st.SearchStrategy:
        item = value(f)
        small = st.lists(item, max_size=4)
        n = big_lists.get(f.name)
        if n is None:
            return small
        long = st.integers(n // 2, n).flatmap(lambda k: st.lists(item, min_size=k, max_size=k))
        return st.one_of(small, long)

    is_map = f.message_type is not None and f.message_type.GetOptions().map_entry
    return value(f) if is_map or not _is_repeated(f) else repeated(f)


def _set(msg: Message, f: FieldDescriptor, v) -> None:
    """msg.<f> = v, replacing what was there (lists and maps too)."""
    msg.ClearField(f.name)
    target = getattr(msg, f.name)
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        for k, item in v.items():
            if isinstance(item, Message):
                target[k].CopyFrom(item)
            else:
                target[k] = item
    elif _is_repeated(f):
        if f.message_type is not None:
            for item in v:
                target.add().CopyFrom(item) if item is not None else target.add()
        else:
            target.extend(v)
    elif f.message_type is not None:
        if v is not None:
            target.CopyFrom(v)
    else:
        setattr(msg, f.name, v)


def _leaf_paths(desc: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Paths to every field a mutation may replace: scalars, lists and maps, and fields
    inside singular sub-messages (to depth 3)."""
    paths: list[tuple[FieldDescriptor, ...]] = []
    for f in desc.fields:
        paths.append((f,))
        nested = f.message_type is not None and not _is_repeated(f)
        if nested and depth < 3:
            paths += [(f, *p) for p in _leaf_paths(f.message_type, depth + 1)]
    return paths


def mutations(
    template: Message,
    cls_for: Callable[[Descriptor], type[Message]],
    pools: Mapping[str, Sequence] = {},  # noqa: B006 - read only
    big_lists: Mapping[str, int] = {},  # noqa: B006
) -> st.SearchStrategy[Message]:
    """A valid `template` with one or two of its fields (at any depth) replaced by random
    values: most of the request stays valid, so the daemon's check of that field is reached."""
    paths = _leaf_paths(template.DESCRIPTOR)

    @st.composite
    def mutated(draw) -> Message:
        msg = type(template)()
        msg.CopyFrom(template)
        chosen = draw(st.lists(st.sampled_from(paths), min_size=1, max_size=2))
        for path in chosen:
            target = msg
            for f in path[:-1]:
                target = getattr(target, f.name)
            leaf = path[-1]
            _set(target, leaf, draw(field_values(leaf, cls_for, pools, big_lists, len(path))))
        return msg

    return mutated()


def _is_repeated(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated)


# -- raw wire bytes --------------------------------------------------------------------------


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative numbers: ten-byte two's complement, as protobuf writes them
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def raw_field(f: FieldDescriptor) -> st.SearchStrategy[bytes]:
    """Bytes for field `f` that a message object cannot hold, or holds only after decoding."""
    n = f.number
    junk_len = st.binary(max_size=16).map(lambda b: _key(n, 2) + _varint(len(b)) + b)
    if f.type == F.TYPE_STRING:
        bad_utf8 = st.sampled_from(
            [b"\xff\xfe", b"\xc3", b"a\x80b", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]
        )
        return st.one_of(bad_utf8.map(lambda b: _key(n, 2) + _varint(len(b)) + b), junk_len)
    if f.type in _VARINT_TYPES:
        beyond = st.one_of(
            st.sampled_from([2**32, 2**63, 2**64 - 1, -1, -(2**31) - 1]),
            st.integers(0, 2**64 - 1),
        )
        return st.one_of(beyond.map(lambda v: _key(n, 0) + _varint(v)), junk_len)
    return junk_len  # any other type: a length-delimited value where it may not belong


def raw_requests(desc: Descriptor, valid: st.SearchStrategy[Message]) -> st.SearchStrategy[bytes]:
    """A serialized random message with one field's bytes replaced or appended by `raw_field`
    (later occurrences of a scalar win), an unknown field, or the whole thing truncated."""
    fields = list(desc.fields)
    tails = [raw_field(f) for f in fields] + [
        st.binary(min_size=1, max_size=8).map(lambda b: _key(999, 2) + _varint(len(b)) + b),
        st.sampled_from([_key(1, 3), _key(1, 7), b"\x80", b"\x0a\x05abc"]),  # bad wire types, cut
    ]
    serialized = valid.map(lambda m: m.SerializeToString())

    def combine(parts: tuple[bytes, bytes, int | None]) -> bytes:
        body, tail, cut = parts
        data = body + tail
        return data[:cut] if cut is not None and cut < len(data) else data

    return st.tuples(serialized, st.one_of(tails), st.one_of(st.none(), st.integers(0, 64))).map(
        combine
    )
