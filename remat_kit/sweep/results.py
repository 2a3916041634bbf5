"""Sweep results as data: an append-only JSONL file, one JSON object (a *row*) per point.

A row is one ``write()`` of a full line, flushed and ``fsync``-ed: a kill leaves every finished
row and at most a torn last line, which :func:`read_rows` ignores and :func:`repair` cuts off.
Each row carries:

* ``key``: :func:`point_key` of the point's configuration (model, policy, shapes, target, steps,
  ...): what ``--resume`` matches on, so a point is never measured, or written, twice;
* ``config_fingerprint``: :func:`fingerprint` of the whole sweep configuration: resuming onto a file
  written by a different configuration is refused (:func:`check_resumable`).

A report's live-bytes timeline goes to the timelines file beside the rows
(:func:`timelines_path`); :func:`read_rows` puts it back unless ``timelines=False``. Slowdown and
memory saved against ``no-remat`` come from :func:`summarize`; plots (:mod:`remat_kit.plots`)
and notebooks only read rows. The timelines file and why: docs/sweep.md ("Where the code lives").

Example::

    rows = read_rows("experiments/results/cpu/sweep.jsonl")
    for r in summarize(rows):
        print(r["policy"], r["seq_len"], r["peak_saved"], r["slowdown"])
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from remat_kit import units
from remat_kit.memory import roofline
from remat_kit.memory.calibration import RETIME_AFTER_S, cache_dir, cpu_model
from remat_kit.memory.report import same_program_as as report_same_program
from remat_kit.policies import policy_names, remat_implementation

__all__ = [
    "OPTION_FAMILIES",
    "ROW_FORMAT",
    "STATUSES",
    "append_row",
    "check_resumable",
    "device_residual_bytes",
    "environment",
    "fingerprint",
    "first_difference",
    "is_noisy",
    "option_markdown",
    "option_records",
    "option_sets",
    "own_overrides",
    "point_key",
    "print_summary",
    "read_rows",
    "repair",
    "step_spread",
    "summarize",
    "summary_legend",
    "summary_lines",
    "summary_markdown",
    "timelines_path",
    "to_frame",
    "truncate",
]

ROW_FORMAT = 1
"""Version of the row layout; bumped when a field changes meaning."""

STATUSES = ("ok", "oom", "error")
"""``ok``: analysed (and measured, if asked); ``oom``: out of memory compiling or running;
``error``: any other failure (the message is in the row's ``error``)."""

_KEY_CHARS = 16  # hex characters of the sha256 kept in keys and fingerprints
#: Identity of a group of rows compared against each other (same model, shapes, target, mesh).
GROUP_FIELDS = (
    "model", "target", "batch_size", "seq_len", "remat_group_size", "overrides", "mesh",
)  # fmt: skip


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def point_key(point: Mapping[str, Any]) -> str:
    """Stable key of one point: the first 16 hex characters of the sha256 of its canonical JSON
    (sorted keys), so the same configuration gives the same key in every process."""
    return hashlib.sha256(_canonical(dict(point)).encode()).hexdigest()[:_KEY_CHARS]


def fingerprint(config: Mapping[str, Any]) -> str:
    """Fingerprint of a whole sweep configuration (same scheme as :func:`point_key`)."""
    return point_key(config)


def environment() -> dict[str, Any]:
    """Provenance of a result: where and with what it was measured (JSON-ready, flat).

    The one provenance dict of remat-kit: sweep rows carry these fields, training results
    carry it as ``environment``. Keys: library versions (``jax``, ``jaxlib``, ``flax``,
    ``optax``, ``orbax-checkpoint``, ``numpy``; None when not installed), ``python``,
    ``backend``, ``device_kind`` (of device 0), ``device_count`` (every process's devices),
    ``process_count``, ``platform``, ``machine``, ``processor``, ``cpu_model`` (None when
    ``/proc/cpuinfo`` has none), ``cpu_count`` and ``remat_impl`` (the remat implementation
    ``jax.checkpoint`` traces with: ``classic`` or ``remat3``, :mod:`remat_kit.policies`).
    """

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = jax.devices()[0]
    libraries = ("jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
    return {
        "jax": jax.__version__,
        **{name: version(name) for name in libraries},
        "python": sys.version.split()[0],
        "backend": jax.default_backend(),
        "device_kind": str(device.device_kind),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "remat_impl": remat_implementation(),
    }


def now_utc() -> str:
    """The current time, ISO 8601 in UTC to the second (``2025-01-31T12:00:00Z``)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- The file --------------------------------------------------------------------------------


def _scan(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Complete rows of ``path`` and the byte length they occupy (torn last line excluded).

    Raises:
      ValueError: a complete (newline-terminated) line is not a JSON object.
    """
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    rows: list[dict[str, Any]] = []
    good = 0
    start = 0
    lineno = 0
    while start < len(data):
        lineno += 1
        end = data.find(b"\n", start)
        if end < 0:  # torn last line from a kill: ignored (and truncated by repair)
            break
        line = data[start:end].strip()
        if line:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}: line {lineno} is not JSON ({err.msg}); the file is not a remat-kit "
                    "results file or was edited by hand"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {lineno} is not a JSON object")
            rows.append(row)
        start = end + 1
        good = start
    return rows, good


def timelines_path(path: str | os.PathLike[str]) -> Path:
    """The timelines file of the rows at ``path``: ``runs/sweep.jsonl`` ->
    ``runs/sweep.timelines.jsonl`` (see the module docstring)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.timelines{p.suffix or '.jsonl'}")


def read_rows(path: str | os.PathLike[str], timelines: bool = True) -> list[dict[str, Any]]:
    """Every complete row of a results file, in file order; ``[]`` if it does not exist.

    A torn last line (no trailing newline: the process was killed mid-write) is ignored.

    Args:
      path: the rows (JSONL).
      timelines: put each report's timeline back from :func:`timelines_path` (where the file
        has one for the row's key; a rewritten key's last line wins). False: the rows as
        stored, each report's ``timeline`` None.

    Raises:
      ValueError: a complete line is not a JSON object.
    """
    rows = _scan(Path(path))[0]
    if timelines:
        side = {t.get("key"): t.get("timeline") for t in _scan(timelines_path(path))[0]}
        for row in rows:
            report = row.get("report")
            if isinstance(report, dict) and report.get("timeline") is None:
                if side.get(row.get("key")) is not None:
                    report["timeline"] = side[row.get("key")]
    return rows


def repair(path: str | os.PathLike[str]) -> int:
    """Truncate a torn last line off ``path`` (and off its :func:`timelines_path`) so rows can
    be appended after it.

    Returns:
      Bytes removed from ``path`` (0 when the file ends with a full line or does not exist).

    Raises:
      ValueError: as :func:`read_rows`.
    """
    _cut_torn_line(timelines_path(path))
    return _cut_torn_line(Path(path))


def _cut_torn_line(p: Path) -> int:
    """Truncate ``p`` to its complete lines; the bytes removed (0: none, or no file)."""
    if not p.exists():
        return 0
    _, good = _scan(p)
    size = p.stat().st_size
    if good < size:
        with open(p, "r+b") as f:
            f.truncate(good)
            f.flush()
            os.fsync(f.fileno())
    return size - good


def truncate(path: str | os.PathLike[str]) -> None:
    """Empty the rows at ``path`` and their :func:`timelines_path` (``--overwrite``)."""
    for p in (Path(path), timelines_path(path)):
        with open(p, "w", encoding="utf-8") as f:
            f.flush()
            os.fsync(f.fileno())


def append_row(path: str | os.PathLike[str], row: Mapping[str, Any]) -> None:
    """Append ``row`` as one JSON line: one ``os.write`` of the whole line to a file opened
    with ``O_APPEND``, then ``os.fsync``, so a kill leaves either the whole row or a torn last
    line that :func:`read_rows` ignores and :func:`repair` removes.

    A report's timeline goes first to :func:`timelines_path` (the same way), the row then
    without it: a kill between the two leaves a timeline no row names, which is ignored.

    Raises:
      OSError: the file cannot be written.
      TypeError: a value is not JSON-serialisable.
    """
    report = row.get("report")
    if isinstance(report, Mapping) and report.get("timeline") is not None:
        _append_line(timelines_path(path), {"key": row.get("key"), "timeline": report["timeline"]})
        row = {**row, "report": {**report, "timeline": None}}
    _append_line(path, row)


def _append_line(path: str | os.PathLike[str], obj: Mapping[str, Any]) -> None:
    line = (json.dumps(obj, allow_nan=False, default=_json_default) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:  # a regular file takes the whole line in one write; loop if it does not
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / jax scalars
        return value.item()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable: {value!r}")


def check_resumable(
    rows: Sequence[Mapping[str, Any]],
    config_fingerprint: str,
    path: str,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Refuse to resume onto rows written by another sweep configuration.

    Args:
      rows: the rows in the file.
      config_fingerprint: :func:`fingerprint` of ``config``.
      path: the file, for the message.
      config: what the fingerprint is made of (the sweep's config and data argument); rows
        store it as ``sweep_config``, so the message can name the first field that differs.

    Raises:
      ValueError: a row's ``config_fingerprint`` differs (one line: what differs, and the fix:
        a new ``--out`` file, or ``--overwrite``).
    """
    other = [r for r in rows if r.get("config_fingerprint") != config_fingerprint]
    if not other:
        return
    first = other[0]
    if "config_fingerprint" not in first:
        what = "rows that are not sweep rows (no config_fingerprint)"
    elif config is not None and isinstance(first.get("sweep_config"), Mapping):
        what = "a different sweep config: " + first_difference(first["sweep_config"], config)
    else:
        what = (
            f"rows of a different sweep config (sweep {first.get('sweep')!r}, fingerprint "
            f"{first['config_fingerprint']}; this config {config_fingerprint})"
        )
    raise ValueError(f"{path} holds {what}; write to a new --out file or pass --overwrite")


