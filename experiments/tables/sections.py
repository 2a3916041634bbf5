"""Renderers of the docs' generated tables and of the claims checked in prose, one per
results file family, and registered in registry.py.

Each renderer takes a :class:`~fmt.Results` and returns markdown (a section) or the
list of exact texts a file must contain (claims)."""

from __future__ import annotations

import re
from typing import Any

from fmt import (
    GIB,
    MIB,
    MINUS,
    Results,
    joined,
    pct,
    sci,
    span,
    table,
    wrap,
)

# ---------------------------------------------------------------- sweep (cpu)

SWEEP = "cpu/sweep.jsonl"
SWEEP_SUMMARY = "cpu/summary.md"
SWEEP_ROWS = (
    ("save-nothing (per-layer)", "save-nothing"),
    ("save-layer-inputs", "save-layer-inputs"),
    ("save-dots-no-batch (selective)", "save-dots-no-batch"),
    ("save-dots", "save-dots"),
    ("minimal", "minimal"),
)


def sweep_rows(r: Results, local: bool = True) -> dict[tuple[str, str, int], dict[str, Any]]:
    rows = [x for x in r.jsonl(SWEEP) if x["status"] == "ok" and (x["target"] == "local") == local]
    return {(x["model"], x["policy"], x["seq_len"]): x for x in rows}


def sweep_local(r: Results) -> tuple[str, list[int], dict[tuple[str, int], dict[str, Any]]]:
    rows = sweep_rows(r)
    model = next(iter(rows))[0]
    seqs = sorted({s for (_, _, s) in rows})
    return model, seqs, {(p, s): x for (m, p, s), x in rows.items() if m == model}


def summary_run(r: Results) -> tuple[int, int, str]:
    """Points, seconds and command of the committed sweep, from its summary.md."""
    text = r.text(SWEEP_SUMMARY)
    points, seconds = re.search(r"(\d+) point\(s\) in (\d+) s", text).groups()
    return int(points), int(seconds), re.search(r"Command: `([^`]*)`", text).group(1)


def sweep_cpu(r: Results) -> str:
    _, seqs, rows = sweep_local(r)
    first = next(iter(rows.values()))
    points, seconds, command = summary_run(r)
    seq_text = " / ".join(f"s={s}" for s in seqs)
    intro = wrap(
        f"Committed run (`experiments/results/cpu/`, {points} points in {seconds} s on a "
        f"{first['cpu_count']}-core {first['machine']} machine, XLA:{first['backend'].upper()}, "
        f"jax {first['jax']}; `{command}`), changes against no-remat, {seq_text}:"
    )

    def change(policy: str, key: str) -> str:
        return " / ".join(pct(rows[policy, s][key], rows["no-remat", s][key]) for s in seqs)

    body = [
        [
            label,
            change(policy, "activation_bytes"),
            change(policy, "peak_bytes"),
            span(rows[policy, s]["recompute_ratio"] for s in seqs),
            change(policy, "step_time_s"),
            change(policy, "step_cpu_s"),
        ]
        for label, policy in SWEEP_ROWS
    ]
    header = ["policy", "residual bytes", "predicted peak", "compiled FLOPs ×"]
    header += ["step time (wall)", "step CPU time"]
    return intro + "\n\n" + table(header, ["---", "--:", "--:", "--:", "--:", "--:"], body)


def _gpu_savings(r: Results, policy: str = "save-nothing") -> tuple[list[str], list[float]]:
    rows = sweep_rows(r, local=False)
    models = list(dict.fromkeys(m for (m, _, _) in rows))
    changes = [
        rows[m, policy, s]["peak_bytes"] / rows[m, "no-remat", s]["peak_bytes"]
        for (m, p, s) in rows
        if p == policy
    ]
    return models, changes


def grid_text(r: Results, digits: int) -> tuple[str, dict[str, Any]]:
    """``gpt-10m (11M parameters`` and one row of the measured grid."""
    model, _, rows = sweep_local(r)
    first = next(iter(rows.values()))
    return f"{model} ({first['num_params'] / 1e6:.{digits}f}M parameters", first


