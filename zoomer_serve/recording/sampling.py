"""Head sampling for request spans, configured like the OpenTelemetry SDK (``OTEL_TRACES_SAMPLER``).

The decision is made on the request path, so it is a few integer operations. It follows the SDK's
semantics exactly: ``traceidratio`` keeps a trace when the low 64 bits of its trace id are below
``round(ratio * 2**64)``; the ``parentbased_*`` samplers follow a caller's sampled flag when a parent is
present. An unsampled request still counts in the metrics; only its span is not exported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zoomer_serve.recording.propagation import ParentContext

SAMPLER_NAMES = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_TRACE_ID_LIMIT = (1 << 64) - 1


@dataclass(frozen=True)
class Sampler:
    """A head sampler: ``name`` is one of :data:`SAMPLER_NAMES`; ``ratio`` in [0, 1] is used by the
    ``*traceidratio`` samplers. Raises ValueError for an unknown name or a ratio outside [0, 1]."""

    name: str = "parentbased_always_on"
    ratio: float = 1.0
    roots_always: bool = field(init=False, repr=False, compare=False, default=False)
    """True when every new trace (no parent) is sampled: the recorder then skips :meth:`should_sample`."""

    def __post_init__(self) -> None:
        if self.name not in SAMPLER_NAMES:
            raise ValueError(f"unknown sampler {self.name!r}; expected one of {', '.join(SAMPLER_NAMES)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"sampler ratio must be within [0, 1], got {self.ratio}")
        object.__setattr__(self, "_bound", round(self.ratio * (_TRACE_ID_LIMIT + 1)))
        root = self.name.removeprefix("parentbased_")
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_parent_based", self.name.startswith("parentbased_"))
        object.__setattr__(self, "roots_always", root == "always_on")

    def should_sample(self, trace_id: int, parent: ParentContext | None) -> bool:
        """Whether a new span in ``trace_id`` (with the given parent, if any) is sampled."""
        if parent is not None and self._parent_based:  # type: ignore[attr-defined]
            return parent.sampled
        root = self._root  # type: ignore[attr-defined]
        if root == "always_on":
            return True
        if root == "always_off":
            return False
        return (trace_id & _TRACE_ID_LIMIT) < self._bound  # type: ignore[attr-defined]