def first_difference(old: Any, new: Any, where: str = "") -> str:
    """The first field where two JSON-like values differ, as one line:
    ``"grids[0].seq_lens: [32] in the file, [64] now"`` (``""``: no difference)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{where}.{k}" if where else str(k)
            if k not in old or k not in new:
                was, now = _short(old.get(k, "(absent)")), _short(new.get(k, "(absent)"))
                return f"{sub}: {was} in the file, {now} now"
            found = first_difference(old[k], new[k], sub)
            if found:
                return found
        return ""
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            found = first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return ""
    if _canonical(old) == _canonical(new):
        return ""
    return f"{where or 'config'}: {_short(old)} in the file, {_short(new)} now"


def _short(value: Any, limit: int = 80) -> str:
    text = _canonical(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- Reading rows --------------------------------------------------------------------------


def to_frame(rows: Iterable[Mapping[str, Any]] | Any):
    """Rows as a pandas ``DataFrame`` (one column per top-level field; nested fields stay dicts).

    A ``DataFrame`` passed in is returned as is.
    """
    import pandas as pd

    if isinstance(rows, pd.DataFrame):
        return rows
    return pd.DataFrame(list(rows))


def as_records(rows: Iterable[Mapping[str, Any]] | Any) -> list[dict[str, Any]]:
    """Rows as a list of dicts, from a list of dicts or a pandas ``DataFrame``."""
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):
        return [
            {k: (None if _isnan(v) else v) for k, v in r.items()}
            for r in rows.to_dict(orient="records")
        ]
    return [dict(r) for r in rows]


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and v != v


def group_key(row: Mapping[str, Any]) -> tuple:
    """The rows a policy is compared against share this key (see :data:`GROUP_FIELDS`)."""
    return tuple(_canonical(row.get(f)) for f in GROUP_FIELDS)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def offload_stayed_on_device(row: Mapping[str, Any]) -> bool:
    """Whether a row's offloaded residuals (``offloaded_bytes``, marked by the jaxpr) were kept on
    the device by the compiled program: it put nothing in host memory (``host_bytes`` 0 or
    unknown), as on the CPU backend, which ignores host offload."""
    return not row.get("host_bytes")


def device_residual_bytes(row: Mapping[str, Any]) -> int | None:
    """Bytes of the residuals a row's policy keeps on the device for the backward pass (all
    layers, from the jaxpr: ``activation_bytes``), plus its offloaded residuals when the
    compiled program put nothing in host memory (``host_bytes == 0``: a target that does not
    offload, such as the CPU backend, keeps them on the device)."""
    act = row.get("activation_bytes")
    if act is None:
        return None
    if offload_stayed_on_device(row):
        act += row.get("offloaded_bytes") or 0
    return act


def summarize(rows: Iterable[Mapping[str, Any]] | Any) -> list[dict[str, Any]]:
    """One record per ``ok`` row with its figures next to the ``no-remat`` row of its group.

    A group is the rows sharing model, target, batch size, sequence length, ``remat_group_size``,
    config overrides and mesh (:data:`GROUP_FIELDS`). Figures (``None`` where an input is missing,
    e.g. no ``no-remat`` row in the group, or no measurement):

    * ``peak_bytes``: the analyzer's predicted peak (bytes); ``measured_peak_bytes`` as measured.
    * ``peak_saved``: ``1 - peak / peak(no-remat)`` (fraction of the whole step's peak).
    * ``activation_bytes``: :func:`device_residual_bytes`; ``activation_saved``:
      ``1 - activation / activation(no-remat)``.
    * ``step_time_s``: median measured step time (seconds); ``slowdown``:
      ``step_time / step_time(no-remat) - 1``.
    * ``step_cpu_s``: median process CPU seconds per step; ``cpu_slowdown`` likewise. On the CPU
      backend this is the work done, unlike wall time unaffected by other processes (it does
      count every XLA thread, spinning ones too); on a GPU it is host time only.
    * ``flops_ratio``: compiled matmul FLOPs over the no-remat step's (``recompute_ratio``).
    * ``predicted_step_time_s``: the roofline's estimated step time (seconds,
      :mod:`remat_kit.memory.roofline`); ``predicted_slowdown`` against its no-remat row's
      estimate; ``prediction_error``: ``(1 + predicted_slowdown) / (1 + slowdown) - 1``, the
      error of the predicted ratio against the measured one (None unless both are known);
      ``estimate_error``: ``predicted_step_time / step_time - 1``, the error of the estimate
      itself against the step it predicts (None unless both are known).

    Returns:
      Records in row order: ``model, target, batch_size, seq_len, remat_group_size, mesh,
      overrides, policy, status, peak_bytes, peak_saved, activation_bytes, activation_saved,
      step_time_s, slowdown, step_cpu_s, cpu_slowdown, backend, tokens_per_s, flops_ratio, fits,
      measured_peak_bytes, mfu, predicted_step_time_s, predicted_slowdown, prediction_error,
      estimate_error, same_program_as`` (the label of the first earlier row of the group compiled
      to the same program, :attr:`MemoryReport.program_sha256`; None for the first or unknown).
    """
    records = as_records(rows)
    base: dict[tuple, Mapping[str, Any]] = {}
    for r in records:
        if r.get("policy") == "no-remat" and r.get("status") == "ok":
            base[group_key(r)] = r
    out = [_summary_record(r, base.get(group_key(r), {})) for r in records]
    for rec, same in zip(out, same_program_as(records), strict=True):
        rec["same_program_as"] = same
    return out


def row_label(row: Mapping[str, Any]) -> str:
    """What tables call a row's policy: a program sweep's cut-down policy as every tool names
    it (``minimal (cut)``), else the policy (a per-tag spec as sorted JSON)."""
    policy = row.get("policy_label") or row.get("policy")
    return policy if isinstance(policy, str) else json.dumps(policy, sort_keys=True)


def same_program_as(rows: Iterable[Mapping[str, Any]] | Any) -> list[str | None]:
    """For each row, the label (:func:`row_label`) of the first earlier ``ok`` row of its group
    (:func:`group_key`) compiled from the same lowered program (the report's
    ``program_sha256``), else None: a name-based policy cut down to a program's tags. Its step
    time differs from that row's by noise alone, as analyze and recommend say of such rows."""
    records = as_records(rows)

    def key(r: Mapping[str, Any]) -> tuple | None:
        ok = r.get("status") == "ok"
        sha = (r.get("report") or {}).get("program_sha256") if ok else None
        return (group_key(r), sha) if sha else None

    return [None if i is None else row_label(records[i]) for i in report_same_program(records, key)]