def sweep_claims(r: Results) -> list[str]:
    """Figures of the paragraphs around the sweep table (docs/sweep.md, docs/results/sweep.md)."""
    _, seqs, rows = sweep_local(r)
    grid, first = grid_text(r, 0)
    policies = {p for (p, _) in rows}
    gpu_models, _ = _gpu_savings(r)
    out = [
        f"{grid}) × all {len(policies)} policies × s ∈ {{{', '.join(map(str, seqs))}}}, batch "
        f"{first['batch_size']}, plus {joined(gpu_models)} analysed for a deviceless H100"
    ]
    acts = {
        pct(rows["save-nothing", s]["activation_bytes"], rows["no-remat", s]["activation_bytes"])
        for s in seqs
    }
    out.append(f"here: {' / '.join(a.lstrip(MINUS) for a in sorted(acts))} of the residual bytes")
    models, changes = _gpu_savings(r)
    lo, hi = max(changes), min(changes)
    out.append(
        f"the whole-step peak {pct(lo, 1)} to {pct(hi, 1)} on the H100 analyses of {joined(models)}"
    )
    peaks = " / ".join(
        pct(rows["save-nothing", s]["peak_bytes"], rows["no-remat", s]["peak_bytes"]) for s in seqs
    )
    out.append(f"{peaks} on the CPU model")
    ratios = [x["recompute_ratio"] for x in r.jsonl(SWEEP) if x["policy"] == "save-nothing"]
    out.append(f"(here {span(ratios)}×")
    out.append(_slower_than_no_remat(rows, seqs))
    temp = {
        s: [x["temp_bytes"] / MIB for (p, s2), x in rows.items() if s2 == s and p != "no-remat"]
        for s in seqs
    }
    base = " / ".join(f"{rows['no-remat', s]['temp_bytes'] / MIB:.0f}" for s in seqs)
    others = " / ".join(span(temp[s], "{:.0f}") for s in seqs)
    out.append(
        f"its compiled temp bytes are {base} MiB against {others} MiB "
        f"at s={' / '.join(map(str, seqs))}"
    )
    return out


def _slower_than_no_remat(rows: dict[tuple[str, int], dict[str, Any]], seqs: list[int]) -> str:
    """Remat policies whose wall step time rounds above no-remat's, and their CPU-time change."""
    parts = []
    for s in seqs:
        base = rows["no-remat", s]
        slow = [
            p
            for (p, s2) in rows
            if s2 == s and pct(rows[p, s]["step_time_s"], base["step_time_s"]).startswith("+")
        ]
        if slow:
            wall = " and ".join(
                f"{p} {pct(rows[p, s]['step_time_s'], base['step_time_s'])}" for p in slow
            )
            cpu = span(
                [round(100 * (rows[p, s]["step_cpu_s"] / base["step_cpu_s"] - 1)) for p in slow],
                "{:.0f}",
            )
            parts.append(f"{wall} wall at s={s}, {cpu}% CPU time")
    return "; ".join(parts) if parts else "no remat policy slower than no-remat"


def time_model_table(r: Results) -> str:
    """Predicted vs measured step-time ratios per policy (``experiments/bench_time_model.py``
    wrote the table from the same sweep's rows)."""
    return r.text("cpu/time_model.md")


# ---------------------------------------------------------------- analyze

ANALYZE = "analyze/llama3-8b_b1_s8192_h100-sxm.json"
ANALYZE_BENCH = "analyze/bench.json"
ANALYZE_RUNS = "analyze/cli_runs.jsonl"
ANALYZE_POLICIES = (
    "no-remat",
    "save-nothing",
    "save-dots-no-batch",
    "offload-layer-inputs",
    "offload-to-host",
)
PER_LAYER = "analyze/per_layer.jsonl"
PER_LAYER_BLOCKS = ("gpt-block-h2048", "llama3-8b")
PER_LAYER_POLICIES = ("no-remat", "save-dots-no-batch", "save-nothing")
PER_LAYER_TARGET = "h100-sxm"


