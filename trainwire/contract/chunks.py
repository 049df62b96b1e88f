"""The export stream's chunks, encoded and decoded by hand.

Building, serializing and parsing a 1 MiB FileChunk through the protobuf runtime copies its bytes
four times, which halves the download throughput. Chunks are therefore encoded and decoded here,
to the very bytes ``ExportWeightsResponse(chunk=FileChunk(...)).SerializeToString()`` gives
(tests compare the two), with one copy to send and none to receive.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwire.v1 import session_pb2 as pb

_CHUNK_FIELD = b"\x12"  # ExportWeightsResponse.chunk: field 2, length-delimited
_PATH_FIELD, _OFFSET_FIELD, _DATA_FIELD = 0x0A, 0x10, 0x1A  # FileChunk fields 1, 2 and 3


@dataclass(frozen=True)
class RawChunk:
    """A decoded ``FileChunk`` whose ``data`` is a zero-copy view into the received message."""

    path: str
    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(buffer: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def encode_chunk(path: str, offset: int, data: bytes | memoryview) -> bytes:
    """The serialized ``ExportWeightsResponse`` carrying one chunk."""
    name = path.encode()
    inner = bytearray()
    if name:
        inner += bytes([_PATH_FIELD]) + _varint(len(name)) + name
    if offset:
        inner += bytes([_OFFSET_FIELD]) + _varint(offset)
    if data:
        inner += bytes([_DATA_FIELD]) + _varint(len(data))
    header = _CHUNK_FIELD + _varint(len(inner) + len(data)) + inner
    return b"".join((header, data))


def decode_export_item(message: bytes) -> pb.ExportWeightsResponse | RawChunk:
    """A serialized ``ExportWeightsResponse``: chunks as ``RawChunk``, other items parsed."""
    view = memoryview(message)
    if view[:1] == _CHUNK_FIELD:
        length, at = _read_varint(view, 1)
        if at + length == len(view):
            chunk = _decode_chunk_fields(view, at)
            if chunk is not None:
                return chunk
    return pb.ExportWeightsResponse.FromString(message)


def _decode_chunk_fields(view: memoryview, at: int) -> RawChunk | None:
    path, offset, data = "", 0, view[0:0]
    while at < len(view):
        tag = view[at]
        if tag == _OFFSET_FIELD:
            offset, at = _read_varint(view, at + 1)
        elif tag in (_PATH_FIELD, _DATA_FIELD):
            length, at = _read_varint(view, at + 1)
            if tag == _PATH_FIELD:
                path = bytes(view[at : at + length]).decode()
            else:
                data = view[at : at + length]
            at += length
        else:
            return None  # anything unexpected goes through the protobuf runtime
    return RawChunk(path, offset, data)


def serialize_export_item(item: pb.ExportWeightsResponse | bytes) -> bytes:
    """The ExportWeights response serializer: pre-encoded chunks pass through."""
    return item if isinstance(item, bytes) else item.SerializeToString()
