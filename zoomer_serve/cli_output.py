"""How the commands that print tables (``report``, ``analyze``, ``fleet analyze``, ``loadtest``, ``demo``) print
them: ``--format table|markdown|csv|json``.

The renderers build ``rich`` tables and print them, with any lines of prose between, to a console.
:class:`TableOutput` stands in for that console and writes them in the chosen format:

- ``table`` (default): rich tables. On a terminal they fit its width; when stdout is not a terminal (a pipe,
  a file, CI logs) a table is as wide as its widest row, so no cell is ever wrapped or cut, and a line of
  text stays one line.
- ``markdown``: a ``## heading`` per section, each table as ``**title**`` and a pipe table
  (``|`` in a cell written as ``\\|``), prose lines as paragraphs.
- ``csv``: one block per table: a row holding only the table's title, the header row, the data rows; blocks
  are separated by one empty line. Prose lines go to stderr, so stdout is only the tables.
- ``json``: one object ``{"tables": [...], "notes": [...]}``; each table is ``{"section", "title",
  "columns", "rows"}`` with one object per row (column -> value). Cells are the values shown: numbers as
  JSON numbers (thousands separators removed), ``-`` as null, anything else (``12.5%``, ``OK 50``) a string.

``demo`` and ``loadtest`` send their progress lines (and locust's output) to stderr in the markdown, csv and
json formats, so that stdout holds only the results.

Every format holds the cells the table shows, whole (names are never cut to fit a width); the analysis tables
show short kernel names, as on the terminal (``--json`` holds the full ones).
"""

from __future__ import annotations

import csv
import json
import re
import sys
from typing import IO, Any

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

FORMATS = ("table", "markdown", "csv", "json")
PANEL_TITLE_MARGIN = 6
"""Columns a panel needs around its title: the corners, a rule piece and a space on each side."""
FORMAT_HELP = ("how to print the tables: table (rich; as wide as the widest row when stdout is not a terminal, "
               "never wrapped), markdown (pipe tables), csv (per table: a title row, the header row, the data "
               "rows; tables separated by an empty line; other lines to stderr) or json (one object: "
               '{"tables": [{"section", "title", "columns", "rows": [{column: value}]}], "notes": [lines]}) '
               "(default table)")


def add_format_option(parser: Any) -> None:
    """Add ``--format`` (:data:`FORMATS`, default ``table``) to an argparse parser."""
    parser.add_argument("--format", choices=FORMATS, default="table", help=FORMAT_HELP)


def plain(value: Any) -> str:
    """The text of a title, header or cell (str, rich Text, or anything else via ``str``)."""
    if value is None:
        return ""
    if isinstance(value, Text):
        return value.plain
    return str(value)


_NUMBER = re.compile(r"-?\d{1,3}(,\d{3})*(\.\d+)?|-?\d+(\.\d+)?")


def json_value(cell: str) -> Any:
    """A shown cell as a JSON value: ``"1,234.5"`` -> 1234.5, ``"12"`` -> 12, ``"-"`` or ``""`` -> None,
    anything else unchanged."""
    text = cell.strip()
    if text in ("", "-"):
        return None
    if _NUMBER.fullmatch(text):
        number = text.replace(",", "")
        return float(number) if "." in number else int(number)
    return cell


