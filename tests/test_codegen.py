"""The committed ranker_pb2*.py files are exactly what codegen produces from ranker.proto."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip(
    "grpc_tools", reason="grpcio-tools (dev dependency) is not installed; cannot regenerate ranker_pb2*.py"
)

from zoomer_serve.demo import codegen


def _tool_versions() -> str:
    from importlib.metadata import version

    committed = (codegen.DEMO_DIR / "ranker_pb2_grpc.py").read_text(encoding="utf-8")
    made_with = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed)
    return (
        f"installed grpcio-tools {version('grpcio-tools')}, committed files made with "
        f"grpcio-tools {made_with.group(1) if made_with else '?'}"
    )


@pytest.mark.parametrize("name", codegen.GENERATED_NAMES)
def test_generated_file_matches_committed(tmp_path: Path, name: str) -> None:
    fresh = codegen.generate(tmp_path)
    assert [p.name for p in fresh] == list(codegen.GENERATED_NAMES)
    committed = codegen.DEMO_DIR / name
    assert committed.is_file(), f"{committed} is missing; run python -m zoomer_serve.demo.codegen"
    assert (tmp_path / name).read_bytes() == committed.read_bytes(), (
        f"{name} differs from a fresh protoc run ({_tool_versions()}); "
        "run python -m zoomer_serve.demo.codegen and commit the result"
    )


def test_grpc_module_imports_pb2_relatively() -> None:
    source = (codegen.DEMO_DIR / "ranker_pb2_grpc.py").read_text(encoding="utf-8")
    assert "from . import ranker_pb2 as ranker__pb2" in source
    assert not re.search(r"^import ranker_pb2", source, re.MULTILINE)


def test_make_imports_relative_only_touches_pb2_imports() -> None:
    source = "import grpc\nimport foo_pb2 as foo__pb2\nimport warnings\n"
    assert (
        codegen.make_imports_relative(source)
        == "import grpc\nfrom . import foo_pb2 as foo__pb2\nimport warnings\n"
    )


def test_check_mode_reports_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    assert codegen.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_check_mode_flags_stale_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    codegen.generate(tmp_path)
    (tmp_path / "ranker_pb2.pyi").write_text("# edited\n", encoding="utf-8")
    assert codegen.main(["--check", "--out", str(tmp_path)]) == 1
    assert "ranker_pb2.pyi" in capsys.readouterr().err


def test_the_pprof_messages_are_generated_from_profile_proto() -> None:
    """zoomer_serve/host/profile_pb2.py(i) are what ``python -m zoomer_serve.host.codegen`` writes (messages
    only: no grpc module), and the message is perftools.profiles.Profile, as pprof readers expect."""
    from zoomer_serve.host import codegen as host_codegen
    from zoomer_serve.host import profile_pb2

    assert host_codegen.stale_files() == []
    assert host_codegen.GENERATED_NAMES == ("profile_pb2.py", "profile_pb2.pyi")
    assert profile_pb2.Profile.DESCRIPTOR.full_name == "perftools.profiles.Profile"
    fields = {f.name: f.number for f in profile_pb2.Profile.DESCRIPTOR.fields}
    assert fields["sample"] == 2 and fields["string_table"] == 6 and fields["period"] == 12
