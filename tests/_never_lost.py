"""What the "nothing lost" tests counted, for ``benchmarks/never_lost.py``: each such test calls :func:`note` with
its scenario and its counts; when ``ZOOMER_NEVER_LOST_OUT`` names a file, a JSON line is appended to it (else
nothing happens). The tests assert the counts themselves; this only writes them down."""

from __future__ import annotations

import json
import os


def note(case: str, scenario: str, sent: int, stored: int, counted_lost: int = 0, unit: str = "spans") -> None:
    """Write down one scenario's counts: ``sent`` (what the test sent, or what was acknowledged), ``stored`` (what
    the store holds), ``counted_lost`` (what zoomer-serve counted as dropped, by reason)."""
    path = os.environ.get("ZOOMER_NEVER_LOST_OUT")
    if not path:
        return
    row = {"case": case, "scenario": scenario, "sent": sent, "stored": stored, "counted_lost": counted_lost,
           "unit": unit}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")
