"""Streaming reader of Chrome / Kineto trace JSON (plain or gzip): the ``traceEvents`` array in pieces of
parsed events, the other top-level keys, and notes on anything odd it met.

How it reads
------------
The decompressed text is read in pieces of about ``chunk_bytes`` and cut at an event boundary: a ``}``
followed by ``,`` and then ``{`` (whitespace allowed between them). Each piece is parsed with ``orjson`` and
handed on before the next is read, so memory stays at one piece plus what the caller keeps. A cut is only
accepted where the text before it parses as complete events; a cut that fell inside a string or inside an
array of objects fails at the very end of the piece and the previous boundary is tried. Requiring the ``{``
after the comma makes the key order of events irrelevant: with nested objects before an event's last key
(``{"args": {...}, "ph": "X"}``) every ``},`` inside an event would otherwise be a candidate cut, and each
failed candidate costs a parse of the whole piece.

Odd but valid input (case C18 of the project's failure cases)
-------------------------------------------------------------
- ``NaN``, ``Infinity``, ``-Infinity``, raw control characters in strings and invalid UTF-8 are not strict
  JSON, so ``orjson`` rejects them. A piece it rejects before its end is parsed again with the standard
  library's lenient decoder (``json.JSONDecoder(strict=False)``, which accepts all of them; invalid UTF-8
  bytes become U+FFFD). :attr:`ReadNotes.lenient_pieces` counts such pieces.
- A file cut short (a truncated gzip stream, or text that ends inside the event array) keeps every complete
  event read before the cut; :attr:`ReadNotes.truncated` says where it ended.
- Text that is broken in the middle (not JSON even for the lenient decoder) raises
  :class:`TraceFormatError` naming the byte offset.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

_WS = b" \t\r\n"
_LENIENT = json.JSONDecoder(strict=False)  # also accepts NaN / Infinity / -Infinity
_MAX_CUT_TRIES = 16
EXPECTED = ('expected a Kineto / Chrome trace: a JSON object with a "traceEvents" array (or a bare JSON array) '
            'of events, each an object with a "ph" phase')


class TraceFormatError(ValueError):
    """The file is not a Chrome / Kineto trace JSON (bad gzip, bad JSON, no ``traceEvents``, or no trace event
    at all); the message names the file and, for bad JSON, the byte offset in the decompressed text."""


@dataclass
class ReadNotes:
    """What the reader met besides plain events.

    Attributes:
        lenient_pieces: pieces that held NaN / Infinity, raw control characters or invalid UTF-8 and were
            parsed with the lenient decoder.
        truncated: "" for a complete file, else how it ended early (the events before the cut are kept).
        bytes_read: decompressed bytes read (bytes).
        parse_attempts: parses of candidate pieces (cuts that fell inside an event cost one more each).
        buffered_bytes: bytes moved into the reader's buffer, copies included (bytes): a small multiple of
            ``bytes_read`` for any input, the bound on the reader's work.
        largest_piece_bytes: the most decompressed bytes held at once (bytes): about two chunks, more only
            for an event larger than a chunk (whitespace between values is dropped as it is read).
    """

    lenient_pieces: int = 0
    truncated: str = ""
    bytes_read: int = 0
    parse_attempts: int = 0
    buffered_bytes: int = 0
    largest_piece_bytes: int = 0


def open_binary(path: Path) -> BinaryIO:
    """The file's decompressed bytes: gzip when it starts with the gzip magic bytes, else plain.

    Raises:
        OSError: it cannot be opened.
    """
    if is_gzip(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def is_gzip(path: Path) -> bool:
    """Whether the file starts with the gzip magic bytes.

    Raises:
        OSError: it cannot be opened.
    """
    with open(path, "rb") as probe:
        return probe.read(2) == b"\x1f\x8b"


def _gzip_or_unreadable(path: Path) -> bool:
    try:
        return is_gzip(path)
    except OSError:
        return True  # nothing to add about its name


def _byte_pos(text: str, pos: int) -> int:
    return len(text[:pos].encode("utf-8", "surrogateescape"))


def _clean_text(value: Any) -> Any:
    """``value`` with lone surrogates (invalid UTF-8 bytes kept by ``surrogateescape``, or ``\\udXXX`` escapes
    without their pair) replaced by U+FFFD, so that every string can be written as UTF-8 again."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, list):
        return [_clean_text(v) for v in value]
    if isinstance(value, dict):
        return {_clean_text(k): _clean_text(v) for k, v in value.items()}
    return value


