"""The trace reader's work is linear in the input, whatever the whitespace. A 1 MB ``.json.gz`` holding an event
array of 1 GiB of spaces kept ``zoomer-serve analyze`` busy for minutes: each time a piece held no complete event,
the reader appended the next chunk to it and searched and copied it all again (64 MiB of spaces took 2.6 s, 256
MiB 23 s). Whitespace between the document's values is now dropped as it is read, and a piece that must grow (one
event larger than a chunk) doubles, so each decompressed byte is copied a bounded number of times: checked by
counting the bytes moved into the reader's buffer (no clock)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from zoomer_serve.analysis.trace_reader import EventChunks, read_bytes_opener

CHUNK = 64 << 10
WS = b" \n" * (2 << 20)  # 4 MiB of JSON whitespace
EVENT = b'{"ph":"X","name":"k","ts":1,"dur":2,"pid":1,"tid":1}'
BIG_EVENT = b'{"ph":"X",' + WS + b'"name":"big","ts":1,"dur":2,"pid":1,"tid":1}'

LAYOUTS = {
    "between the events": (b'{"traceEvents":[' + EVENT + b"," + WS + EVENT + b"," + WS + EVENT + b"]}", 3),
    "inside one event": (b'{"traceEvents":[' + EVENT + b"," + BIG_EVENT + b"," + EVENT + b"]}", 3),
    "before the document": (WS + b'{"traceEvents":[' + EVENT + b"]}", 1),
    "after the event array": (b'{"traceEvents":[' + EVENT + b"]" + WS + b', "displayTimeUnit":"ns"}', 1),
    "the whole event array": (b'{"traceEvents":[' + WS + b"]}", 0),
    "a bare array": (b"[" + WS + EVENT + b"," + WS + EVENT + b"]" + WS, 2),
    "before the closing bracket": (b'{"traceEvents":[' + EVENT + WS + b"]}", 1),
}


def _read(doc: bytes) -> tuple[EventChunks, list]:
    reader = EventChunks(Path("t.json.gz"), CHUNK, read_bytes_opener(gzip.compress(doc)))
    events = [event for chunk in reader for event in chunk]
    return reader, events


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_decompressed_byte_is_copied_a_bounded_number_of_times(layout: str) -> None:
    doc, count = LAYOUTS[layout]
    reader, events = _read(doc)
    assert len(events) == count and all(e["ph"] == "X" for e in events)
    notes = reader.notes
    assert notes.bytes_read == len(doc)
    assert notes.buffered_bytes <= 4 * len(doc), (notes.buffered_bytes, len(doc))


@pytest.mark.parametrize("layout", ["between the events", "before the document", "after the event array",
                                    "the whole event array", "a bare array"])
def test_whitespace_between_values_is_not_held_in_memory(layout: str) -> None:
    """Only an event larger than a chunk, or a run of whitespace between the last event and the array's ']'
    (read in linear time all the same), makes the reader hold more than about two chunks at once."""
    reader, _ = _read(LAYOUTS[layout][0])
    assert reader.notes.largest_piece_bytes <= 3 * CHUNK, reader.notes.largest_piece_bytes


def test_metadata_after_a_long_stretch_of_whitespace_is_kept() -> None:
    reader, _ = _read(LAYOUTS["after the event array"][0])
    assert reader.metadata == {"displayTimeUnit": "ns"}
