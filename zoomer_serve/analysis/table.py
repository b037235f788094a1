"""A small columnar table: named NumPy columns of equal length, with units.

Trace tables (:mod:`zoomer_serve.analysis.kineto`) and analyzer results are :class:`Table` objects. They
hold one NumPy array per column (numbers as int64 / float64 / bool, text as ``object`` arrays of ``str``), so
a 100k-event trace costs a few MB and every analysis is vectorised. There is no pandas dependency.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Table:
    """Columns of equal length.

    Attributes:
        name: what the table holds, e.g. ``"kernels"`` or ``"gpu_utilization"``.
        columns: column name -> 1-D NumPy array (all of the same length, in display order).
        units: column name -> unit (``"us"``, ``"bytes"``, ``"GB/s"``, ``"%"``, ``"ratio"``); absent = none.
        description: one line saying what a row is and where the figures come from.

    Raises:
        ValueError: columns of different lengths.
    """

    name: str
    columns: dict[str, np.ndarray]
    units: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        lengths = {k: len(v) for k, v in self.columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"table {self.name!r}: columns differ in length: {lengths}")

    @classmethod
    def from_rows(cls, name: str, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                  units: Mapping[str, str] | None = None, description: str = "",
                  dtypes: Mapping[str, Any] | None = None) -> Table:
        """Build a table from row tuples in the order of ``columns``; ``dtypes`` forces a column's dtype
        (otherwise NumPy infers it; text becomes ``object``)."""
        rows = list(rows)
        dtypes = dtypes or {}
        cols: dict[str, np.ndarray] = {}
        for i, col in enumerate(columns):
            values = [r[i] for r in rows]
            dtype = dtypes.get(col)
            if dtype is None and values and all(isinstance(v, str) for v in values):
                dtype = object
            if dtype is None and not values:
                dtype = float
            arr = np.array(values, dtype=dtype)
            if arr.dtype.kind == "U":
                arr = arr.astype(object)
            cols[col] = arr
        return cls(name, cols, dict(units or {}), description)

    def __len__(self) -> int:
        for v in self.columns.values():
            return len(v)
        return 0

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    def __contains__(self, column: object) -> bool:
        return column in self.columns

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def take(self, index: np.ndarray | Sequence[int] | slice) -> Table:
        """Rows selected by an index array, a boolean mask or a slice (a new table; arrays are copies
        for index arrays and masks, views for slices)."""
        return Table(self.name, {k: v[index] for k, v in self.columns.items()}, dict(self.units),
                     self.description)

    def sort(self, column: str, descending: bool = False) -> Table:
        """Rows ordered by ``column`` (stable)."""
        order = np.argsort(self.columns[column], kind="stable")
        if descending:
            order = order[::-1]
        return self.take(order)

    def head(self, n: int) -> Table:
        return self.take(slice(0, n))

    def rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Rows as dicts of plain Python values (NaN becomes None), at most ``limit`` of them."""
        n = len(self) if limit is None else min(limit, len(self))
        cols = {k: v[:n].tolist() for k, v in self.columns.items()}
        out = []
        for i in range(n):
            out.append({k: _plain(vals[i]) for k, vals in cols.items()})
        return out

    def to_dict(self, limit: int | None = None) -> dict[str, Any]:
        """A JSON-ready dict: name, description, columns, units, rows (at most ``limit``), row count."""
        return {"name": self.name, "description": self.description, "columns": self.column_names,
                "units": dict(self.units), "row_count": len(self), "rows": self.rows(limit)}


def _plain(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value