def policy_reports(r: Results) -> dict[str, dict[str, Any]]:
    return {x["policy"]: x for x in r.json(ANALYZE)["reports"]}


def analyze_table(r: Results) -> str:
    reports = policy_reports(r)
    rows = []
    for policy in ANALYZE_POLICIES:
        x = reports[policy]
        host = "0" if x["host_bytes"] == 0 else f"{x['host_bytes'] / GIB:.2f}"
        ratios = f"{x['recompute_ratio']:.2f}× / {x['compiled_recompute_ratio']:.2f}×"
        rows.append([policy, f"{x['peak_bytes'] / GIB:.2f}", host, ratios])
    header = ["policy", "peak GiB", "host GiB", "FLOPs / no-remat: policy's own / as compiled"]
    return table(header, ["---", "---:", "---:", "---:"], rows)


def analyze_claims(r: Results) -> list[str]:
    reports = policy_reports(r)
    first = next(iter(reports.values()))
    out = [f"{first['model']}, b={first['batch_size']}, s={first['seq_len']}, bf16 parameters"]
    buffers = [b for b in reports["save-nothing"]["peak_buffers"] if b["kind"] == "attention"][:2]
    dtypes = {"f32": "float32", "bf16": "bfloat16"}
    sizes = [(b["nbytes"] / GIB, dtypes[b["shape"].split("[")[0]]) for b in buffers]
    out.append(
        f"the largest live buffers at save-nothing are the {sizes[0][0]:.0f} GiB of {sizes[0][1]} "
        f"attention scores and {sizes[1][0]:.0f} GiB of {sizes[1][1]} probabilities"
    )
    split = {x["policy"]: x for x in r.json(ANALYZE_BENCH)["flops_split"]}["save-nothing"]
    out.append(
        f"save-nothing: {split['jaxpr_ratio']:.2f}× from remat, "
        f"{split['compiled_ratio']:.2f}× compiled"
    )
    off = reports["offload-layer-inputs"]
    saved = (off["peak_bytes_without_offload"] - off["peak_bytes"]) / GIB
    out.append(f"Offloading the layer inputs lowers the device peak by {saved:.2f} GiB")
    bench = r.json(ANALYZE_BENCH)["cli"]
    earlier = [x["wall_s"] for x in r.jsonl(ANALYZE_RUNS) if x["time"] < bench["time"]]
    out.append(
        f"({span(earlier, '{:.1f}')} s a session earlier on the same machine; "
        f"{bench['wall_s']:.1f} s in the run"
    )
    return out


def _per_layer(r: Results) -> dict[tuple[str, str], dict[str, Any]]:
    rows = [
        x
        for x in r.jsonl(PER_LAYER)
        if x["target"] == PER_LAYER_TARGET and x["block"] in PER_LAYER_BLOCKS
    ]
    return {(x["block"], x["policy"]): x for x in rows}


def _block_label(x: dict[str, Any]) -> str:
    if x["block"] == x["model"]:
        return f"{x['model']}, b={x['batch_size']}, s={x['seq_len']}"
    return f"GPT h={x['d_model']}, a={x['num_heads']}, b={x['batch_size']}, s={x['seq_len']}"


def per_layer_table(r: Results) -> str:
    rows = _per_layer(r)
    body = []
    for block in PER_LAYER_BLOCKS:
        cells = [f"{_block_label(rows[block, PER_LAYER_POLICIES[0]])} (MiB)"]
        for policy in PER_LAYER_POLICIES:
            x = rows[block, policy]
            cells.append(f"{x['textbook_bytes'] / MIB:.0f} / {x['compiled_bytes'] / MIB:.0f}")
        body.append(cells)
    out = table(["block", *PER_LAYER_POLICIES], ["---", "---:", "---:", "---:"], body)
    names = ", ".join("GPT block" if b.startswith("gpt-block") else b for b in PER_LAYER_BLOCKS)
    ratios = "; ".join(
        f"{policy} "
        + ", ".join(
            f"{rows[b, policy]['compiled_bytes'] / rows[b, policy]['textbook_bytes']:.2f}×"
            for b in PER_LAYER_BLOCKS
        )
        for policy in PER_LAYER_POLICIES
    )
    return out + "\n" + wrap(f"Compiled / textbook ({names}): {ratios}.") + "\n"


