"""One result row per point: the analysis, the measurement, or the failure."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from remat_kit import targets as T
from remat_kit.sweep import results as R
from remat_kit.sweep.checks import classify, error_message
from remat_kit.sweep.config import Point
from remat_kit.walker import bytes_by_tag
from remat_kit.zoo.facts import model_facts

#: Row fields from the point's model and analysis (None in a row whose analysis failed).
ANALYSIS_KEYS = (
    "model_fields", "num_params", "matmul_params", "tokens_per_step", "model_flops_per_step",
    "dtype",
    "peak_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "host_bytes",
    "params_bytes", "opt_state_bytes", "activation_bytes", "offloaded_bytes", "flops",
    "flops_no_remat", "recompute_ratio", "compiled_recompute_ratio", "memory_bytes", "fits",
    "predicted_step_time_s", "analysis_compile_s", "warnings", "report", "runs_as",
    "residual_bytes_by_tag",
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
        "residual_bytes_by_tag": _by_tag(report),
    }


def _by_tag(report: Any) -> dict[str, dict[str, int]]:
    """{checkpoint tag: {"device" / "host": bytes}} of the report's residuals
    (:func:`remat_kit.walker.bytes_by_tag` per memory)."""
    by = {m: bytes_by_tag(report.residuals, m) for m in ("device", "host")}
    tags = dict.fromkeys([*by["device"], *by["host"]])
    return {t: {m: n[t] for m, n in by.items() if t in n} for t in tags}


def model_fields(point: Point, facts: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """A preset point's model fields (:func:`remat_kit.zoo.facts.model_facts`, once per model
    and sequence length in ``facts``): parameters, tokens, model FLOPs, the model's fields."""
    facts_key = (point.model, point.overrides, point.remat_group_size, point.seq_len)
    if facts_key not in facts:
        facts[facts_key] = model_facts(point.model, point.seq_len, **point.changes)
    known = facts[facts_key]
    tokens = point.batch_size * point.seq_len
    return {
        "num_params": known["num_params"],
        "matmul_params": known["matmul_params"],
        "tokens_per_step": tokens,
        "model_flops_per_step": known["model_flops_per_token"] * tokens,
        "dtype": known["dtype"],
        # the policy as written (a name or a per-tag spec), not the spec's frozensets
        "model_fields": {**known["fields"], "remat_policy": point.policy},
    }


def _measure(
    row: dict[str, Any],
    executable: Any,
    measurement: dict[str, Any] | BaseException | None,
    measured: dict[str, Any],
) -> None:
    """Fill ``measured`` as far as the run got (a failure keeps what came before it); tokens per
    second and MFU where the row has the step's tokens and model FLOPs (a preset's)."""
    if isinstance(executable, BaseException):
        raise executable
    if executable is None:  # ours: the loop compiles every point it measures
        raise RuntimeError(f"no compiled step for row {row['key']}")
    _, compile_s, reused = executable
    measured.update(compile_s=round(compile_s, 3), compile_reused=reused)
    if isinstance(measurement, BaseException):
        raise measurement
    if measurement is None:  # ours: the loop measures every step it compiled
        raise RuntimeError(f"no measurement for row {row['key']}")
    result = dict(measurement)
    row.update({k: result.pop(k) for k in ("fed_back", "recopied") if k in result})
    measured.update(result)
    if row["tokens_per_step"]:
        measured["tokens_per_s"] = row["tokens_per_step"] / measured["step_time_s"]
    peak_flops = T.get_target(row["target"]).peak_flops_bf16
    if peak_flops and row["dtype"] == "bfloat16" and row["model_flops_per_step"]:
        devices = T.parse_mesh(row["mesh"]).num_devices if row.get("mesh") else 1
        flops = row["model_flops_per_step"]  # over every device of the mesh
        measured["mfu"] = flops / measured["step_time_s"] / (peak_flops * devices)
    if measured["measured_peak_bytes"]:
        measured["peak_error"] = row["peak_bytes"] / measured["measured_peak_bytes"] - 1


def make_row(
    key: str,
    fields: Mapping[str, Any],
    report: Any,
    executable: Any = None,
    measurement: dict[str, Any] | BaseException | None = None,
    *,
    measure: bool = True,
    model: Callable[[], Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The row of one point (a preset grid's or a program's policy): ``fields`` (what the sweep
    and the point are), the analysis ``report`` (or the exception analysing it raised), the
    model's fields (``model()``, a preset's :func:`model_fields`: parameters, tokens, model
    FLOPs), and with ``measure`` its compiled step (``executable``: ``(compiled, compile
    seconds, reused)`` or an exception) and its run (``measurement``), both from the measurer
    (:class:`~remat_kit.sweep.run.Measurer`).
    A failure anywhere gives status ``oom`` / ``error`` and its one-line message; every row has
    every field (None where not reached)."""
    t0 = time.perf_counter()
    row: dict[str, Any] = {"format": R.ROW_FORMAT, "key": key, **fields, "status": "ok"}
    row["error"] = None
    row.update({k: row.get(k) for k in ANALYSIS_KEYS})
    measured: dict[str, Any] = dict.fromkeys(MEASURED_KEYS)
    try:
        if isinstance(report, BaseException):
            raise report
        if model is not None:
            row.update(model())
        row.update(analysis_fields(report))
        if measure:
            _measure(row, executable, measurement, measured)
    except Exception as err:
        row["status"] = classify(err)
        row["error"] = error_message(err)
    row.update(measured)
    row["point_s"] = round(time.perf_counter() - t0, 3)
    row["time"] = R.now_utc()
    return row
