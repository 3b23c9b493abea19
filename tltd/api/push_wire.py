"""PushPolicy request messages decoded without copying a chunk's data.

The protobuf runtime copies a chunk's bytes when it parses the message and again when `.data`
is read; a push moves the whole model through here, so a message that is only a chunk is read
straight from the wire bytes (protobuf wire format), its data a view of them. Anything else (the
header, the commit, a message with other or repeated fields) goes to the protobuf runtime, as
does any field of a chunk this reader does not expect: it either decodes it as the generated
code would or raises the same DecodeError.
"""

from __future__ import annotations

from tltd import domain as d
from tltd.v1 import policy_pb2

PUSH_POLICY_METHOD = "/tltd.v1.PolicyService/PushPolicy"

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MAX_VARINT = (1 << 64) - 1


def push_request_from_bytes(data: bytes) -> policy_pb2.PushPolicyRequest | d.TensorChunk:
    """A chunk-only message as a domain TensorChunk (data: a memoryview of `data`), any other
    message parsed by the protobuf runtime. DecodeError when the bytes do not decode."""
    view = memoryview(data)
    try:
        tag, pos = _varint(view, 0)
        if tag == (2 << 3) | _LEN:  # field 2 (chunk), length-delimited
            size, pos = _varint(view, pos)
            if pos + size == len(view):  # the only field
                chunk = _chunk(view[pos:])
                if chunk is not None:
                    return chunk
    except _Fallback:
        pass
    return policy_pb2.PushPolicyRequest.FromString(data)


class _Fallback(Exception):
    """Not the plain chunk this reader handles: let the protobuf runtime decide."""


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise _Fallback
        b = view[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            if value > _MAX_VARINT:
                raise _Fallback
            return value, pos
        shift += 7


def _chunk(view: memoryview) -> d.TensorChunk | None:
    name, offset, length, data, delta, crc = "", 0, 0, view[:0], False, 0
    pos = 0
    while pos < len(view):
        tag, pos = _varint(view, pos)
        field, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, pos = _varint(view, pos)
            if field == 2:
                offset = value
            elif field == 3:
                length = value
            elif field == 5:
                delta = value != 0
            elif field == 6:
                crc = value & 0xFFFFFFFF  # a uint32 field keeps the low 32 bits
            else:
                raise _Fallback
        elif wire == _LEN:
            size, pos = _varint(view, pos)
            end = pos + size
            if end > len(view):
                raise _Fallback
            if field == 1:
                try:
                    name = str(view[pos:end], "utf-8")
                except UnicodeDecodeError:
                    raise _Fallback from None
            elif field == 4:
                data = view[pos:end]
            else:
                raise _Fallback
            pos = end
        else:
            raise _Fallback
    return d.TensorChunk(name, offset, length, data, delta, crc)
