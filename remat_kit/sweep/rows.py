"""One result row per point: the analysis, the measurement, or the failure."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from remat_kit import sharding as S
from remat_kit import targets as T
from remat_kit.sweep import results as R
from remat_kit.sweep.checks import classify, error_message
from remat_kit.sweep.config import Point
from remat_kit.sweep.measure import model_flops_per_token, param_counts

#: Row fields from the point's model and analysis (None in a row whose analysis failed).
ANALYSIS_KEYS = (
    "model_config", "num_params", "matmul_params", "tokens_per_step", "model_flops_per_step",
    "dtype",
    "peak_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "host_bytes",
    "params_bytes", "opt_state_bytes", "activation_bytes", "offloaded_bytes", "flops",
    "flops_no_remat", "recompute_ratio", "compiled_recompute_ratio", "memory_bytes", "fits",
    "predicted_step_time_s", "analysis_compile_s", "warnings", "report", "runs_as",
)  # fmt: skip
#: Row fields from running the step (None in an analysis-only or failed row).
#: ``compile_reused``: the step that ran is the analyzer's executable (compiled once).
MEASURED_KEYS = (
    "compile_s", "compile_reused", "step_times_s", "step_time_s", "step_cpu_times_s",
    "step_cpu_s", "tokens_per_s", "losses", "measured_peak_bytes", "measured_peak_note", "mfu",
    "peak_error", "step_order", "load_average",
)  # fmt: skip


def analysis_fields(report: Any) -> dict[str, Any]:
    """The row fields read from a :class:`~remat_kit.memory.MemoryReport` (bytes, FLOPs,
    ratios, seconds; ``report``: its ``to_dict()``)."""
    return {
        "peak_bytes": report.peak_bytes,
        "argument_bytes": report.argument_bytes,
        "output_bytes": report.output_bytes,
        "temp_bytes": report.temp_bytes,
        "alias_bytes": report.alias_bytes,
        "host_bytes": report.host_bytes,
        "params_bytes": report.arguments.get("params"),
        "opt_state_bytes": report.arguments.get("opt_state"),
        "activation_bytes": report.activation_bytes,
        "offloaded_bytes": report.offloaded_bytes,
        "flops": report.flops,
        "flops_no_remat": report.flops_no_remat,
        "recompute_ratio": report.recompute_ratio,  # the policy's own (XLA's remat told apart)
        "compiled_recompute_ratio": report.compiled_recompute_ratio,  # as XLA compiled it
        "memory_bytes": report.memory_bytes,
        "fits": report.fits,
        # the roofline's estimate (remat_kit.memory.roofline), beside the measured step_time_s
        "predicted_step_time_s": report.step_time_s,
        "analysis_compile_s": report.compile_s,
        "warnings": list(report.warnings),
        "report": report.to_dict(),
        # what the policy ran as when the remat implementation (row field remat_impl) does
        # not apply it as named; None when it does
        "runs_as": report.runs_as,
    }


def _model_fields(point: Point, counts: dict[tuple, tuple[int, int]]) -> dict[str, Any]:
    config = point.model_config()
    count_key = (point.model, point.overrides)
    if count_key not in counts:
        counts[count_key] = param_counts(config)
    total, matmul = counts[count_key]
    tokens = point.batch_size * point.seq_len
    return {
        "num_params": total,
        "matmul_params": matmul,
        "tokens_per_step": tokens,
        "model_flops_per_step": model_flops_per_token(config, point.seq_len, matmul) * tokens,
        "dtype": config.dtype,
        # the policy as written (a name or a per-tag spec), not the spec's frozensets
        "model_config": {**dataclasses.asdict(config), "remat_policy": point.policy},
    }


def _measure(
    point: Point,
    row: Mapping[str, Any],
    executable: Any,
    measurement: dict[str, Any] | BaseException | None,
    measured: dict[str, Any],
) -> None:
    """Fill ``measured`` as far as the run got (a failure keeps what came before it)."""
    if isinstance(executable, BaseException):
        raise executable
    _, compile_s, reused = executable
    measured.update(compile_s=round(compile_s, 3), compile_reused=reused)
    if isinstance(measurement, BaseException):
        raise measurement
    if measurement is None:  # ours: the loop measures every point it compiled
        raise RuntimeError(f"no measurement of {point.label}")
    measured.update(measurement)
    peak_flops = T.get_target(point.target).peak_flops_bf16
    if peak_flops and row["dtype"] == "bfloat16":  # over every device of the mesh
        devices = S.parse_mesh(point.mesh).num_devices if point.mesh else 1
        flops = row["model_flops_per_step"]
        measured["mfu"] = flops / measured["step_time_s"] / (peak_flops * devices)
    if measured["measured_peak_bytes"]:
        measured["peak_error"] = row["peak_bytes"] / measured["measured_peak_bytes"] - 1


def point_row(
    point: Point,
    report: Any,
    common: Mapping[str, Any],
    counts: dict[tuple, tuple[int, int]],
    executable: Any,
    measurement: dict[str, Any] | BaseException | None,
) -> dict[str, Any]:
    """The row of one point: ``common`` fields, the point, the analysis ``report`` (or the
    exception analysing it raised), and with ``point.measure`` its compiled step
    (``executable``: ``(compiled, compile seconds, reused)`` from :func:`compile_steps`, or an
    exception) and the run of it (``measurement``: from :func:`measure_points`, or an
    exception).
    A failure anywhere gives status ``oom`` / ``error`` and its one-line message; every row has
    every field (None where not reached)."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {
        "format": R.ROW_FORMAT,
        "key": point.key,
        **common,
        **point.to_dict(),
        "status": "ok",
        "error": None,
    }
    row.update(dict.fromkeys(ANALYSIS_KEYS))
    measured: dict[str, Any] = dict.fromkeys(MEASURED_KEYS)
    try:
        if isinstance(report, BaseException):
            raise report
        row.update(_model_fields(point, counts))
        row.update(analysis_fields(report))
        if point.measure:
            _measure(point, row, executable, measurement, measured)
    except Exception as err:
        row["status"] = classify(err)
        row["error"] = error_message(err)
    row.update(measured)
    row["point_s"] = round(time.perf_counter() - t0, 3)
    row["time"] = R.now_utc()
    return row
