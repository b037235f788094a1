"""The share rule: how a batch's figures (phase time, GPU memory, kernel time) are divided among its members.

Rule ``items`` (the default): a member's share is its items over the batch's items (a request of 32 candidates
in a batch of 128 candidates takes a quarter), the way the work of a batched forward pass grows with its rows.
Rule ``equal``: every member takes ``1 / size``, for batchers whose requests are alike or whose items are not
counted. A batch whose members all report 0 items falls back to ``equal``.

Integer figures (ns, bytes, counts) are split with the largest-remainder method (:func:`split_int`): each
member gets the floor of its exact share, and the units left over go to the largest remainders (ties to the
earlier member), so the members' parts add up to the batch's figure exactly. Float figures (µs of kernel time)
are split in proportion (:func:`split_float`), exact up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from zoomer_serve.config import ConfigError

RULE_ITEMS: Final = "items"
RULE_EQUAL: Final = "equal"
RULES: Final = (RULE_ITEMS, RULE_EQUAL)


def check_rule(rule: str) -> str:
    """Return ``rule`` when it is a share rule; raise ConfigError naming the valid ones otherwise."""
    if rule not in RULES:
        raise ConfigError(f"share_rule must be one of {', '.join(RULES)}, got {rule!r}")
    return rule


def weights(items: Sequence[int], rule: str) -> list[int]:
    """The members' weights under ``rule``: their items (``items``; all 1 when every member has 0 items) or 1
    each (``equal``). Negative items count as 0."""
    if rule == RULE_ITEMS:
        w = [i if i > 0 else 0 for i in items]
        if any(w):
            return w
    return [1] * len(items)


def fractions(w: Sequence[int]) -> list[float]:
    """Each weight over their sum (an empty or all-zero list gives equal fractions)."""
    total = sum(w)
    if total <= 0:
        return [1.0 / len(w)] * len(w) if w else []
    return [x / total for x in w]


def split_int(total: int, w: Sequence[int]) -> list[int]:
    """``total`` divided among ``w`` by the largest-remainder method: non-negative parts (for a non-negative
    total) that sum to ``total`` exactly. Raises ValueError for an empty ``w``."""
    if len(w) == 1:
        return [total]
    if not w:
        raise ValueError("cannot split among no members")
    wsum = sum(w)
    if wsum <= 0:
        w, wsum = [1] * len(w), len(w)
    sign = -1 if total < 0 else 1
    magnitude = abs(total)
    parts = [magnitude * x // wsum for x in w]
    left = magnitude - sum(parts)
    if left:
        order = sorted(range(len(w)), key=lambda i: (-(magnitude * w[i] % wsum), i))
        for i in order[:left]:
            parts[i] += 1
    return [sign * p for p in parts]


def split_float(total: float, w: Sequence[int]) -> list[float]:
    """``total`` divided in proportion to ``w`` (equal parts when the weights sum to 0)."""
    return [total * f for f in fractions(w)]
