"""Export: the bounded hand-off from the request path, the export worker (helper process or thread), the
OTLP wire encoder and the senders."""

from zoomer_serve.export.pipeline import ExportPipeline
from zoomer_serve.export.worker import ExportStats, ExportWorker

__all__ = ["ExportPipeline", "ExportStats", "ExportWorker"]