def per_layer_claims(r: Results) -> list[str]:
    rows = _per_layer(r)
    layers = {tuple(x["layers"]) for x in rows.values()}
    out = (
        [f"compiled (from {' and '.join(str(n) for n in sorted(layers)[0])} layers)"]
        if len(layers) == 1
        else []
    )

    def side(block: str) -> str:
        x = rows[block, "no-remat"]
        return "more" if x["compiled_bytes"] > x["textbook_bytes"] else "less"

    gpt, llama = PER_LAYER_BLOCKS
    out.append(f"for the GPT block XLA keeps {side(gpt)} than it without remat")
    out.append(f"{llama} (SwiGLU, GQA, no dropout) keeps {side(llama)}")
    return out


# ---------------------------------------------------------------- recommend

RECOMMEND_RUNS = (
    "recommend/h100_default.json",
    "recommend/h200_solve.json",
    "recommend/h100_adafactor_solve.json",
)
RECOMMEND_BENCH = "recommend/bench.json"
OPTIMIZERS = {"adamw": "AdamW", "adafactor": "Adafactor"}


def shorter_seq(rec: dict[str, Any]) -> dict[str, Any] | None:
    fits = [
        c
        for c in rec["candidates"]
        if c["found_by"] == "advice" and c["fits"] and c["seq_len"] < rec["seq_len"]
    ]
    return max(fits, key=lambda c: c["seq_len"]) if fits else None


def _pick_text(rec: dict[str, Any]) -> str:
    pick = rec["pick"]
    if pick is None:
        named = [c for c in rec["candidates"] if c["found_by"] == "named"]
        least = min(named, key=lambda c: c["peak_bytes"])
        text = f"nothing fits (least: {least['policy']}, {least['peak_bytes'] / GIB:.2f} GiB)"
        shorter = shorter_seq(rec)
        if shorter:
            text += (
                f"; seq {shorter['seq_len']} fits ({shorter['peak_bytes'] / GIB:.2f} GiB, compiled)"
            )
        return text
    peak = f"{pick['peak_bytes'] / GIB:.2f} GiB"
    if pick["policy"] != "custom":
        return f"{pick['policy']}, {peak}"
    actions = pick["actions"]
    saved = sorted(t for t, a in actions.items() if a == "save")
    offloaded = sorted(t for t, a in actions.items() if a == "offload")
    useful = [t["tag"] for t in (rec["solve"] or {}).get("tags", []) if t["flops_saved"] > 0]
    if not offloaded and set(saved) == set(useful):
        return f"custom: save all {len(saved)} useful tags, {peak}"
    what = [f"save {len(saved)} tags"] + ([f"offload {', '.join(offloaded)}"] if offloaded else [])
    return f"custom: {', '.join(what)}, {peak}"


def recommend_table(r: Results) -> str:
    rows = []
    for path in RECOMMEND_RUNS:
        rec = r.json(path)
        how = "`--solve`" if rec["solve"] else f"default budget {rec['budget_bytes'] / GIB:.2f} GiB"
        run = f"{rec['target']}, {OPTIMIZERS[rec['optimizer']]}, {how}"
        rows.append([run, _pick_text(rec), str(rec["compiles"])])
    first = r.json(RECOMMEND_RUNS[0])
    name = f"run ({first['model']}, s={first['seq_len']}, b={first['batch_size']})"
    return table([name, "pick", "compiles"], ["---", "---", "---"], rows)


def recommend_claims(r: Results) -> list[str]:
    bench = r.json(RECOMMEND_BENCH)
    compiles = [r.json(p)["compiles"] for p in RECOMMEND_RUNS]
    named = {x["named_policies"] for x in bench["runs"].values()}.pop()
    machine = bench["machine"]
    return [
        f"{span(compiles, '{:.0f}')} compiles against the goal of ≤ 2 × {named} named policies",
        f"({machine['cpus']}-core CPU, deviceless targets, jax {machine['jax']};",
    ]


