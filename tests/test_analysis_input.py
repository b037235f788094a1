"""Odd but valid trace content (case C18): ``zoomer-serve analyze`` exits 0 with warnings that count what was
left out, or 2 with one line saying what is wrong, never a traceback. One test per kind of oddity on the real
A100 traces, then a seeded fuzz test that mutates them at random (bounded in cases and time)."""

from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from zoomer_serve.analysis import cli, kernel_breakdown
from zoomer_serve.analysis.kineto import load_trace, load_trace_bytes

KINETO = Path(__file__).resolve().parents[2] / "shared" / "data" / "kineto"
pytestmark = pytest.mark.skipif(not KINETO.is_dir(), reason=f"real Kineto traces not found at {KINETO}")
EVENT_SYNC = KINETO / "a100_cuda_event_sync.json.gz"
ALEXNET = KINETO / "a100_alexnet_inference.json.gz"
FUZZ_SEED = 18
FUZZ_CASES = 300
FUZZ_BUDGET_S = 150.0


def doc_of(path: Path) -> dict[str, Any]:
    return json.loads(gzip.decompress(path.read_bytes()))


def run_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["analyze", *argv])
    code = cli.run(args, Console(file=io.StringIO(), width=120))
    out, err = capsys.readouterr()
    return code, out, err


def check_contract(code: int, out: str, err: str) -> None:
    """The C18 contract: exit 0 (valid JSON on stdout) or exit 2 with exactly one line naming the problem;
    never a traceback, never an internal error."""
    assert "Traceback" not in out + err
    assert "internal error" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("zoomer-serve analyze: "), err
    else:
        json.loads(out)
        for line in err.strip().splitlines():
            assert line.startswith("zoomer-serve analyze: warning: "), line


def kernels_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]


@pytest.mark.parametrize("name, shown", [(None, ""), (42, "42"), (1.5, "1.5"), ({"op": [1, 2]}, '{"op":[1,2]}'),
                                         (["a", None], '["a",null]'), (True, "true")])
def test_names_that_are_not_strings_become_their_json_text(tmp_path: Path, capsys: Any, name: Any,
                                                           shown: str) -> None:
    doc = doc_of(ALEXNET)
    ks = kernels_of(doc)
    ks[0]["name"] = name
    cpu = next(e for e in doc["traceEvents"] if e.get("cat") == "cpu_op")
    cpu["name"] = name
    path = tmp_path / "names.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert shown in trace.kernels["name"].tolist() and shown in trace.cpu_ops["name"].tolist()
    assert len(trace.kernels) == len(ks)
    assert any("2 event(s) had a name that is not a string" in w for w in trace.warnings)
    code, out, err = run_cli([str(path), "--json"], capsys)
    check_contract(code, out, err)
    assert code == 0 and "name that is not a string" in err


def test_nan_and_infinity_are_read_and_their_events_left_out(tmp_path: Path, capsys: Any) -> None:
    """``NaN`` / ``Infinity`` are not JSON but Python's json writes them: the file is read leniently, an
    event whose ``ts`` or ``dur`` is not finite is left out of every figure and counted, a NaN occupancy
    is just unknown."""
    doc = doc_of(ALEXNET)
    ks = kernels_of(doc)
    ks[0]["dur"] = float("nan")
    ks[1]["ts"] = float("inf")
    ks[2]["dur"] = float("-inf")
    ks[3]["args"]["est. achieved occupancy %"] = float("nan")
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(doc))  # writes NaN, Infinity, -Infinity
    assert b"NaN" in path.read_bytes() and b"Infinity" in path.read_bytes()
    trace = load_trace(path)
    assert len(trace.kernels) == len(ks) - 3
    assert trace.reading.lenient_pieces >= 1
    assert any("3 kernels event(s) with a NaN, infinite or out-of-range ts / dur left out" in w for w in trace.warnings), \
        trace.warnings
    expected = sum(k["dur"] for k in ks[3:])
    assert float(kernel_breakdown(trace, include_memops=False)["total_us"].sum()) == pytest.approx(expected)
    code, out, err = run_cli([str(path), "--json"], capsys)
    check_contract(code, out, err)
    assert code == 0


