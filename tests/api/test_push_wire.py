"""PushPolicy chunks encoded by the client and decoded by the daemon without the protobuf
runtime agree with it: the same message either way, and the same errors."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from tltd import domain as d
from tltd.api.convert import push_part_from_pb
from tltd.api.push_wire import push_request_from_bytes
from tltd.v1 import policy_pb2
from tltd_clients.push import _Chunk

CASES = [
    _Chunk("model.layers.0.mlp.up_proj.weight", 0, 5, b"\x00\x01\x02\x03\x04", False, 0),
    _Chunk("lm_head.weight", 1 << 40, 3, memoryview(b"abcdef")[2:5], False, 0xFFFFFFFF),
    _Chunk("é/名", 300, 4096, b"\x28\xb5\x2f\xfd" * 10, True, 0x1234),
    _Chunk("x", 0, 0, b"", False, 0),
]


@pytest.mark.parametrize("chunk", CASES, ids=range(len(CASES)))
def test_client_bytes_are_the_protobuf_message_and_the_daemon_reads_them_back(chunk):
    wire = chunk.request_bytes()
    want = policy_pb2.PushPolicyRequest(chunk=chunk.message())
    assert policy_pb2.PushPolicyRequest.FromString(wire) == want
    got = push_request_from_bytes(wire)
    assert isinstance(got, d.TensorChunk)
    assert got == d.TensorChunk(
        chunk.name, chunk.offset, chunk.length, bytes(chunk.data), chunk.delta, chunk.crc32c
    )
    assert isinstance(got.data, memoryview)  # no copy of the data
    # What the protobuf runtime serializes (zero fields left out) reads the same.
    assert push_request_from_bytes(want.SerializeToString()) == push_part_from_pb(want)


def test_other_messages_go_to_the_protobuf_runtime():
    header = policy_pb2.PushPolicyRequest(header=policy_pb2.PushHeader(job_id="j", update_id="u"))
    commit = policy_pb2.PushPolicyRequest(commit=True)
    for m in (header, commit, policy_pb2.PushPolicyRequest()):
        assert push_request_from_bytes(m.SerializeToString()) == m
    # A chunk with a field this reader does not know (a newer client): the runtime keeps it.
    wire = CASES[0].request_bytes()
    extra = wire[:1] + bytes([wire[1] + 2]) + wire[2:] + b"\x38\x01"  # field 7 = 1
    got = push_request_from_bytes(extra)
    assert isinstance(got, policy_pb2.PushPolicyRequest) and got.chunk.name == CASES[0].name


@pytest.mark.parametrize(
    "wire",
    [
        CASES[0].request_bytes()[:-2],  # truncated data
        b"\x12\x05\x0a\x03\xff\xfe\xfd",  # a name that is not UTF-8
        b"\x12\x0b\x10" + b"\xff" * 10,  # a varint that does not end
    ],
)
def test_bytes_that_do_not_decode_raise_the_runtime_error(wire):
    with pytest.raises(DecodeError):
        policy_pb2.PushPolicyRequest.FromString(wire)
    with pytest.raises(DecodeError):
        push_request_from_bytes(wire)
