"""Bad input found by trying the project as a new user: each case is answered at once, clearly, without a
traceback and without side effects."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys

import pytest


def test_collector_answers_a_huge_declared_body_at_once(collector):
    """A client that declares gigabytes and sends one byte gets 413 without the collector waiting for the
    body (it used to drain until its 30 s idle timeout); the next request is served."""
    with socket.create_connection(("127.0.0.1", collector.collector.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 99999999999\r\n\r\nx")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413")
    with socket.create_connection(("127.0.0.1", collector.collector.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 0\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


@pytest.mark.slow
def test_report_on_a_sqlite_file_does_not_reach_for_the_network(tmp_path):
    """DuckDB would try to download its sqlite extension to read such a file; zoomer-serve turns that off."""
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "report", "--store", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "download" not in proc.stderr.lower() and "Traceback" not in proc.stderr
    assert str(path) in proc.stderr


@pytest.mark.slow
def test_report_on_a_duckdb_file_with_other_columns_says_so(tmp_path):
    import duckdb

    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE spans (x INTEGER)")
    con.close()
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "report", "--store", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is not a zoomer-serve store" in proc.stderr


@pytest.mark.parametrize("command", ["report", "analyze"])
@pytest.mark.parametrize("content", [b"", b"not a database\n"])
def test_a_store_that_is_not_duckdb_is_called_that_without_the_collector_hint(tmp_path, command, content):
    """An empty or non-DuckDB file given as the store: exit 2, one line that says it is not a DuckDB file; the
    hint about a collector still writing it is for a lock conflict only, where it is true."""
    path = tmp_path / "notes.duckdb"
    path.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "zoomer_serve", command, "--store", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], proc.stderr
    assert "not a DuckDB" in lines[0] and "collector" not in lines[0], lines[0]


@pytest.mark.slow
def test_a_store_a_collector_process_holds_gets_the_collector_hint(tmp_path):
    """The store of a collector running in another process is locked for writing: the one line says so."""
    from _collector_process import start_collector

    collector = start_collector(tmp_path / "held.duckdb")
    try:
        proc = subprocess.run([sys.executable, "-m", "zoomer_serve", "report", "--store", str(collector.store)],
                              capture_output=True, text=True, timeout=60)
    finally:
        collector.kill()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is a collector still running on it?" in proc.stderr and "not a DuckDB" not in proc.stderr


@pytest.mark.parametrize("command", [["report", "--store"], ["analyze", "--store"], ["fleet", "analyze"]])
@pytest.mark.parametrize("location, message", [("", "is empty"),
                                               ("ftp://zoomer-test.invalid/x", "cannot ")])
def test_an_empty_or_unreachable_store_location_is_one_line(command, location, message, capsys):
    """``--store ""`` gave a ConfigError traceback (report, fleet) and an unreachable URL a socket.gaierror
    traceback (report) or an "internal error" (analyze): each is exit 2 with one line naming it."""
    from zoomer_serve.cli import main

    assert main([*command, location]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err
    assert message in err and location in err, err


@pytest.mark.parametrize("where, message", [("store-under-file", "cannot make the store's folder"),
                                            ("html-missing-folder", "does not exist"),
                                            ("html-folder", "is a folder")])
def test_demo_refuses_outputs_it_cannot_write_before_the_load(tmp_path, where, message, capsys):
    """A store under a file gave a FileExistsError traceback; an HTML report in a missing folder (or a folder
    as its name) was found only after the whole load ran, and the demo still exited 0."""
    from zoomer_serve.cli import main

    (tmp_path / "afile").write_text("x")
    args = {"store-under-file": ["--store", str(tmp_path / "afile" / "s.duckdb")],
            "html-missing-folder": ["--store", str(tmp_path / "s.duckdb"), "--html", str(tmp_path / "no" / "r.html")],
            "html-folder": ["--store", str(tmp_path / "s.duckdb"), "--html", str(tmp_path)]}[where]
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "s.duckdb").exists()  # nothing started