# ---------------------------------------------------------------- sharding

SHARDING = "sharding/fsdp.json"


def sharding_table(r: Results) -> str:
    data = r.json(SHARDING)
    model = data["rows"][0]["model"]
    rows = [
        [
            str(x["devices"]),
            f"{x['peak_gib']:.2f}",
            f"{x['state_gib_per_device']:.2f}",
            f"{x['estimate_gib']:.2f}",
            f"{x['analysis_s']:.1f}",
        ]
        for x in data["rows"]
        if x["model"] == model
    ]
    header = ["devices (fsdp=N)", "per-device peak GiB", "params + AdamW state per device GiB"]
    header += ["(state)/N + activations of N=1, GiB", "analysis s"]
    return table(header, ["---:"] * 5, rows)


def sharding_claims(r: Results) -> list[str]:
    data = r.json(SHARDING)
    first, big = data["rows"][0], data["rows"][-1]
    one = (
        "one sequence"
        if first["batch_per_device"] == 1
        else f"{first['batch_per_device']} sequences"
    )
    return [
        f"({first['policy']}, {first['model']}, s={first['seq_len']}, {one} per device, "
        f"{first['target']} deviceless, jax {data['meta']['jax']})",
        f"{big['model']} over {big['devices']} GPUs ({big['mesh']},",
        f"{big['peak_gib']:.2f} GiB per device, analysed in {big['analysis_s']:.1f} s",
    ]


# ---------------------------------------------------------------- training demos

TRAIN = ("train/policies.json", "train/resume.json", "train/accumulation.json")


def _remat_ratios(acc: dict[str, Any]) -> list[float]:
    return [m["temp_ratio"] for p, m in acc["memory"].items() if p != "no-remat"]


def train_demos(r: Results) -> str:
    pol, res, acc = (r.json(p) for p in TRAIN)
    c, env = pol["config"], pol["environment"]
    widened = ", ".join(f"{k} {v}" for k, v in sorted(c["overrides"].items(), reverse=True))
    intro = wrap(
        f"From `python experiments/train_demos.py` ({c['preset']} widened to {widened}, batch "
        f"{c['batch_size']}×{c['seq_len']}, {OPTIMIZERS[c['optimizer']]}, {c['steps']} steps; "
        f"{env['cpu_count']}-core {env['processor']} CPU, XLA:{env['backend'].upper()}, "
        f"jax {env['jax']}; "
        f"`experiments/results/train/`):"
    )
    bitwise = (
        " (the three remat policies bitwise)"
        if pol["remat_policies_bitwise_equal_to_each_other"]
        else ""
    )
    lines = [
        f"- {joined(pol['policies'])}: loss curves agree to {sci(pol['max_abs_loss_diff'])} "
        f"nats{bitwise}. On the CPU offload moves nothing to host."
    ]
    grads = acc["first_update"]["grads_max_abs_diff"]
    equal = res["losses_bitwise_equal"] and res["final_state_bitwise_equal"]
    outcome = (
        f"all {res['steps_bitwise_equal']} losses and the final state are bitwise equal to the "
        "uninterrupted run"
        if equal
        else f"losses within {sci(res['max_abs_loss_diff'])} of the uninterrupted run (not bitwise)"
    )
    lines.append(
        f"- Killed after {res['killed_after_updates']} updates and resumed from checkpoint "
        f"{res['resumed_from_checkpoint']}: {outcome}."
    )
    lines.append(
        f"- {acc['micro_batches']} micro-batches of {acc['micro_batch']} vs one batch of "
        f"{acc['global_batch']}: gradients within {sci(grads)}; compiled temp memory "
        f"{acc['memory']['no-remat']['temp_ratio']:.2f}× smaller with no-remat "
        f"({span(_remat_ratios(acc), '{:.1f}')}× with remat; the float32 gradient sum and "
        "optimizer temporaries do not shrink)."
    )
    return intro + "\n\n" + "\n".join(wrap(line, bullet=True) for line in lines) + "\n"
