"""The markdown summary of ``experiments/gpu_check.py`` rows (rewritten after every point).

Reads rows only (no JAX): measured vs predicted peak per policy, step time against no-remat,
tokens/s and MFU, offload gradients, and ``recommend``'s pick against the measured step times.
Missing figures print as ``-`` (None: not measured or not available), never 0.
"""

from __future__ import annotations

import json
from typing import Any

GIB = 2**30
#: Step-time goals over no-remat (the project's compass) and published ranges.
GOALS = {"save-nothing": 1.30, "save-dots-no-batch": 1.05}
CLAIMS = "published: per-layer remat +20-35% step time, selective +3-15%"


def label(policy: str | dict[str, str]) -> str:
    """A policy's name in rows: the registered name, or ``custom:{json}``."""
    return policy if isinstance(policy, str) else "custom:" + json.dumps(policy, sort_keys=True)


def _gib(n: Any) -> str:
    return "-" if n is None else f"{n / GIB:.4g}"


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a: Any, b: Any) -> float | None:
    return None if a is None or not b else a / b


def _ok(rows: list[dict], point_id: str) -> dict | None:
    found = [r for r in rows if r["id"] == point_id and r["status"] == "ok"]
    return found[-1] if found else None


def predictions(rows: list[dict]) -> dict[str, dict]:
    """Deviceless predictions by policy label (the retry's when the first failed)."""
    row = _ok(rows, "predict/h200") or _ok(rows, "predict/h200-retry")
    return {} if row is None else row.get("predictions", {})


def choice_budget(pred_row: dict, named: list[str]) -> int | None:
    """A budget half-way between the largest predicted peak of ``named`` and the next one, so
    the largest (no-remat) does not fit and the choice among the rest matters; None when the
    predictions are missing (recommend then uses the target's memory)."""
    preds = pred_row.get("predictions", {}) if pred_row.get("status") == "ok" else {}
    peaks = sorted((preds[p]["peak_bytes"] for p in named if p in preds), reverse=True)
    return None if len(peaks) < 2 else (peaks[0] + peaks[1]) // 2


def _measure_rows(rows: list[dict], mode: dict) -> list[tuple[str, dict | None]]:
    out = []
    for policy in mode.get("measure", mode["policies"]):
        name = label(policy)
        found = [r for r in rows if r["id"] == f"measure/{name}"]
        out.append((name, found[-1] if found else None))
    return out


def _peak_table(rows: list[dict], mode: dict) -> list[str]:
    preds = predictions(rows)
    measured = _measure_rows(rows, mode)
    base = dict(measured).get("no-remat") or {}
    lines = [
        "| policy | predicted h200 GiB | predicted local GiB | measured GiB | measured / local "
        "| measured / h200 | host GiB (h200 / compiled) | step s | x no-remat | tokens/s | MFU "
        "| status |",
        "|" + "---|" * 12,
    ]
    for name, r in measured:
        r = r or {}
        local = r.get("predicted_local") or {}
        h200 = preds.get(name) or {}
        meas = r.get("measured_peak_bytes")
        x = _ratio(r.get("step_time_s"), base.get("step_time_s"))
        goal = f" (goal <= {GOALS[name]})" if name in GOALS and x is not None else ""
        status = r.get("status", "not run") + (
            f": {r.get('error', '')[:60]}" if r.get("error") else ""
        )
        lines.append(
            f"| {name} | {_gib(h200.get('peak_bytes'))} | {_gib(local.get('peak_bytes'))} "
            f"| {_gib(meas)} | {_num(_ratio(meas, local.get('peak_bytes')), '.3f')} "
            f"| {_num(_ratio(meas, h200.get('peak_bytes')), '.3f')} "
            f"| {_gib(h200.get('host_bytes'))} / {_gib(r.get('compiled_host_bytes'))} "
            f"| {_num(r.get('step_time_s'), '.3g')} | {_num(x, '.3f')}{goal} "
            f"| {_num(r.get('tokens_per_s'), '.0f')} | {_num(r.get('mfu'), '.3f')} | {status} |"
        )
    return lines


