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
