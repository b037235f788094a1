"""Detectors over a Kineto trace. Each takes a :class:`KinetoTrace` and returns a list of
:class:`~zoomer_serve.analysis.findings.Finding` (empty when the pattern is absent). Thresholds for whether a
detector fires are module constants, named where they are used; the severity follows from the share of time
at stake (:func:`~zoomer_serve.analysis.findings.severity_for_share`). Kernels appear once per name as the
report shows it (:func:`~zoomer_serve.analysis.render.short_kernel_name`), with the number of distinct full
names (``variants``). :func:`detect_trace` runs them all."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from zoomer_serve.analysis.findings import AT_STAKE, Finding, severity_for_share
from zoomer_serve.analysis.kernels import kernel_kind, kernel_kinds
from zoomer_serve.analysis.kineto import KinetoTrace
from zoomer_serve.analysis.labels import parse_request_label
from zoomer_serve.analysis.render import short_kernel_name
from zoomer_serve.analysis.timeline import (
    SHORT_KERNEL_US,
    gpu_utilization,
    idle_gaps,
    kernel_launches,
    launch_index,
)

# gpu.low-utilization: fires for a utilization (busy / window) below this.
UTILIZATION_LOW = 0.8
# gpu.launch-bound
LAUNCH_MIN_KERNELS = 50
LAUNCH_SHORT_SHARE = 0.5
LAUNCH_EXCEEDS_SHARE = 0.3
# gpu.low-occupancy: "est. achieved occupancy %" below this, for kernels taking at least this share.
LOW_OCCUPANCY_PCT = 25.0
LOW_OCCUPANCY_MIN_SHARE = 0.10
MAX_ITEMS = 10

SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cudaMemcpy3D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol", "cudaMemset", "cudaMemset2D",
    "cudaMemset3D", "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
    "cuMemcpyHtoD", "cuMemcpy", "cuMemcpy2D", "cuMemcpy3D", "cuMemsetD8", "cuMemsetD16", "cuMemsetD32",
})
"""CUDA runtime / driver calls that block the calling CPU thread until the GPU has caught up (the
synchronous copy and memset variants included)."""

_API_SUFFIX = re.compile(r"(_v\d+|_ptsz|_ptds|_spt)+$")
# float32 GEMM / convolution kernels that run on the CUDA cores (SIMT), not on tensor cores.
_FP32_SIMT = re.compile(r"sgemm|scudnn|gcgemm|cgemm|simt|gemmsn|gemmk1_kernel<float|gemv2[nt]_kernel_val<[^>]*float")
_TENSOR_CORE = re.compile(r"tensorop|s1688|s16816|s884|h884|h1688|h16816|i8816|hmma|imma|wmma|tf32|bf16|fp16|f16|"
                          r"tensor\d+x\d+")


def api_name(name: str) -> str:
    """A CUDA API name without version / per-thread-stream suffixes (``cudaMemcpy_v2`` -> ``cudaMemcpy``)."""
    return _API_SUFFIX.sub("", name)


def _fmt_us(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms"
    return f"{us:.0f} us"


def _pct(share: float) -> str:
    """A 0..1 share as a percentage that does not round small non-zero shares down to 0.0%."""
    if 0 < share < 0.001:
        return "<0.1%"
    return f"{share:.1%}"


def _src(trace: KinetoTrace) -> str:
    return str(trace.path)


@dataclass
class KernelGroup:
    """Kernels that the report shows under one name: ``kernel`` (the full name of the variant with most time,
    cut at 200 characters), ``variants`` (distinct full names), ``count``, ``total_us``, ``indices``
    (positions in the input)."""

    kernel: str
    variants: int
    count: int
    total_us: float
    indices: list[int]


def kernel_groups(names: list[str], durations: list[float]) -> list[KernelGroup]:
    """Kernels grouped by the name the report shows (:func:`short_kernel_name`), most time first: two
    instantiations of one template (``vectorized_elementwise_kernel<4, ...>`` and ``<2, ...>``) are one row,
    not two that read alike."""
    by_key: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        by_key.setdefault(short_kernel_name(name), []).append(i)
    out = []
    for idx in by_key.values():
        per_name: dict[str, float] = {}
        for i in idx:
            per_name[names[i]] = per_name.get(names[i], 0.0) + durations[i]
        out.append(KernelGroup(max(per_name, key=lambda n: per_name[n])[:200], len(per_name), len(idx),
                               float(sum(per_name.values())), idx))
    return sorted(out, key=lambda g: (-g.total_us, g.kernel))


class _Enclosing:
    """The CPU ops (``aten::...``) that contain a given CPU-side event, per thread."""

    def __init__(self, trace: KinetoTrace) -> None:
        ops = trace.cpu_ops
        self.by_thread: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        keys = list(zip(ops["pid"].tolist(), ops["tid"].tolist()))
        groups: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(key, []).append(i)
        for key, idx_list in groups.items():
            idx = np.array(idx_list)
            self.by_thread[key] = (ops["ts"][idx], ops["ts"][idx] + ops["dur"][idx], ops["name"][idx])

    def ops(self, pid: int, tid: int, ts: float, end: float) -> tuple[str, str]:
        """(outermost, innermost) enclosing op names; "" when none."""
        t = self.by_thread.get((pid, tid))
        if t is None:
            return "", ""
        s, e, names = t
        hit = np.flatnonzero((s <= ts) & (e >= end))
        if not len(hit):
            return "", ""
        span = e[hit] - s[hit]
        outer = hit[np.argmax(span)]
        inner = hit[np.argmin(span)]
        return str(names[outer]), str(names[inner])


class _Requests:
    """Request annotations (zoomer.request/<trace_id>/<span_id>) per thread; ``count``: the requests they are
    of (a request whose work ran in executor threads has a range on each); ``time_us``: the ranges' summed
    duration (thread time inside requests)."""

    def __init__(self, trace: KinetoTrace) -> None:
        a = trace.annotations
        self.ranges: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
        requests = set()
        for i in np.flatnonzero(~a["on_gpu"]):
            ids = parse_request_label(str(a["name"][i]))
            if ids is not None:
                requests.add(ids)
                self.ranges.setdefault((int(a["pid"][i]), int(a["tid"][i])), []).append(
                    (float(a["ts"][i]), float(a["ts"][i] + a["dur"][i]), ids[0]))
        self.count = len(requests)
        self.time_us = sum(e - s for ranges in self.ranges.values() for s, e, _ in ranges)

    def request_of(self, pid: int, tid: int, ts: float) -> str | None:
        for s, e, trace_id in self.ranges.get((pid, tid), ()):
            if s <= ts <= e:
                return trace_id
        return None


def detect_low_utilization(trace: KinetoTrace) -> list[Finding]:
    """``gpu.low-utilization``: a device busy less than 80% of its window (from its first GPU operation to
    its last), with the idle time split into host wait / kernel wait / other and the longest gaps."""
    util = gpu_utilization(trace)
    out = []
    gaps = None
    for row in util.rows():
        if row["stream"] != -1 or row["utilization"] >= UTILIZATION_LOW or row["window_us"] <= 0:
            continue
        u = row["utilization"]
        if gaps is None:
            gaps = idle_gaps(trace)
        dev_gaps = gaps.take(gaps["device"] == row["device"])
        idle = row["idle_us"]
        split = {"host_wait": row["host_wait_us"], "kernel_wait": row["kernel_wait_us"],
                 "other": row["other_idle_us"]}
        dominant = max(split, key=lambda k: split[k])
        items = [{k: v for k, v in g.items() if k != "device"} for g in dev_gaps.rows(MAX_ITEMS)]
        for it in items:
            it["next_op"] = it["next_op"][:200]
        long_gaps = int((dev_gaps["gap_us"] >= 1000.0).sum())
        evidence = {
            "utilization_share": u, "window_us": row["window_us"], "busy_us": row["busy_us"], "idle_us": idle,
            "host_wait_us": split["host_wait"], "kernel_wait_us": split["kernel_wait"],
            "other_idle_us": split["other"], "gaps_over_1ms_count": long_gaps,
            "longest_gap_us": row["longest_gap_us"], "gpu_ops_count": row["ops"], AT_STAKE: 1.0 - u,
        }
        share = split[dominant] / idle if idle > 0 else 0.0
        out.append(Finding(
            id="gpu.low-utilization", title=f"GPU {row['device']} busy only {u:.0%} of the time",
            severity=severity_for_share(1.0 - u),
            summary=(f"Device {row['device']} ran GPU work for {_fmt_us(row['busy_us'])} of a "
                     f"{_fmt_us(row['window_us'])} window ({u:.1%}); {share:.0%} of the idle time is "
                     f"{dominant.replace('_', ' ')}, {long_gaps} gaps last over 1 ms (longest "
                     f"{_fmt_us(row['longest_gap_us'])})."),
            evidence=evidence, items=items, recommendation=_idle_advice(dominant),
            source=_src(trace), scope=f"device {row['device']}"))
    return out


def _idle_advice(dominant: str) -> str:
    if dominant == "host_wait":
        return ("The GPU is waiting for the CPU to enqueue work: each listed gap ends with a kernel launched "
                "after the previous one finished. Look at what the CPU does in the longest gaps: move "
                "preprocessing, tokenisation and data loading off the critical path (worker threads or "
                "processes, prefetch into pinned memory), batch requests so each launch carries more work, and "
                "capture steady-state inference with CUDA graphs (torch.compile(mode=\"reduce-overhead\") or "
                "torch.cuda.graphs) to remove per-kernel launch cost.")
    if dominant == "kernel_wait":
        return ("The gaps are short launch delays between back-to-back kernels: fuse small kernels "
                "(torch.compile), replay them as a CUDA graph, or give each kernel more work (larger batches).")
    return ("The GPU was idle although work had been launched: it waited on other streams, events or "
            "synchronisations. Check cross-stream dependencies (cudaStreamWaitEvent), collective operations and "
            "host synchronisation points around the listed gaps.")


def detect_launch_bound(trace: KinetoTrace) -> list[Finding]:
    """``gpu.launch-bound``: at least half of the kernels run under 10 us and at least 30% of the launch calls
    took longer than the kernels they launched ran (needs >= 50 kernels on the device). A CUDA graph replay
    is one call for all of its kernels, so graphs do not count as launch-bound."""
    kl = kernel_launches(trace)
    out = []
    util = {r["device"]: r for r in gpu_utilization(trace).rows() if r["stream"] == -1}
    for dev in np.unique(kl["device"]):
        sel = kl["device"] == dev
        dur, ld = kl["dur"][sel], kl["launch_dur_us"][sel]
        n = int(sel.sum())
        launched = ~np.isnan(ld)
        if n < LAUNCH_MIN_KERNELS or not launched.any():
            continue
        short = dur < SHORT_KERNEL_US
        short_share = float(short.mean())
        # per launch call: a CUDA graph replay pays one call for all of its kernels
        _, first = np.unique(kl["launch_row"][sel][launched], return_index=True)
        exceeds_share = float((ld[launched][first] > kl["launch_kernel_us"][sel][launched][first]).mean())
        if short_share < LAUNCH_SHORT_SHARE or exceeds_share < LAUNCH_EXCEEDS_SHARE:
            continue
        u = util.get(int(dev), {})
        window = u.get("window_us", 0.0) or 0.0
        wait = (u.get("host_wait_us", 0.0) or 0.0) + (u.get("kernel_wait_us", 0.0) or 0.0)
        wait_share = wait / window if window > 0 else 0.0
        names = kl["name"][sel][short]
        sdur = dur[short]
        sld = ld[short]
        groups = sorted(kernel_groups([str(n) for n in names], sdur.tolist()), key=lambda g: (-g.count, g.kernel))
        items = []
        for g in groups[:MAX_ITEMS]:
            launches = sld[g.indices]
            items.append({"kernel": g.kernel, "kind": kernel_kind(g.kernel), "variants": g.variants,
                          "count": g.count, "median_us": float(np.median(sdur[g.indices])),
                          "median_launch_us": float(np.nanmedian(launches)) if np.any(~np.isnan(launches))
                          else None})
        elementwise = sum(1 for it in items if it["kind"] == "elementwise")
        evidence = {
            "kernels_count": n, "short_kernels_count": int(short.sum()), "short_share": short_share,
            "short_threshold_us": SHORT_KERNEL_US, "launch_exceeds_kernel_share": exceeds_share,
            "kernel_median_us": float(np.median(dur)), "launch_median_us": float(np.nanmedian(ld)),
            "launch_total_us": float(np.nansum(ld)), "short_kernel_total_us": float(sdur.sum()),
            "launch_wait_share": wait_share, AT_STAKE: wait_share,
        }
        out.append(Finding(
            id="gpu.launch-bound", title=f"Launch-bound work on GPU {int(dev)}",
            severity=severity_for_share(wait_share),
            summary=(f"{short_share:.0%} of {n} kernels run under {SHORT_KERNEL_US:g} us (median "
                     f"{evidence['kernel_median_us']:.1f} us) and {exceeds_share:.0%} of the launch calls took longer "
                     f"than their kernels ran (median launch call {evidence['launch_median_us']:.1f} us); the GPU waited on "
                     f"launches {wait_share:.0%} of its window."),
            evidence=evidence, items=items,
            recommendation=("Launch overhead dominates these kernels. Capture the steady-state forward pass as a "
                            "CUDA graph (torch.compile(model, mode=\"reduce-overhead\") or torch.cuda.CUDAGraph) "
                            "so the whole sequence is one launch"
                            + (f", let torch.compile fuse the {elementwise} elementwise kernels among the listed "
                               "ones (kind elementwise) into their neighbours" if elementwise else "")
                            + ", or batch more requests per forward pass."),
            source=_src(trace), scope=f"device {int(dev)}"))
    return out


def detect_host_syncs(trace: KinetoTrace) -> list[Finding]:
    """``cuda.host-sync``: CPU threads blocking on the GPU (``cudaStreamSynchronize``,
    ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking ``cudaMemcpy`` / ``cudaMemset``...), with
    the CPU ops that caused them (``aten::item`` / ``aten::_local_scalar_dense`` = ``.item()``, ``.cpu()``,
    ``aten::nonzero``...) and how many fell inside request ranges."""
    rt = trace.runtime
    if not len(rt):
        return []
    base = np.array([api_name(str(n)) for n in rt["name"]], dtype=object)
    idx = np.flatnonzero(np.isin(base, np.array(sorted(SYNC_CALLS), dtype=object)))
    if not len(idx):
        return []
    enclosing = _Enclosing(trace)
    requests = _Requests(trace)
    by_api: Counter[str] = Counter()
    blocked_by_api: dict[str, float] = {}
    by_cause: Counter[tuple[str, str, str]] = Counter()
    blocked_by_cause: dict[tuple[str, str, str], float] = {}
    in_requests = 0
    blocked_in_requests = 0.0
    request_ids: set[str] = set()
    for i in idx:
        api = str(base[i])
        dur = float(rt["dur"][i])
        by_api[api] += 1
        blocked_by_api[api] = blocked_by_api.get(api, 0.0) + dur
        pid, tid, ts = int(rt["pid"][i]), int(rt["tid"][i]), float(rt["ts"][i])
        outer, inner = enclosing.ops(pid, tid, ts, ts + dur)
        key = (outer or "(no CPU op)", inner or "(no CPU op)", api)
        by_cause[key] += 1
        blocked_by_cause[key] = blocked_by_cause.get(key, 0.0) + dur
        rid = requests.request_of(pid, tid, ts) if requests.count else None
        if rid is not None:
            in_requests += 1
            blocked_in_requests += dur
            request_ids.add(rid)
    blocked = float(rt["dur"][idx].sum())
    items = [{"cpu_op": outer, "innermost_op": inner, "api": api, "count": c,
              "blocked_us": blocked_by_cause[(outer, inner, api)]}
             for (outer, inner, api), c in by_cause.most_common(MAX_ITEMS)]
    window = float((rt["ts"] + rt["dur"]).max() - rt["ts"].min())
    blocked_share = blocked / window if window > 0 else 0.0
    request_share = blocked_in_requests / requests.time_us if requests.time_us > 0 else 0.0
    at_stake = max(blocked_share, request_share)
    item_like = sum(c for (o, i_, _), c in by_cause.items()
                    if any(p in o or p in i_ for p in ("item", "_local_scalar_dense", "is_nonzero", "nonzero")))
    evidence = {
        "sync_calls_count": int(len(idx)), "calls_by_api": dict(by_api),
        "blocked_us_by_api": {k: float(v) for k, v in blocked_by_api.items()}, "blocked_us": blocked,
        "blocked_share": blocked_share, "in_requests_count": in_requests,
        "requests_with_sync_count": len(request_ids), "requests_in_trace_count": requests.count,
        "item_like_count": item_like, "blocked_in_requests_us": blocked_in_requests,
        "blocked_request_share": request_share, AT_STAKE: at_stake,
    }
    where = (f"; {in_requests} inside {len(request_ids)} of {requests.count} requests, "
             f"{_pct(request_share)} of their time" if requests.count else "")
    apis = ", ".join(f"{k} x{v}" for k, v in by_api.most_common())
    return [Finding(
        id="cuda.host-sync", title="CPU blocks on the GPU (host-device synchronisation)",
        severity=severity_for_share(at_stake),
        summary=(f"{len(idx)} synchronising CUDA calls ({apis}) blocked the CPU for {_fmt_us(blocked)} "
                 f"({_pct(blocked_share)} of the CPU-side window){where}; {item_like} came from .item()-style "
                 f"scalar reads."),
        evidence=evidence, items=items,
        recommendation=("Each synchronisation stalls the CPU until the GPU drains its queue, so no new work is "
                        "enqueued meanwhile. In the request path, avoid .item(), .cpu(), .tolist(), .numpy(), "
                        "printing CUDA tensors and data-dependent shapes (nonzero, boolean masks); keep results on "
                        "the GPU until one final copy per request into pinned memory with non_blocking=True "
                        "followed by one event synchronisation. torch.cuda.set_sync_debug_mode(\"warn\") reports "
                        "every synchronising call with its Python stack."),
        source=_src(trace), scope="")]


def detect_pageable_copies(trace: KinetoTrace) -> list[Finding]:
    """``cuda.pageable-copy``: memcpys between the GPU and pageable host memory (any direction), which the
    driver stages through a pinned bounce buffer and which cannot overlap with compute."""
    m = trace.memops
    if not len(m):
        return []
    pageable = (m["op"] == "memcpy") & ((m["src"] == "Pageable") | (m["dst"] == "Pageable"))
    idx = np.flatnonzero(pageable)
    if not len(idx):
        return []
    enclosing = _Enclosing(trace)
    launch = launch_index(trace, m["correlation"][idx])
    rt = trace.runtime
    by_dir: dict[str, dict[str, float]] = {}
    causes: Counter[tuple[str, str, str]] = Counter()
    for j, i in enumerate(idx):
        d = str(m["direction"][i])
        acc = by_dir.setdefault(d, {"count": 0, "bytes": 0, "time_us": 0.0})
        acc["count"] += 1
        acc["bytes"] += int(m["bytes"][i])
        acc["time_us"] += float(m["dur"][i])
        li = launch[j]
        if li >= 0:
            ts, dur = float(rt["ts"][li]), float(rt["dur"][li])
            outer, inner = enclosing.ops(int(rt["pid"][li]), int(rt["tid"][li]), ts, ts + dur)
            causes[(d, outer or "(no CPU op)", str(rt["name"][li]))] += 1
        else:
            causes[(d, "(launch not in trace)", "")] += 1
    for d, acc in by_dir.items():
        acc["bandwidth_gbps"] = acc["bytes"] / (acc["time_us"] * 1e3) if acc["time_us"] > 0 else float("nan")
        pinned = (m["op"] == "memcpy") & (m["direction"] == d) & ((m["src"] == "Pinned") | (m["dst"] == "Pinned"))
        if pinned.any() and m["dur"][pinned].sum() > 0:
            acc["pinned_bandwidth_gbps"] = float(m["bytes"][pinned].sum() / (m["dur"][pinned].sum() * 1e3))
    total_bytes = int(m["bytes"][idx].sum())
    total_time = float(m["dur"][idx].sum())
    busy = float(trace.kernels["dur"].sum() + m["dur"].sum())
    time_share = total_time / busy if busy > 0 else 0.0
    items = [{"direction": d, "cpu_op": op, "api": api, "count": c} for (d, op, api), c in causes.most_common(MAX_ITEMS)]
    dirs = ", ".join(f"{d} x{int(v['count'])} ({v['bytes'] / 1e6:.1f} MB, {v['bandwidth_gbps']:.2f} GB/s)"
                     for d, v in sorted(by_dir.items()))
    evidence = {"copies_count": int(len(idx)), "bytes": total_bytes, "time_us": total_time,
                "gpu_time_share": time_share, "by_direction": by_dir, AT_STAKE: time_share}
    return [Finding(
        id="cuda.pageable-copy", title="Copies to or from pageable host memory",
        severity=severity_for_share(time_share),
        summary=(f"{len(idx)} copies involve pageable host memory: {dirs}; {_fmt_us(total_time)} of GPU copy "
                 f"time ({_pct(time_share)} of GPU work)."),
        evidence=evidence, items=items,
        recommendation=("Pageable copies are staged through a driver bounce buffer, run at a fraction of PCIe "
                        "bandwidth and block the CPU. Allocate host tensors in pinned memory (tensor.pin_memory(), "
                        "DataLoader(pin_memory=True), or a reusable pinned staging buffer per worker) and copy with "
                        ".to(device, non_blocking=True). For device-to-host results, copy into a preallocated "
                        "pinned tensor with non_blocking=True and wait on a CUDA event instead of .cpu()/.item()."),
        source=_src(trace), scope="")]


def detect_fp32_without_tensor_cores(trace: KinetoTrace) -> list[Finding]:
    """``gpu.fp32-no-tensor-cores``: float32 GEMM / convolution kernels that run on CUDA cores (cuBLAS
    ``*sgemm*``, cuDNN ``*scudnn*``, CUTLASS ``simt``), not on tensor cores."""
    k = trace.kernels
    out: list[Finding] = []
    if not len(k):
        return out
    uniq, inverse = np.unique(k["name"], return_inverse=True)
    inverse = inverse.reshape(-1)
    flag_u = np.array([bool(_FP32_SIMT.search(n.lower())) and not _TENSOR_CORE.search(n.lower()) for n in uniq])
    flags = flag_u[inverse]
    kinds = kernel_kinds(k["name"])
    props = trace.device_properties
    for dev in np.unique(k["device"]):
        dsel = k["device"] == dev
        sel = dsel & flags
        if not sel.any():
            continue
        total = float(k["dur"][dsel].sum())
        t = float(k["dur"][sel].sum())
        share = t / total if total > 0 else 0.0
        kinds_sel = kinds[sel]
        groups = kernel_groups([str(n) for n in k["name"][sel]], k["dur"][sel].tolist())
        distinct = len(np.unique(k["name"][sel]))
        items = [{"kernel": g.kernel, "kind": str(kinds_sel[g.indices[0]]), "variants": g.variants,
                  "count": g.count, "total_us": g.total_us} for g in groups[:MAX_ITEMS]]
        p = props.get(int(dev), {})
        major = int(p.get("computeMajor", 0) or 0)
        gpu = p.get("name", f"device {int(dev)}")
        if major >= 8:
            advice = (f"{gpu} (compute capability {major}.{p.get('computeMinor', 0)}) has TF32 and BF16 tensor "
                      "cores. Allow TF32 for float32 matmuls with torch.set_float32_matmul_precision(\"high\") "
                      "(and torch.backends.cudnn.allow_tf32 = True for convolutions), or run inference in "
                      "bfloat16 (model.to(torch.bfloat16) or torch.autocast(\"cuda\", dtype=torch.bfloat16)) "
                      "after checking accuracy.")
        elif major >= 7:
            advice = (f"{gpu} (compute capability {major}.{p.get('computeMinor', 0)}) has FP16 tensor cores but "
                      "no TF32/BF16: run inference under torch.autocast(\"cuda\", dtype=torch.float16) or "
                      "convert the model to half precision after checking accuracy.")
        else:
            advice = ("This GPU has no tensor cores for these types; reduced precision (FP16) may still help "
                      "memory bandwidth.")
        count = int(sel.sum())
        out.append(Finding(
            id="gpu.fp32-no-tensor-cores", title=f"float32 GEMM/convolution kernels without tensor cores on GPU {int(dev)}",
            severity=severity_for_share(share),
            summary=(f"{count} kernels of {len(groups)} kinds ran float32 matrix math on CUDA cores: "
                     f"{_fmt_us(t)}, {_pct(share)} of GPU kernel time."),
            evidence={"kernels_count": count, "distinct_kernels_count": distinct, "time_us": t,
                      "kernel_time_share": share, "compute_capability": f"{major}.{p.get('computeMinor', 0)}",
                      "gpu": gpu, AT_STAKE: share},
            items=items, recommendation=advice, source=_src(trace), scope=f"device {int(dev)}"))
    return out


def detect_low_occupancy(trace: KinetoTrace) -> list[Finding]:
    """``gpu.low-occupancy``: kernels with an estimated achieved occupancy under 25% that together take at
    least 10% of the device's kernel time. Kineto writes 0 when it cannot estimate occupancy; such kernels,
    and communication kernels (low occupancy by design), are left out."""
    k = trace.kernels
    out: list[Finding] = []
    if not len(k):
        return out
    kinds = kernel_kinds(k["name"])
    props = trace.device_properties
    for dev in np.unique(k["device"]):
        dsel = k["device"] == dev
        occ = k["occupancy"]
        known = dsel & ~np.isnan(occ) & (occ > 0) & (kinds != "communication")
        total = float(k["dur"][dsel].sum())
        low = known & (occ < LOW_OCCUPANCY_PCT)
        t = float(k["dur"][low].sum())
        share = t / total if total > 0 else 0.0
        if share < LOW_OCCUPANCY_MIN_SHARE:
            continue
        sms = int(props.get(int(dev), {}).get("numSms", 0) or 0)
        agg: dict[str, dict[str, float]] = {}
        full: dict[str, dict[str, float]] = {}
        idx = np.flatnonzero(low)
        for i in idx:
            name = str(k["name"][i])
            n = short_kernel_name(name)
            variants = full.setdefault(n, {})
            variants[name] = variants.get(name, 0.0) + float(k["dur"][i])
            a = agg.setdefault(n, {"count": 0, "total_us": 0.0, "occupancy": 0.0, "grid_blocks": 0,
                                   "block_threads": 0, "registers_per_thread": 0, "shared_memory": 0,
                                   "blocks_per_sm": 0.0})
            a["count"] += 1
            a["total_us"] += float(k["dur"][i])
            a["occupancy"] += float(occ[i]) * float(k["dur"][i])
            for col in ("grid_blocks", "block_threads", "registers_per_thread", "shared_memory", "blocks_per_sm"):
                a[col] = max(a[col], float(k[col][i]))
        items = []
        for n, a in sorted(agg.items(), key=lambda x: -x[1]["total_us"])[:MAX_ITEMS]:
            items.append({"kernel": max(full[n], key=lambda v: full[n][v])[:200], "variants": len(full[n]),
                          "count": int(a["count"]), "total_us": a["total_us"],
                          "occupancy_pct": a["occupancy"] / a["total_us"] if a["total_us"] else None,
                          "grid_blocks": int(a["grid_blocks"]), "block_threads": int(a["block_threads"]),
                          "registers_per_thread": int(a["registers_per_thread"]),
                          "shared_memory_bytes": int(a["shared_memory"]), "blocks_per_sm": a["blocks_per_sm"],
                          "likely_limit": _occupancy_limit(a, sms)})
        limits = Counter(it["likely_limit"] for it in items)
        out.append(Finding(
            id="gpu.low-occupancy", title=f"Low-occupancy kernels on GPU {int(dev)}",
            severity=severity_for_share(share),
            summary=(f"{len(idx)} kernels ({len(full)} kinds) ran below {LOW_OCCUPANCY_PCT:.0f}% estimated "
                     f"achieved occupancy for {_fmt_us(t)}, {_pct(share)} of GPU kernel time; most common limit: "
                     f"{limits.most_common(1)[0][0] if limits else 'unknown'}."),
            evidence={"kernels_count": int(len(idx)), "time_us": t, "kernel_time_share": share,
                      "occupancy_threshold_pct": LOW_OCCUPANCY_PCT, "sm_count": sms, AT_STAKE: share},
            items=items,
            recommendation=("Low occupancy leaves SMs without enough warps to hide memory latency. For kernels "
                            "whose grid has fewer blocks than the GPU has SMs, give each launch more work (larger "
                            "batches, fusing small ops with torch.compile, split-K GEMMs); for kernels limited by "
                            "registers or shared memory per block, try other algorithms/tile sizes "
                            "(torch.backends.cudnn.benchmark = True, torch.compile(mode=\"max-autotune\"))."),
            source=_src(trace), scope=f"device {int(dev)}"))
    return out


def _occupancy_limit(a: dict[str, float], sms: int) -> str:
    if sms and 0 < a["grid_blocks"] < sms:
        return f"grid too small ({int(a['grid_blocks'])} blocks for {sms} SMs)"
    if a["blocks_per_sm"] and a["blocks_per_sm"] < 1.0:
        return "grid too small (under one block per SM)"
    if a["registers_per_thread"] >= 128:
        return f"registers ({int(a['registers_per_thread'])} per thread)"
    if a["shared_memory"] >= 32 << 10:
        return f"shared memory ({int(a['shared_memory']) >> 10} KiB per block)"
    return "small blocks / tail effects"


def detect_small_batches(trace: KinetoTrace) -> list[Finding]:
    """``batch.small-for-gpu`` (:mod:`zoomer_serve.analysis.batching`)."""
    from zoomer_serve.analysis.batching import detect_small_batches as detect

    return detect(trace)


TRACE_DETECTORS: tuple[Callable[[KinetoTrace], list[Finding]], ...] = (
    detect_low_utilization, detect_launch_bound, detect_host_syncs, detect_pageable_copies,
    detect_fp32_without_tensor_cores, detect_low_occupancy, detect_small_batches,
)


def detect_trace(trace: KinetoTrace) -> list[Finding]:
    """Run every trace detector; returns all findings (unsorted)."""
    out: list[Finding] = []
    for detector in TRACE_DETECTORS:
        out.extend(detector(trace))
    return out