def _time_table(rows: list[dict], mode: dict) -> list[str]:
    """Predicted vs measured step time per policy: the roofline on the local GPU (calibrated
    there) and on the deviceless h200 target (datasheet figures), each as a ratio against
    no-remat beside the measured ratio, with the error of the ratio."""
    preds = predictions(rows)
    measured = _measure_rows(rows, mode)
    base = dict(measured).get("no-remat") or {}
    base_local = (base.get("predicted_local") or {}).get("step_time_s")
    base_h200 = (preds.get("no-remat") or {}).get("step_time_s")
    lines = [
        "| policy | measured s | measured x | est. local s | est. local x | error | "
        "est. h200 s | est. h200 x | error | local bound by |",
        "|" + "---|" * 10,
    ]
    for name, r in measured:
        r = r or {}
        meas = r.get("step_time_s")
        mx = _ratio(meas, base.get("step_time_s"))
        local = r.get("predicted_local") or {}
        lx = _ratio(local.get("step_time_s"), base_local)
        h200 = (preds.get(name) or {}).get("step_time_s")
        hx = _ratio(h200, base_h200)
        step = local.get("step_time") or {}
        terms = {k: step.get(k) or 0.0 for k in (
            "compute_s", "memory_s", "elementwise_s", "launch_s", "transfer_s",
            "collective_s", "allocation_s")}  # fmt: skip
        bound = max(terms, key=terms.get).removesuffix("_s") if any(terms.values()) else "-"
        lines.append(
            f"| {name} | {_num(meas, '.3g')} | {_num(mx, '.3f')} "
            f"| {_num(local.get('step_time_s'), '.3g')} | {_num(lx, '.3f')} "
            f"| {_num(_ratio(lx, mx) and _ratio(lx, mx) - 1, '+.1%')} "
            f"| {_num(h200, '.3g')} | {_num(hx, '.3f')} "
            f"| {_num(_ratio(hx, mx) and _ratio(hx, mx) - 1, '+.1%')} | {bound} |"
        )
    return lines


def _notes(rows: list[dict]) -> list[str]:
    """The measure rows' notes on figures a backend cannot give (printed once each)."""
    notes = {
        r.get(k) for r in rows if r["kind"] == "measure" for k in ("measured_peak_note", "mfu_note")
    }
    return [f"Note: {n}." for n in sorted(n for n in notes if n)] + [""]