class Malformed(ValueError):
    """A piece is not strict JSON; ``pos`` is the byte offset where parsing failed (its length when the text
    merely ended early)."""

    def __init__(self, pos: int, message: str = "") -> None:
        super().__init__(message or f"malformed JSON at byte {pos}")
        self.pos = pos


def orjson_decode(piece: bytes) -> Any:
    """``piece`` parsed with ``orjson``.

    Raises:
        Malformed: not strict JSON (the byte offset of the failure).
    """
    try:
        return orjson.loads(piece)
    except orjson.JSONDecodeError as exc:
        pos = exc.pos if piece.isascii() else len(piece.decode("utf-8", "replace")[:exc.pos].encode())
        raise Malformed(pos, str(exc)) from None


class _Lenient:
    """The lenient parse of one piece of bytes: ``value`` and ``end`` (bytes consumed) of its leading JSON
    value, or ``error`` (byte offset of the failure)."""

    def __init__(self, piece: bytes) -> None:
        try:
            text = piece.decode("utf-8")
            dirty = b"\\ud" in piece or b"\\uD" in piece  # escapes of surrogates, maybe unpaired
        except UnicodeDecodeError:
            text = piece.decode("utf-8", "surrogateescape")
            dirty = True
        self.value: Any = None
        self.end = -1
        self.error = -1
        self.ran_out = False  # the text ended before the value did (a cut, not broken text)
        try:
            value, end = _LENIENT.raw_decode(text)
        except json.JSONDecodeError as exc:
            self.error = _byte_pos(text, exc.pos)
            self.ran_out = exc.pos >= len(text) or exc.msg.startswith("Unterminated string")
            return
        except RecursionError:
            self.error = 0
            return
        self.value = _clean_text(value) if dirty else value
        self.end = _byte_pos(text, end) if dirty or not text.isascii() else end


