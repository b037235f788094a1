"""What is never lost: runs the tests of issue 18's failure scenarios (signals C12, fork C13, oversized data C14,
backend pushback C15, calls before the handler C16, a killed collector C17, a collector down C03) and prints
one table row per scenario: what was sent (or acknowledged, for the collector), what the store holds, and what
zoomer-serve counted as lost (by reason), as the tests measured them against the real server, helper process
and collector.

    python benchmarks/never_lost.py            # the markdown table on stdout (about 3 minutes on 2 cores)

The tests assert these counts themselves; each writes its row through ``tests/_never_lost.py``
(``ZOOMER_NEVER_LOST_OUT``). A failing test fails this script (exit 1) after printing what it has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scenario_tests() -> list[str]:
    """The test files that write rows (those that import ``tests/_never_lost.py``), relative to the root."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "from _never_lost import" in p.read_text(encoding="utf-8"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.jsonl"
        files = scenario_tests()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                              cwd=ROOT, env=dict(os.environ, ZOOMER_NEVER_LOST_OUT=str(out)),
                              capture_output=True, text=True)
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print("| case | scenario | sent | stored | counted as lost |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in sorted(rows, key=lambda r: (r["case"], r["scenario"])):
        unit = "" if row["unit"] == "spans" else f" {row['unit']}"
        print(f"| {row['case']} | {row['scenario']} | {row['sent']}{unit} | {row['stored']}{unit} | "
              f"{row['counted_lost']}{unit} |")
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    print(f"\n{len(rows)} scenarios; pytest: {tail[0] if tail else proc.returncode}", file=sys.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], file=sys.stderr)
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