def test_negative_and_zero_durations_are_counted_left_out_and_reported_once(tmp_path: Path, capsys: Any) -> None:
    doc = doc_of(ALEXNET)
    ks = kernels_of(doc)
    for k in ks[:3]:
        k["dur"] = -k["dur"]
    for k in ks[3:5]:
        k["dur"] = 0
    cpu = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    cpu[0]["dur"] = -1.0
    path = tmp_path / "durations.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert len(trace.kernels) == len(ks) - 5
    assert float(trace.kernels["dur"].min()) > 0
    assert len(trace.cpu_ops) == len(cpu) - 1  # zero-duration CPU events stay: sub-microsecond calls
    code, out, err = run_cli([str(path), "--json"], capsys)
    check_contract(code, out, err)
    lines = err.strip().splitlines()
    assert sum("3 kernels event(s) with a negative duration" in line for line in lines) == 1
    assert sum("2 kernels event(s) with zero duration" in line for line in lines) == 1
    assert sum("1 cpu ops event(s) with a negative duration" in line for line in lines) == 1
    assert json.loads(out)["traces"][0]["summary"]["warnings"] == trace.warnings


def test_items_that_are_not_trace_events_are_counted_and_reported_once(tmp_path: Path, capsys: Any) -> None:
    """C18: items of the event array that are no trace event (a number, a string, null, an array, an object
    without a "ph") were skipped without a word, where the README says odd content is left out with a warning."""
    doc = doc_of(ALEXNET)
    doc["traceEvents"][5:5] = [1, "x", None, [2], {"name": "no phase"}, {"ph": ""}]
    path = tmp_path / "not_events.json"
    path.write_text(json.dumps(doc))
    code, out, err = run_cli([str(path), "--json"], capsys)
    check_contract(code, out, err)
    lines = [line for line in err.strip().splitlines() if "not trace events" in line]
    assert lines == [f"zoomer-serve analyze: warning: {path}: 6 item(s) of the event array are not trace events "
                     "(not a JSON object, or without a \"ph\" phase) and were skipped"], err
    assert load_trace(path).warnings == json.loads(out)["traces"][0]["summary"]["warnings"]