class EventChunks:
    """Iterate over lists of parsed events; after exhaustion :attr:`metadata` holds the other top-level keys
    and :attr:`notes` what was odd.

    ``name`` names the input in error messages; ``opener`` returns its decompressed bytes; ``decode`` parses a
    piece of strict JSON into its value (a list of events), raising :class:`Malformed` (default: ``orjson``).
    """

    def __init__(self, name: Path, chunk_bytes: int, opener: Callable[[], BinaryIO],
                 decode: Callable[[bytes], Any] = orjson_decode) -> None:
        self.path = name
        self.chunk_bytes = max(1024, int(chunk_bytes))
        self.opener = opener
        self.decode = decode
        self.metadata: dict[str, Any] = {}
        self.notes = ReadNotes()
        self._consumed = 0  # decompressed bytes dropped from the front of the buffer
        self._eof = False

    def _error(self, what: str, exc: Exception | None = None, offset: int | None = None) -> TraceFormatError:
        where = f" near byte {offset}" if offset is not None else ""
        detail = f": {exc}" if exc is not None else ""
        return TraceFormatError(f"{self.path}: {what}{where}{detail}")

    def __iter__(self) -> Iterator[list[Any]]:
        try:
            fh = self.opener()
        except OSError as exc:
            raise FileNotFoundError(f"cannot read trace {self.path}: {exc}") from exc
        with fh:
            yield from self._chunks(fh)

    def _read(self, fh: BinaryIO, size: int) -> bytes:
        """Up to ``size`` more bytes; a damaged or cut gzip stream ends the input (noted) once something
        was read, and is an error before that."""
        if self._eof:
            return b""
        read1 = getattr(fh, "read1", fh.read)  # one read of the underlying stream at a time: a cut gzip
        parts: list[bytes] = []                # stream then loses nothing decompressed before the cut
        got = 0
        while got < size:
            try:
                data = read1(size - got)
            except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
                if self.notes.bytes_read + got == 0:
                    raise self._error("cannot decompress", exc) from exc
                self.notes.truncated = (f"the compressed stream ends early or is damaged after "
                                        f"{self.notes.bytes_read + got} decompressed bytes ({exc})")
                data = b""
            if not data:
                self._eof = True
                break
            parts.append(data)
            got += len(data)
        self.notes.bytes_read += got
        return b"".join(parts)

    def _grow(self, buf: bytes, fh: BinaryIO) -> bytes:
        """``buf`` and the next bytes of the input: as many as ``buf`` holds, a chunk at least, so that a piece
        that keeps growing (an event larger than a chunk) doubles and each byte is copied a bounded number of
        times."""
        out = buf + self._read(fh, max(self.chunk_bytes, len(buf)))
        self.notes.buffered_bytes += len(out)
        self.notes.largest_piece_bytes = max(self.notes.largest_piece_bytes, len(out))
        return out

    def _lstrip(self, buf: bytes) -> bytes:
        """``buf`` without its leading whitespace (insignificant between JSON values), counted as consumed."""
        rest = buf.lstrip(_WS)
        self._consumed += len(buf) - len(rest)
        return rest

    def _chunks(self, fh: BinaryIO) -> Iterator[list[Any]]:
        buf, array_format = self._find_events(fh)
        while True:
            buf = self._lstrip(buf)
            while not self._eof and len(buf) < self.chunk_bytes:
                buf = self._lstrip(self._grow(buf, fh))
            if self._eof:
                break
            cut = self._last_boundary(buf)
            if cut is None:  # no complete event yet (one event larger than a piece): read on
                buf = self._grow(buf, fh)
                continue
            events, rest, closed = cut
            yield events
            self._consumed += len(buf) - len(rest)
            buf = rest
            if closed:  # the array ended in this piece: the rest of the file is the top-level tail
                while not self._eof:
                    buf = self._grow(self._lstrip(buf), fh)
                self._after_array(buf, array_format, self._consumed)
                return
        yield self._tail(buf, array_format)

    def _find_events(self, fh: BinaryIO) -> tuple[bytes, bool]:
        """Read up to the start of the event array: (the text after its '[', whether the file is a bare
        array). Keys before ``traceEvents`` go to :attr:`metadata`."""
        buf = b""
        search_from = 0
        while True:
            head = self._lstrip(buf)  # whitespace before the document is dropped as it is read
            search_from = max(0, search_from - (len(buf) - len(head)))
            buf = head
            if head[:1] == b"[":
                self._consumed += 1
                return head[1:], True
            at = buf.find(b'"traceEvents"', search_from)
            if at >= 0:
                k = self._skip(buf, at + len(b'"traceEvents"'))
                k = self._skip(buf, k + 1) if k < len(buf) and buf[k] == 0x3A else k  # ':'
                if k >= len(buf) and not self._eof:  # the key's value is not read yet
                    buf = self._grow(buf, fh)
                    continue
                if k < len(buf) and buf[k] == 0x5B and self._top_level(buf[:k + 1]):  # '['
                    self._consumed += k + 1
                    return buf[k + 1:], False
                search_from = at + 1
                continue
            if self._eof:
                cut = f" ({self.notes.truncated})" if self.notes.truncated else ""
                if not buf.strip(_WS):
                    raise self._error("empty file" + cut)
                raise self._error(f"no top-level \"traceEvents\" array{cut}{self._why_not(buf)}: not a Chrome "
                                  f"trace JSON file ({EXPECTED})")
            search_from = max(0, len(buf) - 16)
            buf = self._grow(buf, fh)

    def _why_not(self, text: bytes) -> str:
        """What else is wrong with a whole file ``text`` that has no event array: a name ending in ``.gz`` that is
        not gzip, or text that is not JSON (with the parser's message); "" otherwise."""
        gz = ""
        if str(self.path).endswith(".gz") and not _gzip_or_unreadable(Path(self.path)):
            gz = " (the name ends in .gz but the file is not gzip)"
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            return f"{gz}; not JSON either ({exc})"
        return gz

    @staticmethod
    def _skip(buf: bytes, k: int) -> int:
        """The index of the first non-whitespace byte at or after ``k`` (``len(buf)`` when none)."""
        n = len(buf)
        while k < n and buf[k] in _WS:
            k += 1
        return k

    def _top_level(self, header: bytes) -> bool:
        """Whether ``header`` (up to and including the '[' after ``"traceEvents":``) is the start of a
        top-level object; its other keys go to :attr:`metadata`."""
        doc = self._loads(header + b"]}")
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            return False
        doc.pop("traceEvents")
        self.metadata = doc
        return True

    def _loads(self, text: bytes) -> Any:
        """``text`` parsed strictly, else leniently (counted), else None."""
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
        parsed = _Lenient(text)
        if parsed.error >= 0 or parsed.end != len(text):
            return None
        self.notes.lenient_pieces += 1
        return parsed.value

    def _candidates(self, buf: bytes, end: int) -> Iterator[tuple[int, int, bool]]:
        """Event boundaries before ``end``, last first: (index of the '}', index after the ',' or the ']',
        whether it is the ']' that closes the array). A '}' then ',' is one when a '{' or the end of ``buf``
        follows (the next event not read yet: what lies between is whitespace, not held on to); a '}' then
        ']' when the piece up to the '}' parses (checked by the caller)."""
        n = len(buf)
        while True:
            j = buf.rfind(b"}", 0, end)
            if j < 0:
                return
            end = j
            k = j + 1
            while k < n and buf[k] in _WS:
                k += 1
            if k < n and buf[k] == 0x5D:  # ']'
                yield j, k + 1, True
                continue
            if k >= n or buf[k] != 0x2C:  # ','
                continue
            m = k + 1
            while m < n and buf[m] in _WS:
                m += 1
            if m >= n or buf[m] == 0x7B:  # '{', or only whitespace up to the end of what was read
                yield j, k + 1, False

    def _last_boundary(self, buf: bytes) -> tuple[list[Any], bytes, bool] | None:
        """Parse ``buf`` up to its last event boundary: (events, rest, False); or, when the event array
        closes inside ``buf``, (events, what follows the array's ']', True). None when no boundary parses."""
        for tries, (j, after, closes) in enumerate(self._candidates(buf, len(buf))):
            if tries >= _MAX_CUT_TRIES:
                return None
            piece = b"[" + buf[:j + 1] + b"]"
            self.notes.parse_attempts += 1
            try:
                return self.decode(piece), buf[after:], closes
            except Malformed as exc:
                if exc.pos >= len(piece) - 2:
                    continue  # the cut fell inside a string or a nested array: try the previous boundary
                closed = self._closed(piece, exc.pos)
                if closed is not None:
                    return closed[0], buf[closed[1] - 1:], True
            parsed = _Lenient(piece)
            if parsed.error >= 0:
                if parsed.error >= len(piece) - 2 or self._cut_inside(piece, parsed.error):
                    continue
                raise self._error("invalid JSON", offset=self._consumed + max(0, parsed.error - 1),
                                  exc=ValueError("not JSON even with NaN, Infinity and control characters allowed"))
            if not isinstance(parsed.value, list):
                continue
            self.notes.lenient_pieces += 1
            if parsed.end == len(piece):  # complete events, but not strict JSON
                return parsed.value, buf[after:], closes
            # the event array closed inside the piece: parsed.end is just after its ']'
            return parsed.value, buf[parsed.end - 1:], True
        return None

    def _closed(self, piece: bytes, pos: int) -> tuple[list[Any], int] | None:
        """(events, the offset just after the array's ']') when the event array closed before ``pos`` of
        ``piece`` (the failure is trailing text after a complete strict JSON array), else None."""
        end = piece.rfind(b"]", 0, pos + 1) + 1
        if end <= 0 or piece[end:pos].strip(_WS + b",") != b"":
            return None
        try:
            value = self.decode(piece[:end])
        except Malformed:
            return None
        return (value, end) if isinstance(value, list) else None

    def _after_array(self, rest: bytes, array_format: bool, at: int) -> None:
        """Parse what follows the closed event array: the remaining top-level keys (object format). ``at``: the
        offset of ``rest`` in the (decompressed) file, for the error messages."""
        at += len(rest) - len(rest.lstrip(_WS))
        rest = rest.strip(_WS)
        if array_format:
            if rest:
                raise self._error("unexpected content after the event array", offset=at)
            return
        body = rest[1:] if rest.startswith(b",") else rest
        at += len(rest) - len(body) - 1  # text[i] below is at + i in the file (its '{' stands for the comma)
        if body.strip(_WS) in (b"}", b""):
            if not body.strip(_WS):
                self.notes.truncated = self.notes.truncated or f"the file ends after the event array " \
                                                               f"({self.notes.bytes_read} bytes)"
            return
        text = b"{" + body
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            parsed = _Lenient(text)
            if parsed.error >= len(text) - 2:
                self.notes.truncated = self.notes.truncated or (
                    f"the file ends inside the keys after the event array ({self.notes.bytes_read} bytes read)")
                return
            if parsed.error >= 0 or parsed.end != len(text):
                where = parsed.error if parsed.error >= 0 else parsed.end
                raise self._error("invalid JSON after the event array", offset=at + where) from None
            self.notes.lenient_pieces += 1
            doc = parsed.value
        if not isinstance(doc, dict):
            raise self._error("the top level is not an object")
        self.metadata.update(doc)

    def _tail(self, buf: bytes, array_format: bool) -> list[Any]:
        """The last events, the closing ']' and (object format) the keys after the array; a file that ends
        inside the array keeps the complete events before the cut."""
        body = buf.rstrip(_WS)
        piece = b"[" + body
        try:
            events = self.decode(piece)
            if isinstance(events, list):
                if not array_format:  # an object whose closing '}' is missing
                    self._after_array(b"", array_format, self._consumed + len(buf))
                return events
        except Malformed as exc:
            closed = self._closed(piece, exc.pos) if exc.pos < len(piece) else None
            if closed is not None:
                self._after_array(piece[closed[1]:], array_format, self._consumed + closed[1] - 1)
                return closed[0]
        parsed = _Lenient(piece)
        if parsed.error < 0 and isinstance(parsed.value, list):
            self.notes.lenient_pieces += 1
            self._after_array(piece[parsed.end:], array_format, self._consumed + parsed.end - 1)
            return parsed.value
        if parsed.error >= 0 and not parsed.ran_out:
            raise self._error("invalid JSON", offset=self._consumed + max(0, parsed.error - 1),
                              exc=ValueError("not JSON even with NaN, Infinity and control characters allowed"))
        return self._truncated_events(buf)

    def _cut_inside(self, piece: bytes, error: int) -> bool:
        """Whether a parse failure at ``error`` lies in the last event of ``piece`` (after its last event
        boundary): a cut that fell inside a nested value of that event."""
        last = next(self._candidates(piece, len(piece)), None)
        return last is None or error > last[0]

    def _truncated_events(self, buf: bytes) -> list[Any]:
        """The file ends inside the event array: the complete events before the last boundary."""
        events: list[Any] = []
        cut = self._last_boundary(buf + b",{")  # a sentinel boundary after the last complete event
        if cut is not None:
            events = cut[0]
        else:
            body = buf.rstrip(_WS).rstrip(b",")
            single = _Lenient(b"[" + body + b"]")
            if single.error < 0 and isinstance(single.value, list):
                events = single.value
        self.notes.truncated = self.notes.truncated or (
            f"the file ends inside the event array after {self.notes.bytes_read} bytes: {len(events)} complete "
            f"event(s) of the last piece kept, the unfinished one dropped")
        return events


def read_bytes_opener(data: bytes) -> Callable[[], BinaryIO]:
    """An opener for :class:`EventChunks` over bytes in memory (gzip is decompressed as a stream)."""
    import io

    def opener() -> BinaryIO:
        raw = io.BytesIO(data)
        if data[:2] == b"\x1f\x8b":
            return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
        return raw

    return opener
