"""The numbers a benchmark script's options may take, checked in one place.

Each script lists its numeric options as :class:`Range` rows (``RANGES``) and parses its command line with
:func:`parse`: a number outside its row (NaN and infinities included) is refused with the parser's usage error,
exit status 2, naming the option and the value given, before anything runs. An explicit 0 is checked like any
other number, never taken for "use the default".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` for ``option`` (``low < value`` when ``low_open``: a duration must be more
    than 0)."""

    option: str
    low: float
    high: float
    low_open: bool = False

    @property
    def dest(self) -> str:
        """The attribute argparse stores the option's value in."""
        return self.option.lstrip("-").replace("-", "_")

    def admits(self, value: float) -> bool:
        above = self.low < value if self.low_open else self.low <= value
        return above and value <= self.high  # False for NaN

    def need(self) -> str:
        return f"{self.low:g} {'<' if self.low_open else '<='} {self.option} <= {self.high:g}"


def check(parser: argparse.ArgumentParser, args: argparse.Namespace, ranges: Sequence[Range]) -> None:
    """Refuse (``parser.error``: exit status 2) the first option whose value lies outside its range; an option
    left unset (None) is not checked."""
    for r in ranges:
        given = getattr(args, r.dest)
        if given is not None and not r.admits(given):
            parser.error(f"{r.option} {given:g} is out of range: need {r.need()}")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
          ranges: Sequence[Range]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then :func:`check`."""
    args = parser.parse_args(argv)
    check(parser, args, ranges)
    return args
