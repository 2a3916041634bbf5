"""Sweep results as data: an append-only JSONL file, one JSON object (a *row*) per point.

Each row is one flushed, ``fsync``-ed ``write()``: a kill leaves at most a torn last line, which
:func:`read_rows` ignores and :func:`repair` cuts off. ``key`` (:func:`point_key`) is what
``--resume`` matches on; ``config_fingerprint`` (:func:`fingerprint`) refuses resuming onto
another configuration's file (:func:`check_resumable`). Timelines live beside the rows
(:func:`timelines_path`; docs/sweep.md).

Example::

    for r in summarize(read_rows("experiments/results/cpu/sweep.jsonl")):
        print(r["policy"], r["seq_len"], r["peak_saved"], r["slowdown"])
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from remat_kit import units
from remat_kit.memory.calibration import cpu_model
from remat_kit.memory.report import same_program_as as report_same_program
from remat_kit.policies import remat_implementation

__all__ = [
    "OPTION_FAMILIES",
    "ROW_FORMAT",
    "STATUSES",
    "append_row",
    "canonical_json",
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
    "ratio",
    "read_rows",
    "repair",
    "step_spread",
    "summarize",
    "timelines_path",
    "to_frame",
    "truncate",
]

ROW_FORMAT = 1
"""Version of the row layout; bumped when a field changes meaning."""

STATUSES = ("ok", "oom", "error")
"""``ok``: analysed (and measured, if asked); ``oom``: out of memory compiling or running;
``error``: any other failure (the message is in the row's ``error``)."""

#: Fields renamed since rows were first written, old name -> current name: :func:`read_rows`
#: gives every row the current names, so old results files read (and resume) as new ones.
_RENAMED_FIELDS = {"model_config": "model_fields"}
_KEY_CHARS = 16  # hex characters of the sha256 kept in keys and fingerprints
#: Identity of a group of rows compared against each other (same model, shapes, target, mesh).
GROUP_FIELDS = (
    "model", "target", "batch_size", "seq_len", "remat_group_size", "overrides", "mesh",
)  # fmt: skip


def canonical_json(obj: Any) -> str:
    """``obj`` as JSON with sorted keys and no spaces: the same text for the same value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def point_key(point: Mapping[str, Any]) -> str:
    """First 16 hex characters of the sha256 of the point's canonical (sorted-key) JSON."""
    return hashlib.sha256(canonical_json(dict(point)).encode()).hexdigest()[:_KEY_CHARS]


def fingerprint(config: Mapping[str, Any]) -> str:
    """Fingerprint of a whole sweep configuration (same scheme as :func:`point_key`)."""
    return point_key(config)


def environment() -> dict[str, Any]:
    """Provenance of a result, flat and JSON-ready (sweep rows; training's ``environment``).

    Keys: versions of ``jax``, ``jaxlib``, ``flax``, ``optax``, ``orbax-checkpoint``, ``numpy``
    (None when not installed), ``python``, ``backend``, ``device_kind``, ``device_count``,
    ``process_count``, ``platform``, ``machine``, ``processor``, ``cpu_model``, ``cpu_count``,
    ``remat_impl`` (:mod:`remat_kit.policies`).
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
    """Complete rows of ``path`` and their byte length.

    Raises:
      ValueError: a complete line is not a JSON object.
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
        if end < 0:  # torn last line: ignored (repair truncates it)
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
    """``runs/sweep.jsonl`` -> ``runs/sweep.timelines.jsonl``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.timelines{p.suffix or '.jsonl'}")


def read_rows(path: str | os.PathLike[str], timelines: bool = True) -> list[dict[str, Any]]:
    """Every complete row of a results file, in order; ``[]`` if it does not exist.

    A field written under an older name (``_RENAMED_FIELDS``) is read under its current one, in
    the row's key order.

    Args:
      timelines: put each report's timeline back from :func:`timelines_path` (False: None).

    Raises:
      ValueError: a complete line is not a JSON object.
    """
    rows = [_current_names(row) for row in _scan(Path(path))[0]]
    if timelines:
        side = {t.get("key"): t.get("timeline") for t in _scan(timelines_path(path))[0]}
        for row in rows:
            report = row.get("report")
            if isinstance(report, dict) and report.get("timeline") is None:
                if side.get(row.get("key")) is not None:
                    report["timeline"] = side[row.get("key")]
    return rows


def _current_names(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its fields under their current names (a current one wins over an old one)."""
    if not any(old in row for old in _RENAMED_FIELDS):
        return row
    return {
        _RENAMED_FIELDS.get(k, k): v
        for k, v in row.items()
        if not (k in _RENAMED_FIELDS and _RENAMED_FIELDS[k] in row)
    }


def repair(path: str | os.PathLike[str]) -> int:
    """Truncate a torn last line off ``path`` and its :func:`timelines_path`.

    Returns:
      Bytes removed from ``path``.

    Raises:
      ValueError: as :func:`read_rows`.
    """
    _cut_torn_line(timelines_path(path))
    return _cut_torn_line(Path(path))


def _cut_torn_line(p: Path) -> int:
    """Truncate ``p`` to its complete lines; the bytes removed."""
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
    """Append ``row`` as one ``O_APPEND`` write, then ``fsync``; its timeline goes first to
    :func:`timelines_path` (a timeline no row names is ignored).

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
      config: what ``config_fingerprint`` is made of, to name the first field that differs.

    Raises:
      ValueError: a row's ``config_fingerprint`` differs (the fix: a new ``--out`` or
        ``--overwrite``).
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
    if canonical_json(old) == canonical_json(new):
        return ""
    return f"{where or 'config'}: {_short(old)} in the file, {_short(new)} now"


def _short(value: Any, limit: int = 80) -> str:
    text = canonical_json(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- Reading rows --------------------------------------------------------------------------


def to_frame(rows: Iterable[Mapping[str, Any]] | Any):
    """Rows as a pandas ``DataFrame``, one column per top-level field (a frame as is)."""
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
    """The key of rows compared against each other (:data:`GROUP_FIELDS`)."""
    return tuple(canonical_json(row.get(f)) for f in GROUP_FIELDS)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None where either is unknown or ``b`` is 0."""
    if a is None or b is None or not b:
        return None
    return a / b


def offload_stayed_on_device(row: Mapping[str, Any]) -> bool:
    """Whether a row's offloaded residuals stayed on device (no host bytes, as on CPU)."""
    return not row.get("host_bytes")


def device_residual_bytes(row: Mapping[str, Any]) -> int | None:
    """Bytes a row's policy keeps on device for the backward pass (jaxpr
    ``activation_bytes``), plus offloaded residuals when they stayed on device."""
    act = row.get("activation_bytes")
    if act is None:
        return None
    if offload_stayed_on_device(row):
        act += row.get("offloaded_bytes") or 0
    return act


def summarize(rows: Iterable[Mapping[str, Any]] | Any) -> list[dict[str, Any]]:
    """One record per ``ok`` row with its figures next to its group's ``no-remat`` row.

    Groups by :data:`GROUP_FIELDS`. Figures (``None`` where an input is missing):

    * ``peak_saved``: ``1 - peak / peak(no-remat)``; ``measured_peak_bytes`` as measured.
    * ``activation_bytes``: :func:`device_residual_bytes`; ``activation_saved`` as above.
    * ``step_time_s``: median measured seconds; ``slowdown``:
      ``step_time / step_time(no-remat) - 1``.
    * ``step_cpu_s``, ``cpu_slowdown``: process CPU seconds per step (on CPU, the work done; on a
      GPU, host time only).
    * ``flops_ratio``: ``recompute_ratio``.
    * ``predicted_step_time_s``, ``predicted_slowdown``: the roofline's
      (:mod:`remat_kit.memory.roofline`); ``prediction_error``:
      ``(1 + predicted_slowdown) / (1 + slowdown) - 1``; ``estimate_error``:
      ``predicted_step_time / step_time - 1``.
    * ``same_program_as``: :func:`same_program_as`.
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
    """A row's policy as tables name it (``minimal (cut)``, a per-tag spec as sorted JSON)."""
    policy = row.get("policy_label") or row.get("policy")
    return policy if isinstance(policy, str) else json.dumps(policy, sort_keys=True)


def same_program_as(rows: Iterable[Mapping[str, Any]] | Any) -> list[str | None]:
    """Per row, the :func:`row_label` of the first earlier ``ok`` row of its group with the same
    ``program_sha256``, else None (their step times differ by noise alone)."""
    records = as_records(rows)

    def key(r: Mapping[str, Any]) -> tuple | None:
        ok = r.get("status") == "ok"
        sha = (r.get("report") or {}).get("program_sha256") if ok else None
        return (group_key(r), sha) if sha else None

    return [None if i is None else row_label(records[i]) for i in report_same_program(records, key)]


#: (max - min) / median of a point's timed steps beyond which it is *noisy*: policies differ by a
#: few percent (docs/results), so it is marked and kept off Pareto frontiers.
NOISY_SPREAD = 0.2


def is_noisy(row: Mapping[str, Any]) -> bool:
    """Whether a row's :func:`step_spread` exceeds :data:`NOISY_SPREAD`."""
    spread = step_spread(row.get("step_times_s"))
    return spread is not None and spread > NOISY_SPREAD


def step_spread(times: Sequence[float] | None) -> float | None:
    """(max - min) / median of ``times`` (seconds); None for fewer than two steps."""
    if not times or len(times) < 2 or statistics.median(times) <= 0:
        return None
    return (max(times) - min(times)) / statistics.median(times)


def _summary_record(r: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """One :func:`summarize` record: row ``r`` against its group's no-remat row ``b``."""
    ok = r.get("status") == "ok"
    peak = r.get("peak_bytes") if ok else None
    act = device_residual_bytes(r) if ok else None
    step = r.get("step_time_s") if ok else None
    peak_ratio = ratio(peak, b.get("peak_bytes"))
    act_ratio = ratio(act, device_residual_bytes(b) if b else None)
    step_ratio = ratio(step, b.get("step_time_s"))
    spread = step_spread(r.get("step_times_s")) if ok else None
    cpu_ratio = ratio(r.get("step_cpu_s") if ok else None, b.get("step_cpu_s"))
    predicted = r.get("predicted_step_time_s") if ok else None
    predicted_ratio = ratio(predicted, b.get("predicted_step_time_s"))
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


# -- Option sets: rows of one shape differing in model-field overrides (remat_layers, ...) -----

_SET_FIELDS = ("model", "target", "batch_size", "seq_len", "remat_group_size", "mesh")
#: The option fields that name a variant's family (its color in the figure), in that order.
OPTION_FAMILIES = ("plain", "remat_layers", "nested_remat", "loss_chunk_size", "attention")


def _overrides_text(overrides: Mapping[str, Any]) -> str:
    return json.dumps(dict(sorted(dict(overrides or {}).items())), sort_keys=True)


def option_sets(rows: Any) -> dict[tuple, list[dict[str, Any]]]:
    """Rows grouped by :data:`GROUP_FIELDS` bar overrides, where a group holds several."""
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
    """``flops_no_remat`` of the set's ``attention="xla"`` rows: the baseline of every option."""
    for r in members:
        attention = (r.get("model_fields") or {}).get("attention")
        if r.get("status") == "ok" and attention == "xla" and r.get("flops_no_remat"):
            return r["flops_no_remat"]
    return None


def option_records(rows: Any) -> list[dict[str, Any]]:
    """One record per row of every option set (:func:`option_sets`).

    Fields: ``model, target, batch_size, seq_len``; ``option`` (``"plain"`` or the row's own
    overrides), ``family`` (the first own override with a color, or ``"plain"``), ``policy``,
    ``status``, ``peak_bytes``, ``fits``, ``flops_ratio`` (``recompute_ratio * flops_no_remat /
    flops_no_remat(xla)``: one baseline for cuDNN too), ``step_time_s``, ``step_cpu_s``;
    ``None`` where the row has no such figure, never 0.
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
    """:func:`option_records` as one Markdown table per option set (``""`` if none)."""
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
    """Indices of the points no other beats in both ``x`` and ``y`` (minimised), sorted by ``x``.

    Args:
      ys: as many as ``xs``; a tie in ``x`` keeps the lower ``y``.
      left_out: points that may neither be on the frontier nor push others off it
        (:func:`is_noisy`).
    """
    order = sorted((i for i in range(len(xs)) if i not in left_out), key=lambda i: (xs[i], ys[i]))
    out, best = [], float("inf")
    for i in order:
        if ys[i] < best:
            out.append(i)
            best = ys[i]
    return out