#: A point whose timed steps spread more than this ((max - min) / median: ±10%) is *noisy*: the
#: policies it is compared with differ in step time by a few percent to a few tens of percent
#: (docs/results), so a spread this wide can reorder them. A noisy point is marked in the tables
#: and figures and never placed on a Pareto frontier.
NOISY_SPREAD = 0.2


def is_noisy(row: Mapping[str, Any]) -> bool:
    """Whether a measured row's own timed steps spread beyond :data:`NOISY_SPREAD` (False for a
    row without timed steps)."""
    spread = step_spread(row.get("step_times_s"))
    return spread is not None and spread > NOISY_SPREAD


def step_spread(times: Sequence[float] | None) -> float | None:
    """How far a point's own timed steps spread, the noise of its step time: (max - min) /
    median of ``times`` (seconds; a ratio, 0.1 = 10%); None for fewer than two steps."""
    if not times or len(times) < 2 or statistics.median(times) <= 0:
        return None
    return (max(times) - min(times)) / statistics.median(times)


def _summary_record(r: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """One :func:`summarize` record: row ``r`` against its group's no-remat row ``b``."""
    ok = r.get("status") == "ok"
    peak = r.get("peak_bytes") if ok else None
    act = device_residual_bytes(r) if ok else None
    step = r.get("step_time_s") if ok else None
    peak_ratio = _ratio(peak, b.get("peak_bytes"))
    act_ratio = _ratio(act, device_residual_bytes(b) if b else None)
    step_ratio = _ratio(step, b.get("step_time_s"))
    spread = step_spread(r.get("step_times_s")) if ok else None
    cpu_ratio = _ratio(r.get("step_cpu_s") if ok else None, b.get("step_cpu_s"))
    predicted = r.get("predicted_step_time_s") if ok else None
    predicted_ratio = _ratio(predicted, b.get("predicted_step_time_s"))
    error = None
    if predicted_ratio is not None and step_ratio:
        error = predicted_ratio / step_ratio - 1
    return {
        **{f: r.get(f) for f in ("model", "target", "batch_size", "seq_len")},
        "remat_group_size": r.get("remat_group_size"),
        "mesh": r.get("mesh"),
        "overrides": r.get("overrides"),
        "policy": r.get("policy"),
        "label": row_label(r),
        "status": r.get("status"),
        "peak_bytes": peak,
        "peak_saved": None if peak_ratio is None else 1 - peak_ratio,
        "activation_bytes": act,
        "activation_saved": None if act_ratio is None else 1 - act_ratio,
        "step_time_s": step,
        "slowdown": None if step_ratio is None else step_ratio - 1,
        "step_spread": spread,
        "noisy": spread is not None and spread > NOISY_SPREAD,
        "step_cpu_s": r.get("step_cpu_s") if ok else None,
        "cpu_slowdown": None if cpu_ratio is None else cpu_ratio - 1,
        "backend": r.get("backend"),
        "tokens_per_s": r.get("tokens_per_s") if ok else None,
        "flops_ratio": r.get("recompute_ratio") if ok else None,
        "fits": r.get("fits") if ok else None,
        "measured_peak_bytes": r.get("measured_peak_bytes") if ok else None,
        "mfu": r.get("mfu") if ok else None,
        "predicted_step_time_s": predicted,
        "predicted_slowdown": None if predicted_ratio is None else predicted_ratio - 1,
        "prediction_error": error,
        "estimate_error": None if predicted is None or not step else predicted / step - 1,
    }


# -- Tables ----------------------------------------------------------------------------------


def _fmt_spread(x: float | None) -> str:
    """``"±6%"``: half the range of a point's timed steps over their median ("" unknown); a
    noisy point's (:data:`NOISY_SPREAD`) ends in ``*``."""
    if x is None:
        return ""
    return f"±{50 * x:.0f}%" + ("*" if x > NOISY_SPREAD else "")


def _fmt_ms(seconds: float) -> str:
    """Milliseconds with three significant digits, or whole above 100 (``"1,234"``, ``"12.3"``,
    ``"3.30"``, ``"0.0412"``)."""
    ms = 1e3 * seconds
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:#.3g}"


def _fmt_pct(x: float | None) -> str:
    if x is None:
        return "-"
    return "0%" if round(100 * x) == 0 else f"{100 * x:+.0f}%"


def summary_lines(rows: Sequence[Mapping[str, Any]] | Any) -> list[tuple[str, list[str], list]]:
    """The end-of-sweep tables as data: one ``(title, header, body)`` per model/target/batch.

    Each body row is one policy at one sequence length: predicted peak, peak saved vs
    ``no-remat``, activation (residual) bytes saved, compiled-FLOPs ratio, and for measured rows
    the estimated step time (analysis-only tables) and its change vs ``no-remat`` (the
    roofline), the median measured
    step time, slowdown vs ``no-remat`` (wall time; on the CPU backend also CPU time)
    and tokens per second (where known); failures show their status. Rows without a shape (a
    user's program: ``batch_size`` / ``seq_len`` None) leave it out of the title and the
    columns. Figures come from :func:`summarize` (nothing is recomputed).
    """
    records = summarize(rows)
    order = {name: i for i, name in enumerate(policy_names())}
    tables: dict[tuple, list[dict[str, Any]]] = {}
    varied = len({_canonical(r["overrides"]) for r in records}) > 1  # an option grid
    for r in records:
        key = (r["model"], r["target"], r["batch_size"], r["remat_group_size"], r["mesh"])
        tables.setdefault((*key, _canonical(r["overrides"]) if varied else ""), []).append(r)
    out = []
    for (model, target, b, k, mesh, overrides), recs in tables.items():
        recs = sorted(recs, key=lambda r: (r["seq_len"] or 0, order.get(r["policy"], len(order))))
        unit, unit_name = units.table_unit([r["peak_bytes"] for r in recs])
        # a second decimal where every peak is under 10 units (a small model's 4.38 vs 4.50 MiB)
        digits = 2 if max((r["peak_bytes"] or 0 for r in recs), default=0) < 10 * unit else 1
        measured = any(r["step_time_s"] is not None for r in recs)
        # a program's rows have no sequence length (its arguments carry the shapes)
        seq = [] if all(r["seq_len"] is None for r in recs) else ["s"]
        header = ["policy", *seq, f"peak {unit_name}", "peak Δ", "act. Δ", "FLOPs x"]
        cpu = measured and any(
            r["backend"] == "cpu" and r["cpu_slowdown"] is not None for r in recs
        )
        fits = any(r["fits"] is not None for r in recs)
        if fits:
            header.append("fits")
        tokens = measured and any(r["tokens_per_s"] is not None for r in recs)  # not a program's
        predicted = any(r["predicted_step_time_s"] is not None for r in recs)
        if measured:  # each estimate beside the measurement it predicts, with its error
            header += ["step ms", *(["est. ms", "est. err"] if predicted else []), "step Δ"]
            header += (["est. Δ"] if predicted else []) + (["CPU Δ"] if cpu else [])
            header += ["tok/s"] if tokens else []
        elif predicted:
            header += ["est. ms", "est. Δ"]
        body = []
        for r in recs:
            if r["status"] != "ok":
                lead = [r["label"], *([str(r["seq_len"])] if seq else []), r["status"]]
                body.append(lead + [""] * (len(header) - len(lead)))
                continue
            same = r["same_program_as"]
            line = [
                r["label"] + (f" (same program as {same})" if same else ""),
                *([str(r["seq_len"])] if seq else []),
                units.in_unit(r["peak_bytes"], unit, digits),
                _fmt_pct(None if r["peak_saved"] is None else -r["peak_saved"]),
                _fmt_pct(None if r["activation_saved"] is None else -r["activation_saved"]),
                "-" if r["flops_ratio"] is None else f"{r['flops_ratio']:.2f}",
            ]
            if fits:
                line.append({True: "yes", False: "no"}.get(r["fits"], "-"))
            est = r["predicted_step_time_s"]
            est_ms = "-" if est is None else _fmt_ms(est)
            if measured:
                step = r["step_time_s"]
                line.append("-" if step is None else _fmt_ms(step) + _fmt_spread(r["step_spread"]))
                line += [est_ms, _fmt_pct(r["estimate_error"])] if predicted else []
                line.append(_fmt_pct(r["slowdown"]))
                line += [_fmt_pct(r["predicted_slowdown"])] if predicted else []
                line += [_fmt_pct(r["cpu_slowdown"])] if cpu else []
                if tokens:
                    line.append("-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}")
            elif predicted:
                line += [est_ms, _fmt_pct(r["predicted_slowdown"])]
            body.append(line)
        grp = f", remat_group_size={k}" if k not in (None, 1) else ""
        where = f"{target}, mesh {mesh} (figures per device)" if mesh else target
        opts = f", overrides {overrides}" if overrides else ""
        batch = f", batch {b}" if b is not None else ""
        out.append((f"{model} on {where}{batch}{grp}{opts}", header, body))
    return out


#: Columns of the summary tables left out first on a narrow terminal (summary.md keeps them).
OPTIONAL_COLUMNS = ("CPU Δ", "tok/s", "est. Δ")


def print_summary(rows: Sequence[Mapping[str, Any]] | Any, console: Any = None) -> None:
    """Print :func:`summary_lines` as rich tables fitted to the console's width
    (:func:`remat_kit.terminal.fit_table`): headers wrap at spaces, then the columns of
    :data:`OPTIONAL_COLUMNS` go (the caption says which), then labels wrap at spaces. Figures
    and policy names are never cut: a console too narrow even then gets the table at the width
    it needs, every column in it."""
    import copy

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from remat_kit.terminal import fit_table

    console = console or Console()
    for title, header, body in summary_lines(rows):
        # no edges, two spaces between columns
        table = Table(
            title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
            pad_edge=False, collapse_padding=True,
        )  # fmt: skip
        table.add_column(header[0], overflow="fold")
        for h in header[1:]:
            table.add_column(h, justify="right", overflow="fold")
        for line in body:
            table.add_row(*line)
        whole = copy.deepcopy(table)
        needed = fit_table(table, console.width, OPTIONAL_COLUMNS, "summary.md has them")
        if needed > console.width:  # print it as narrow as it goes (the terminal wraps)
            table = whole
            needed = fit_table(table, 0)
        width = console.width
        console.width = max(width, needed)  # print(width=) cannot exceed the console's width
        try:
            console.print(table)
        finally:
            console.width = width


#: What each column of :func:`summary_lines` means, in table order ("peak" stands for the
#: ``peak GiB`` / ``peak MiB`` column): :func:`summary_legend` lists those a file's tables have.
COLUMN_LEGEND = {
    "peak": "peak: the analyzer's predicted peak",
    "peak Δ": "peak Δ / act. Δ: change vs no-remat (act.: residual bytes kept for the backward "
    "pass)",
    "FLOPs x": "FLOPs x: compiled matmul FLOPs over the no-remat step's",
    "fits": "fits: predicted peak within the target's memory",
    "step ms": "step ms / step Δ: median measured step (wall), ± half the range of the "
    "point's own timed steps over their median (a step Δ within two points' ± is noise; * "
    f"noisy: beyond ±{50 * NOISY_SPREAD:.0f}%, never on a Pareto frontier), and its change vs "
    "no-remat",
    "est. ms": "est. ms: the estimated step time (roofline over the compiled kernels, "
    "docs/time-model.md)",
    "est. err": "est. err: the estimate against the measured step (est. / step - 1)",
    "est. Δ": "est. Δ: the estimated step time's change vs no-remat's estimate",
    "CPU Δ": "CPU Δ: the change in process CPU time",
    "tok/s": "tok/s: tokens per second measured",
}


def summary_legend(rows: Sequence[Mapping[str, Any]] | Any) -> str:
    """The meaning of every column the tables of :func:`summary_lines` have for ``rows``, in
    :data:`COLUMN_LEGEND`'s order, joined by "; " ("" without a table)."""
    present = {
        "peak" if column.startswith("peak ") and column != "peak Δ" else column
        for _, header, _ in summary_lines(rows)
        for column in header
    }
    return "; ".join(text for column, text in COLUMN_LEGEND.items() if column in present)


def local_estimate_source(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """Where the local rows' estimated step times come from: the device figures' source of the
    first row on the local device with an estimate (on a CPU, the calibration cached for this
    machine: when it was timed, at what load, its figures), else None. An estimate is only as
    good as that calibration: one timed on a busy machine prices memory traffic too high."""
    for r in as_records(rows):
        step = (r.get("report") or {}).get("step_time") or {}
        if r.get("target") == "local" and step.get("figures"):
            return str(step["figures"])
    return None


#: A timed load average this much above the calibration's is said beside the estimates.
_LOAD_GAP = 1.0


def _own_cores(row: Mapping[str, Any]) -> float:
    """The cores a row's own timed steps kept busy: median process CPU time over median wall
    time (0 where either is unknown)."""
    cpu, wall = row.get("step_cpu_s"), row.get("step_time_s")
    return cpu / wall if cpu and wall else 0.0


def local_calibration(rows: Iterable[Mapping[str, Any]] | Any) -> dict[str, Any] | None:
    """The machine's state while the local device was calibrated, as the first local row with
    an estimate records it (:class:`remat_kit.memory.calibration.Calibration`: ``others_share``,
    ``load_average``, ``contended``); None without one. Rows written before the estimate
    carried it are read from its figures' source line."""
    for r in as_records(rows):
        step = (r.get("report") or {}).get("step_time") or {}
        if r.get("target") != "local" or not step.get("figures"):
            continue
        if step.get("calibration") is not None:
            return dict(step["calibration"])
        return _calibration_of_source(str(step["figures"]))
    return None


def _calibration_of_source(source: str) -> dict[str, Any] | None:
    """:func:`local_calibration` of a row written before the estimate carried the fields."""
    share = re.search(r"other processes (\d+)% of the cores", source)
    load = re.search(r"load average ([0-9.]+)", source)
    if not (share or load):
        return None
    return {
        "others_share": int(share.group(1)) / 100 if share else None,
        "load_average": float(load.group(1)) if load else None,
        "contended": "; contended" in source,
    }


def load_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """A note when the measured rows and the local device's calibration
    (:func:`local_calibration`: the share of the cores other processes used while it was timed
    and the load average) saw the machine in different states: a calibration timed beside
    other work prices the machine too slow (estimates above the measured steps); steps timed
    on a busier machine than the calibration run slower than estimated. None when neither
    holds or nothing is known."""
    rows = as_records(rows)
    calibration = local_calibration(rows) or {}
    notes = []
    share = calibration.get("others_share")
    if calibration.get("contended"):
        used = (
            f"while other processes used {share:.0%} of the cores"
            if share is not None
            else "beside other work"
        )
        notes.append(
            f"the local device was calibrated {used}: its rates are below an idle machine's, "
            f"so the estimates run higher than idle cores would give them (est. err reads "
            f"higher; steps timed on a machine busier still can read below); it is timed again "
            f"when asked "
            f"{RETIME_AFTER_S / 60:.0f} min after, the quieter kept (or delete "
            f"{cache_dir() / 'calibration'} and run again on idle cores)"
        )
    calibrated = calibration.get("load_average")
    timed = [r for r in rows if r.get("load_average")]
    loads = [r["load_average"][0] for r in timed]
    # the sweep's own threads load the machine too: their cores (process CPU time over wall
    # time of its steps) are not other work
    others = [max(0.0, r["load_average"][0] - _own_cores(r)) for r in timed]
    if calibration and calibrated is None and others and max(others) >= _LOAD_GAP:
        notes.append(  # a calibration file from before its load was a field
            f"the steps were timed at load average {units.format_span(loads)} (other work "
            f"about {units.format_span(others)} of it beside the sweep's own steps) and the "
            "local device's calibration does not record its load: if it was timed on a quieter "
            "machine, measured steps run slower than estimated (est. err); delete "
            f"{cache_dir() / 'calibration'} to time it again"
        )
    if calibrated is not None and others and max(others) - float(calibrated) >= _LOAD_GAP:
        notes.append(
            f"the steps were timed at load average {units.format_span(loads)} (other work "
            f"about {units.format_span(others)} of it beside the sweep's own steps), the "
            f"local device calibrated at {float(calibrated):.2f}: the estimates price the "
            "machine as calibrated, so on the busier machine measured steps run slower than "
            "estimated (est. err) and their spread widens; time on idle cores to compare the two"
        )
    return "; ".join(notes) or None


def measured_peak_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """A line when no timed row has a measured peak: the peak columns are then the analyzer's
    alone, and the rows record null and why (``measured_peak_note``: on the CPU, the backend
    reports no ``peak_bytes_in_use``); None when some row has one or none was timed."""
    timed = [r for r in as_records(rows) if r.get("step_time_s") is not None]
    if not timed or any(r.get("measured_peak_bytes") is not None for r in timed):
        return None
    why = timed[0].get("measured_peak_note") or "not reported"
    return f"measured peak: null on every timed row ({why}); the peaks shown are the analyzer's"


def cpu_faster_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """One line where a policy measured faster than its group's no-remat on the CPU backend
    (a negative step Δ, though it does as much arithmetic or more): XLA:CPU allocates each
    step's temp buffer afresh and faults in its pages every step, and no-remat's is the
    largest (the ratio of the rows' ``temp_bytes``; docs/time-model.md, "What it counts").
    None where no such row was timed."""
    records = as_records(rows)
    base = {group_key(r): r for r in records if r.get("policy") == "no-remat"
            and r.get("status") == "ok"}  # fmt: skip
    ratios = []
    for r in records:
        b = base.get(group_key(r))
        if (
            b is None or r is b or r.get("status") != "ok" or r.get("backend") != "cpu"
            or not r.get("step_time_s") or not b.get("step_time_s")
            or r["step_time_s"] >= b["step_time_s"]
        ):  # fmt: skip
            continue
        ratios.append(_ratio(b.get("temp_bytes"), r.get("temp_bytes")))
    if not ratios:
        return None
    known = [x for x in ratios if x]
    size = f"{units.format_span(known, 1)}x theirs" if known else "the largest"
    return (
        f"remat ran faster than no-remat on the CPU in {len(ratios)} row(s): XLA:CPU faults in "
        f"each step's fresh temp buffer page by page, and no-remat's is {size} "
        "(docs/time-model.md)"
    )


def small_step_note(rows: Iterable[Mapping[str, Any]] | Any) -> str | None:
    """:func:`remat_kit.memory.roofline.small_step_note` for the rows' estimates on the
    calibrated local device (as analyze and recommend say it under their tables), or None."""
    local = [
        r for r in as_records(rows)
        if r.get("target") == "local"
        and ((r.get("report") or {}).get("step_time") or {}).get("measured_figures")
    ]  # fmt: skip
    timed = any(r.get("step_time_s") is not None for r in local)
    return roofline.small_step_note(
        (r.get("predicted_step_time_s") for r in local), bool(local), timed=timed
    )


def summary_markdown(rows: Sequence[Mapping[str, Any]] | Any) -> str:
    """:func:`summary_lines` as Markdown tables (for a summary file or a README)."""
    parts = []
    for title, header, body in summary_lines(rows):
        parts.append(f"**{title}**\n")
        parts.append("| " + " | ".join(header) + " |")
        parts.append("|" + "|".join(["---"] + ["--:"] * (len(header) - 1)) + "|")
        parts += ["| " + " | ".join(line) + " |" for line in body]
        parts.append("")
    return "\n".join(parts)


# -- Option sets: rows of one shape that differ in model-field overrides -------------------------
# (e.g. experiments/configs/options.py: remat_layers, nested_remat, loss_chunk_size, attention
# varied one at a time). Each row is a *variant*, labelled by the overrides it does not share
# with every row of its set ("plain" when it has none of its own) and its policy; figures in
# remat_kit.plots.option_effects.

_SET_FIELDS = ("model", "target", "batch_size", "seq_len", "remat_group_size", "mesh")
#: The option fields that name a variant's family (its color in the figure), in that order.
OPTION_FAMILIES = ("plain", "remat_layers", "nested_remat", "loss_chunk_size", "attention")


def _overrides_text(overrides: Mapping[str, Any]) -> str:
    return json.dumps(dict(sorted(dict(overrides or {}).items())), sort_keys=True)


def option_sets(rows: Any) -> dict[tuple, list[dict[str, Any]]]:
    """Rows grouped by model, target, batch size, sequence length, ``remat_group_size`` and mesh,
    keeping only groups whose rows carry more than one distinct ``overrides``; in row order."""
    sets: dict[tuple, list[dict[str, Any]]] = {}
    for r in as_records(rows):
        sets.setdefault(tuple(r.get(f) for f in _SET_FIELDS), []).append(r)
    return {
        k: v for k, v in sets.items() if len({_overrides_text(r.get("overrides")) for r in v}) > 1
    }


def own_overrides(row: Mapping[str, Any], members: Sequence[Mapping[str, Any]]) -> dict:
    """The overrides of ``row`` that not every row of its set shares."""
    own = dict(row.get("overrides") or {})
    shared = [dict(m.get("overrides") or {}) for m in members]
    return {k: v for k, v in own.items() if not all(s.get(k) == v for s in shared)}


def _xla_baseline(members: Sequence[Mapping[str, Any]]) -> float | None:
    """Traced matmul FLOPs of the plain no-remat step with XLA attention (``flops_no_remat`` of
    any ok row of the set with ``attention="xla"``: the baseline resets every layer-structure
    and loss option)."""
    for r in members:
        attention = (r.get("model_config") or {}).get("attention")
        if r.get("status") == "ok" and attention == "xla" and r.get("flops_no_remat"):
            return r["flops_no_remat"]
    return None


def option_records(rows: Any) -> list[dict[str, Any]]:
    """One record per row of every option set (:func:`option_sets`).

    Fields: the set's ``model, target, batch_size, seq_len``; ``option`` (``"plain"`` or the
    row's own overrides, ``"remat_layers=3"``), ``family`` (the first own override's field
    with a color of its own, e.g. ``nested_remat`` beside ``nested_groups``, or ``"plain"``),
    ``policy``, ``status``; ``peak_bytes`` (the analyzer's predicted peak, bytes); ``fits``
    (within the target's memory; None where unknown);
    ``flops_ratio``: the policy's own matmul FLOPs (``recompute_ratio``, XLA's own
    rematerialisation told apart) over the plain no-remat step's with XLA attention, i.e.
    ``recompute_ratio * flops_no_remat / flops_no_remat(xla)`` (so cuDNN attention's own FLOPs,
    counted by its matmul work, show against the same baseline); ``step_time_s`` (median measured
    seconds) and ``step_cpu_s``. ``None`` wherever the row has no such figure (a failed row;
    an analysis-only row has no step time): never 0.
    """
    out = []
    for members in option_sets(rows).values():
        base = _xla_baseline(members)
        for r in members:
            own = own_overrides(r, members)
            ok = r.get("status") == "ok"
            ratio = r.get("recompute_ratio") if ok else None
            if ratio is not None and base and r.get("flops_no_remat"):
                ratio = ratio * r["flops_no_remat"] / base
            out.append(
                {
                    **{f: r.get(f) for f in ("model", "target", "batch_size", "seq_len")},
                    "option": ", ".join(f"{k}={v}" for k, v in own.items()) or "plain",
                    "family": next(
                        (k for k in own if k in OPTION_FAMILIES), next(iter(own), "plain")
                    ),
                    "policy": r.get("policy"),
                    "status": r.get("status"),
                    "peak_bytes": r.get("peak_bytes") if ok else None,
                    "fits": r.get("fits") if ok else None,
                    "flops_ratio": ratio,
                    "step_time_s": r.get("step_time_s") if ok else None,
                    "step_cpu_s": r.get("step_cpu_s") if ok else None,
                }
            )
    return out


def _fmt_or_dash(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def option_markdown(rows: Any) -> str:
    """:func:`option_records` as one Markdown table per option set: predicted peak (in the
    set's unit) and its change against the plain ``no-remat`` row, ``fits``, ``flops_ratio``,
    median step time (wall and process CPU, ms); ``-`` where a row has no such figure. Empty
    string when the rows hold no option set."""
    sets: dict[tuple, list[dict[str, Any]]] = {}
    for r in option_records(rows):
        sets.setdefault((r["model"], r["target"], r["batch_size"], r["seq_len"]), []).append(r)
    parts = []
    for (model, target, b, s), recs in sets.items():
        unit, unit_name = units.table_unit([r["peak_bytes"] for r in recs])
        base = next(
            (r["peak_bytes"] for r in recs if r["option"] == "plain" and r["policy"] == "no-remat"),
            None,
        )
        parts += [
            f"**Options: {model} on {target}, b={b}, s={s}**\n",
            f"| option | policy | peak {unit_name} | peak Δ | fits | FLOPs x | step ms | CPU ms |",
            "|---|---|--:|--:|--:|--:|--:|--:|",
        ]
        for r in recs:
            peak = r["peak_bytes"]
            delta = None if peak is None or not base else 100 * (peak / base - 1)
            ms = [None if r[f] is None else 1e3 * r[f] for f in ("step_time_s", "step_cpu_s")]
            policy = r["policy"] if r["status"] == "ok" else f"{r['policy']} ({r['status']})"
            pct = "-" if delta is None else f"{delta:+.0f}%"
            cells = [
                r["option"], policy, units.in_unit(peak, unit, 2), pct,
                {True: "yes", False: "no"}.get(r["fits"], "-"),
                _fmt_or_dash(r["flops_ratio"], ".3f"), _fmt_or_dash(ms[0], ",.0f"),
                _fmt_or_dash(ms[1], ",.0f"),
            ]  # fmt: skip
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


def pareto_frontier(
    xs: Sequence[float], ys: Sequence[float], left_out: Collection[int] = ()
) -> list[int]:
    """Indices of the points no other point beats in both ``x`` and ``y`` (both minimised),
    sorted by ``x``: the memory-vs-time frontier of the sweep's figures and the HTML report.

    Args:
      xs: one value per point, in any unit (e.g. step seconds).
      ys: one value per point, as many as ``xs`` (e.g. peak bytes); a tie in ``x`` keeps the
        point with the lower ``y``.
      left_out: indices of points that may neither be on the frontier nor push others off it
        (noisy timings: :func:`is_noisy`).
    """
    order = sorted((i for i in range(len(xs)) if i not in left_out), key=lambda i: (xs[i], ys[i]))
    out, best = [], float("inf")
    for i in order:
        if ys[i] < best:
            out.append(i)
            best = ys[i]
    return out
