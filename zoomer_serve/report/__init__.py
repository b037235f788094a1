"""Summaries of the collector's store: per-method requests, rates and errors (from the ``rpc.server.call.duration``
metric where the store has it, :mod:`zoomer_serve.report.calls`), latency percentiles, phases, slow traces (from the
SERVER spans)."""

from zoomer_serve.report.build import ReportError, build_report
from zoomer_serve.report.model import MethodStats, PhaseStats, Report, SlowTrace
from zoomer_serve.report.render import render_report

__all__ = ["MethodStats", "PhaseStats", "Report", "ReportError", "SlowTrace", "build_report", "render_report"]
