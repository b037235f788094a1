"""Summaries of the collector's store: per-method rates, errors, latency percentiles, phases, slow traces."""

from zoomer_serve.report.build import ReportError, build_report
from zoomer_serve.report.model import MethodStats, PhaseStats, Report, SlowTrace
from zoomer_serve.report.render import render_report

__all__ = ["MethodStats", "PhaseStats", "Report", "ReportError", "SlowTrace", "build_report", "render_report"]