def _offload_lines(rows: list[dict], mode: dict) -> list[str]:
    measured = dict(_measure_rows(rows, mode))
    off, twin = measured.get("offload-layer-inputs") or {}, measured.get("save-layer-inputs") or {}
    a, b = off.get("measured_peak_bytes"), twin.get("measured_peak_bytes")
    verdict = "-" if a is None or b is None else ("lowered" if a < b else "not lowered")
    lines = [
        f"Device peak, offload-layer-inputs vs save-layer-inputs (measured): {_gib(a)} vs "
        f"{_gib(b)} GiB: {verdict}.",
        "",
    ]
    for point in ("grads", "grads/remat3"):
        g = _ok(rows, point)
        if g is None:
            lines += [f"Offload gradients ({point}): not run or failed (see the rows).", ""]
            continue
        lines += [
            f"Offload gradients on {g.get('backend')}, {g.get('remat_impl')} remat, jax "
            f"{g.get('jax_version')} ({g.get('tolerance')}):",
            "",
            "| policy | loss diff | max grad diff (rel) | equal | compiled host GiB | runs as |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in g.get("policies", {}).items():
            if r is None:
                lines.append(f"| {name} | error: {g['errors'].get(name, '')[:80]} | | | | |")
                continue
            lines.append(
                f"| {name} | {r['loss_diff']:.2e} | {r['max_grad_diff_rel']:.2e} "
                f"| {r['equal']} | {_gib(r.get('compiled_host_bytes'))} "
                f"| {r.get('runs_as') or '-'} |"
            )
        lines.append("")
    return lines


def _recommend_lines(rows: list[dict], mode: dict) -> list[str]:
    rec = _ok(rows, "recommend/h200")
    if rec is None:
        return ["recommend: not run or failed (see the rows)."]
    budget = rec.get("budget_bytes")
    measured = {n: r for n, r in _measure_rows(rows, mode) if r and r.get("step_time_s")}
    predicted = {c["policy"]: c["peak_bytes"] for c in rec.get("candidates", [])}

    def peak(name: str) -> int | None:  # measured where the device reports it, else predicted
        return measured[name].get("measured_peak_bytes") or predicted.get(name)

    fits = {n: r for n, r in measured.items() if peak(n) is not None and peak(n) <= budget}
    best = min(fits, key=lambda n: fits[n]["step_time_s"]) if fits else None
    pick = rec.get("pick")
    lines = [
        f"recommend on h200, budget {_gib(budget)} GiB: pick **{pick}** (`{rec.get('line')}`).",
        "",
        "| candidate | predicted peak GiB | fits | model step s | measured step s "
        "| measured peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for c in rec.get("candidates", []):
        m = measured.get(c["policy"], {})
        lines.append(
            f"| {c['policy']} | {_gib(c['peak_bytes'])} | {c['fits']} "
            f"| {c['step_time_s']:.3g} | {_num(m.get('step_time_s'), '.3g')} "
            f"| {_gib(m.get('measured_peak_bytes'))} |"
        )
    if best is None or pick not in measured:
        lines += [
            "",
            "Pick vs measured: not comparable (the pick or the alternatives were not measured).",
        ]
    else:
        x = measured[pick]["step_time_s"] / fits[best]["step_time_s"]
        verdict = "the pick is the fastest" if best == pick else "a faster one fits"
        lines += [
            "",
            "Within the budget by measured peak (predicted where none is measured): "
            f"fastest measured {best}; the pick's measured step "
            f"time is {x:.3f}x of it ({verdict}).",
        ]
    return lines


def summary(rows: list[dict], mode: dict) -> str:
    """The whole summary as markdown."""
    head = _ok(rows, "versions") or {}
    pre = _ok(rows, "preflight") or {}
    stats = pre.get("memory_stats") or {}
    lines = [
        "# gpu_check summary",
        "",
        f"Mode {head.get('mode')}: {mode['model']}, batch {mode['batch_size']}, seq "
        f"{mode['seq_len']}, AdamW, scanned; {mode['warmup']} warm-up + {mode['timed']} timed "
        "steps (median).",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in (head.get("versions") or {}).items()),
        f"Remat implementation (preflight): {pre.get('remat_impl')}, jax {pre.get('jax_version')}"
        f" (jax_remat3 flag: {pre.get('jax_remat3_flag')}).",
        *[f"Warning: {w}" for w in head.get("warnings", [])],
        f"Device: {pre.get('device_kind')} ({pre.get('backend')}); bytes_limit "
        f"{_gib(stats.get('bytes_limit'))} GiB.",
        "",
        "## Peak and step time per policy",
        "",
        *_peak_table(rows, mode),
        "",
        *_notes(rows),
        "## Estimated vs measured step time (roofline, remat_kit.memory.roofline)",
        "",
        *_time_table(rows, mode),
        "",
        f"Goals (x no-remat): {GOALS}; {CLAIMS}. MFU: PaLM appendix B (arXiv:2204.02311).",
        "",
        "## Host offload",
        "",
        *_offload_lines(rows, mode),
        "",
        "## recommend",
        "",
        *_recommend_lines(rows, mode),
        "",
        "## Points not ok",
        "",
    ]
    bad = [r for r in rows if r["status"] != "ok" or r.get("errors")]
    for r in bad:
        detail = r.get("error") or json.dumps(r.get("errors"))[:300]
        lines.append(f"- {r['id']}: {r['status']}: {detail}")
    if not bad:
        lines.append("- none")
    return "\n".join(lines) + "\n"