def _reorder(event: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """The event with nested objects first and the other keys shuffled."""
    keys = list(event)
    rnd.shuffle(keys)
    keys.sort(key=lambda k: not isinstance(event[k], (dict, list)))
    return {k: event[k] for k in keys}


def test_key_order_does_not_change_tables_or_parsing_work(tmp_path: Path) -> None:
    """Events whose nested objects come before their last key: the same tables, and no more parses of
    pieces than with Kineto's order (each failed cut inside an event costs a parse of a whole piece; they
    used to make such a trace load 20x slower)."""
    doc = doc_of(ALEXNET)
    rnd = random.Random(3)
    reordered = {**doc, "traceEvents": [_reorder(e, rnd) for e in doc["traceEvents"]]}
    a, b = tmp_path / "kineto_order.json", tmp_path / "nested_first.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps(reordered))
    ta, tb = load_trace(a, chunk_bytes=16 << 10), load_trace(b, chunk_bytes=16 << 10)
    for table in ("kernels", "memops", "runtime", "cpu_ops", "annotations", "syncs", "flows"):
        ca, cb = getattr(ta, table), getattr(tb, table)
        assert len(ca) == len(cb) > 0 or table == "syncs", table
        for col in ca.column_names:
            assert ca[col].tolist() == cb[col].tolist() or col in ("occupancy", "blocks_per_sm", "warps_per_sm"), \
                (table, col)
    pieces = a.stat().st_size // (16 << 10)
    assert ta.reading.parse_attempts <= pieces + 2
    assert tb.reading.parse_attempts <= ta.reading.parse_attempts + 2


@pytest.mark.parametrize("raw", [True, False])
def test_control_characters_in_strings(tmp_path: Path, capsys: Any, raw: bool) -> None:
    """Escaped control characters are valid JSON; raw ones are not (read leniently). Either way the names
    keep them, and the terminal summary shows them as control pictures, not as terminal commands."""
    doc = doc_of(ALEXNET)
    ks = kernels_of(doc)
    ks[0]["name"] = "evil\x1b[31mred\x07"
    ks[0]["dur"] = 10**6  # the top kernel, so the summary prints it
    text = json.dumps(doc)
    if raw:
        text = text.replace("\\u001b", "\x1b").replace("\\u0007", "\x07")
    path = tmp_path / "ctrl.json"
    path.write_text(text)
    trace = load_trace(path)
    assert "evil\x1b[31mred\x07" in trace.kernels["name"].tolist()
    assert (trace.reading.lenient_pieces > 0) == raw
    code, out, err = run_cli([str(path)], capsys)
    assert code == 0 and "Traceback" not in err
    buf = io.StringIO()
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    cli.run(parser.parse_args(["analyze", str(path)]), Console(file=buf, width=200))
    shown = buf.getvalue()
    assert "\x1b[31m" not in shown and "\x07" not in shown and "evil␛[31mred␇" in shown


@pytest.mark.parametrize("compressed", [False, True])
def test_a_truncated_file_keeps_the_events_before_the_cut_and_says_so(tmp_path: Path, capsys: Any,
                                                                      compressed: bool) -> None:
    doc = doc_of(ALEXNET)
    text = json.dumps(doc).encode()
    events = doc["traceEvents"]
    # cut in the middle of an event about 70% into the array
    k = int(len(events) * 0.7)
    marker = json.dumps(events[k]).encode()
    at = text.index(marker) + len(marker) // 2
    data = gzip.compress(text)[: len(gzip.compress(text[:at]))] if compressed else text[:at]
    path = tmp_path / ("cut.json.gz" if compressed else "cut.json")
    path.write_bytes(data)
    trace = load_trace(path)
    assert trace.reading.truncated
    assert any(w.startswith("file cut short") for w in trace.warnings)
    kept = trace.event_count
    assert 0.6 * len(events) < kept <= k + (0 if not compressed else 0)
    if not compressed:
        assert kept == k  # every complete event before the cut, the cut one dropped
        assert f"after {at} bytes" in trace.reading.truncated
    code, out, err = run_cli([str(path), "--json"], capsys)
    check_contract(code, out, err)
    assert code == 0 and "file cut short" in err


@pytest.mark.parametrize("content, message", [
    (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1}, {"ph": ]}', "invalid JSON"),
    (b'{"traceEvents": [', "holds no Kineto/Chrome trace events"),
    (b'\x1f\x8b\x08\x00garbage', "cannot decompress"),
    (b'{"traceEvents": {"ph": "X"}}', 'no top-level "traceEvents" array'),
])
def test_unreadable_input_is_one_line_with_exit_2(tmp_path: Path, capsys: Any, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    code, out, err = run_cli([str(path)], capsys)
    check_contract(code, out, err)
    assert code == 2 and message in err


# ---- fuzz ------------------------------------------------------------------------------------------------

ODD_VALUES = (None, 0, -1, 1.5, float("nan"), float("inf"), float("-inf"), -1e300, 10**30, "", "7", "x\x01y",
              [], [1, {"a": None}], {}, {"nested": {"deep": [1, 2]}}, True)


def _odd(rnd: random.Random) -> Any:
    return copy.deepcopy(rnd.choice(ODD_VALUES))


def _mutate_event(e: Any, rnd: random.Random) -> Any:
    if not isinstance(e, dict) or rnd.random() < 0.03:
        return _odd(rnd)
    e = copy.deepcopy(e)
    for _ in range(rnd.randint(1, 3)):
        what = rnd.random()
        if what < 0.45:
            key = rnd.choice(["name", "ts", "dur", "pid", "tid", "cat", "ph", "args", "id", "bp", "s"])
            e[key] = _odd(rnd)
        elif what < 0.6 and isinstance(e.get("args"), dict) and e["args"]:
            e["args"][rnd.choice(list(e["args"]))] = _odd(rnd)
        elif what < 0.75 and e:
            del e[rnd.choice(list(e))]
        elif what < 0.9:
            e = _reorder(e, rnd)
        elif isinstance(e.get("dur"), (int, float)):
            e["dur"] = -abs(e["dur"]) if rnd.random() < 0.5 else 0
    return e


def _fuzz_bytes(doc: dict[str, Any], rnd: random.Random) -> bytes:
    events = list(doc["traceEvents"])
    for i in rnd.sample(range(len(events)), k=min(len(events), rnd.randint(1, 12))):
        events[i] = _mutate_event(events[i], rnd)
    if rnd.random() < 0.2:
        events.insert(rnd.randrange(len(events) + 1), _odd(rnd))
    out = {**doc, "traceEvents": events}
    if rnd.random() < 0.1:
        out["baseTimeNanoseconds"] = _odd(rnd) if rnd.random() < 0.7 else 1_790_857_026_000_000_000
    if rnd.random() < 0.1:
        out["deviceProperties"] = _odd(rnd)
    text = json.dumps(out, allow_nan=True)
    if rnd.random() < 0.5:
        text = json.dumps(out, allow_nan=True, indent=rnd.choice([None, 1]))
    if rnd.random() < 0.3:
        text = text.replace("\\u0001", "\x01")  # raw control characters
    data = text.encode()
    r = rnd.random()
    if r < 0.15:
        data = data[: rnd.randrange(1, len(data))]  # cut short
    elif r < 0.22:
        i = rnd.randrange(len(data))
        data = data[:i] + bytes([rnd.randrange(256)]) + data[i + 1:]  # one byte changed
    if rnd.random() < 0.3:
        data = gzip.compress(data)
        if rnd.random() < 0.3:
            data = data[: rnd.randrange(10, len(data))]
    return data


@pytest.mark.slow
def test_fuzzed_real_traces_never_crash(tmp_path: Path, capsys: Any) -> None:
    """C18 fuzz: FUZZ_CASES mutations (seed FUZZ_SEED) of the real A100 traces: names, times, ids, categories,
    phases and args replaced by null / numbers / NaN / infinities / huge values / objects / control
    characters, keys dropped or reordered, durations negative or zero, odd items in the event array, bad
    time bases and device properties, files cut short, bytes changed, gzip cut; counter samples included. Every run honours the C18
    contract (exit 0 with warnings and valid JSON, or exit 2 with one line); the merged timeline is written
    for the runs that load. Stops early (not failing) past FUZZ_BUDGET_S on a slow machine."""
    rnd = random.Random(FUZZ_SEED)
    docs = [doc_of(EVENT_SYNC), doc_of(ALEXNET)]
    t0 = docs[0]["traceEvents"][-1].get("ts", 0) or 0
    docs[0]["traceEvents"] += [{"ph": "C", "name": "GPU 0 Counters", "pid": 0, "tid": "GPU 0 Counters",
                                "ts": t0 + i, "args": {"sm__throughput": 1.5 * i, "dram": i}} for i in range(5)]
    deadline = time.monotonic() + FUZZ_BUDGET_S
    codes = {0: 0, 2: 0}
    for case in range(FUZZ_CASES):
        if time.monotonic() > deadline:
            break
        data = _fuzz_bytes(docs[case % len(docs)], rnd)
        path = tmp_path / f"case{case}.json"
        path.write_bytes(data)
        argv = [str(path), "--json"]
        if case % 5 == 0:
            argv += ["--perfetto", str(tmp_path / f"case{case}.pftrace")]
        code, out, err = run_cli(argv, capsys)
        try:
            check_contract(code, out, err)
        except AssertionError:
            (tmp_path.parent / f"c18-failing-case-{case}.json").write_bytes(data)
            raise
        codes[code] += 1
    assert codes[0] > 0  # most mutations leave a readable trace


def test_load_trace_bytes_and_files_agree_on_an_odd_trace() -> None:
    data = _fuzz_bytes(doc_of(ALEXNET), random.Random(7))
    t = load_trace_bytes(data)
    assert t.event_count > 0
    orjson.dumps(t.summary())


@pytest.mark.parametrize("tail", [b"]}", b"]}\n", b"] }", b'], "traceName": "t"}'])
def test_strict_json_that_ends_after_the_event_array_is_not_called_lenient(tmp_path: Path, capsys: Any,
                                                                          tail: bytes) -> None:
    """C18: a small, strict JSON trace read in one piece (the array closed by ``]}`` right after the last event)
    gets no warning about NaN / control characters: the trailing ``}`` is the end of the document, not odd
    content."""
    event = b'{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2, "pid": 0, "tid": 7}'
    path = tmp_path / "small.json"
    path.write_bytes(b'{"traceEvents": [' + event + b", " + event.replace(b'"ts": 1', b'"ts": 5') + tail)
    trace = load_trace(path)
    assert trace.reading.lenient_pieces == 0
    assert len(trace.kernels) == 2
    code, out, err = run_cli([str(path), "--json"], capsys)
    check_contract(code, out, err)
    assert code == 0 and "leniently" not in err, err


def test_a_profiles_folder_is_analysed_without_the_other_artifacts(tmp_path: Path, capsys: Any) -> None:
    """``analyze PROFILES_DIR`` failed (exit 2) on the session's ``.cpu.speedscope.json``: a serve-demo profiles
    folder also holds session summaries, CPU profiles and manifests, which are no traces."""
    trace = tmp_path / "s1.pt.trace.json.gz"
    trace.write_bytes(ALEXNET.read_bytes())
    for name in ("s1.summary.json", "s1.cpu.speedscope.json", "s1.pt.trace.json.gz.manifest.json"):
        (tmp_path / name).write_text('{"not": "a trace"}')
    (tmp_path / "mine.json").write_bytes(gzip.decompress(ALEXNET.read_bytes()))  # any other JSON: a trace
    assert cli.trace_files(tmp_path) == [tmp_path / "mine.json", trace]
    code, out, err = run_cli([str(tmp_path), "--json"], capsys)
    assert code == 0, err
    assert [t["summary"]["path"] for t in json.loads(out)["traces"]] == [str(tmp_path / "mine.json"), str(trace)]
