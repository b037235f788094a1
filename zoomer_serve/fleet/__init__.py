"""The fleet: many replicas' profiling artifacts and span data in object storage, analysed as tasks on a
process pool or Ray, replicas compared with their peers by robust statistics, and a fleet report with heat
maps, a ranked outlier list and drill-down links.

- :mod:`~zoomer_serve.fleet.job`: :func:`run_fleet_job` and :class:`FleetOptions`.
- :mod:`~zoomer_serve.fleet.engines`: the local process pool and the Ray engine.
- :mod:`~zoomer_serve.fleet.tasks`: one trace artifact's analysis (runs in a worker).
- :mod:`~zoomer_serve.fleet.aggregate`: per-replica figures and the Parquet results.
- :mod:`~zoomer_serve.fleet.spans`: the span data's per-replica figures and heat maps.
- :mod:`~zoomer_serve.fleet.detect` and :mod:`~zoomer_serve.fleet.stats`: outliers, kernel spread and mix.
- :mod:`~zoomer_serve.fleet.html` / :mod:`~zoomer_serve.fleet.model`: the report.
- :mod:`~zoomer_serve.fleet.synthetic`: a synthetic fleet for tests, benchmarks and demos.
"""

from zoomer_serve.fleet.job import FleetOptions, run_fleet_job
from zoomer_serve.fleet.model import FleetReport

__all__ = ["FleetOptions", "FleetReport", "run_fleet_job"]