class TableOutput:
    """A stand-in for the ``rich.console.Console`` the renderers print to (``print`` and ``rule``), writing
    ``format`` (one of :data:`FORMATS`) to ``file`` (default stdout). Call :meth:`close` at the end: csv and
    json are written then. ``console`` is the rich console for the ``table`` format (default: one on
    ``file``)."""

    def __init__(self, format: str = "table", file: IO[str] | None = None, console: Console | None = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        self.format = format
        self.file = file
        self.console = console or Console(file=file)
        self.tables: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._section = ""

    @property
    def out(self) -> IO[str]:
        return self.file or sys.stdout

    @property
    def is_terminal(self) -> bool:
        return self.format == "table" and self.console.is_terminal

    # -- the Console methods the renderers use ---------------------------------------------------------------
    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.format == "table":
            self._print_rich(*objects, **kwargs)
            return
        for obj in objects:
            if isinstance(obj, Table):
                self._table(obj)
            elif isinstance(obj, (str, Text)):
                self._note(_markup_free(obj))
            elif isinstance(obj, Rule):
                self.rule(obj.title)
        if not objects:
            self._note("")

    def rule(self, title: Any = "", **kwargs: Any) -> None:
        if self.format == "table":
            self.console.rule(title, **kwargs)
            return
        self._section = plain(title)
        if self.format == "markdown":
            self.out.write(f"\n## {_md_text(self._section)}\n\n")

    def close(self) -> None:
        """Write what the csv and json formats collect; flush."""
        if self.format == "json":
            self.out.write(json.dumps({"tables": self.tables, "notes": self.notes}, indent=2) + "\n")
        self.out.flush()

    # -- table -------------------------------------------------------------------------------------------------
    def _print_rich(self, *objects: Any, **kwargs: Any) -> None:
        console = self.console
        widest = 0
        if not console.is_terminal and objects and all(isinstance(o, (str, Text)) for o in objects):
            kwargs.setdefault("soft_wrap", True)  # a line (a command to copy) stays one line
        elif not console.is_terminal:
            options = console.options.update_width(1 << 20)
            widest = max([Measurement.get(console, options, o).maximum for o in objects if isinstance(o, Table)]
                         + [cell_len(plain(o.title)) + PANEL_TITLE_MARGIN for o in objects
                            if isinstance(o, Panel) and o.title], default=0)
        if widest <= console.width:
            console.print(*objects, **kwargs)
            return
        width = console.width
        console.width = widest
        try:
            console.print(*objects, **kwargs)
        finally:
            console.width = width

    # -- markdown, csv, json -----------------------------------------------------------------------------------
    def _table(self, table: Table) -> None:
        title = plain(table.title)
        columns = [plain(c.header) for c in table.columns]
        cells = [[plain(cell) for cell in c.cells] for c in table.columns]
        rows = [list(r) for r in zip(*cells)] if cells else []
        caption = plain(table.caption)
        if self.format == "markdown":
            self._markdown(title, columns, rows, caption)
        elif self.format == "csv":
            self._csv(title, columns, rows)
            if caption:
                self._note(caption)
        else:
            entry: dict[str, Any] = {"section": self._section, "title": title, "columns": columns,
                                     "rows": [dict(zip(columns, map(json_value, r))) for r in rows]}
            if caption:
                entry["note"] = caption
            self.tables.append(entry)

    def _markdown(self, title: str, columns: list[str], rows: list[list[str]], caption: str) -> None:
        lines = [f"**{_md_text(title)}**", "", _md_row(columns), _md_row(["---"] * len(columns))]
        lines += [_md_row(r) for r in rows]
        if caption:
            lines += ["", _md_text(caption)]
        self.out.write("\n".join(lines) + "\n\n")

    def _csv(self, title: str, columns: list[str], rows: list[list[str]]) -> None:
        if self.tables:
            self.out.write("\r\n")
        writer = csv.writer(self.out)
        writer.writerow([f"{self._section}: {title}" if self._section else title])
        writer.writerow(columns)
        writer.writerows(rows)
        self.tables.append({"title": title})

    def _note(self, text: str) -> None:
        if self.format == "json":
            self.notes.append(text)
        elif self.format == "csv":
            print(text, file=sys.stderr)
        else:
            self.out.write(_md_text(text) + "\n\n" if text else "\n")


def _markup_free(obj: str | Text) -> str:
    """A printed line as plain text: rich markup in a str (``[bold]x[/]``) removed."""
    return obj.plain if isinstance(obj, Text) else Text.from_markup(obj).plain


def _md_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(_md_text(c) for c in cells) + " |"
