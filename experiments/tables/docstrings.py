"""Claims checked in the experiments' docstrings ("Expected: ..."): for each, the exact words
(ASCII, as the docstrings write them) that the docstring must contain, rendered from the
committed results. Registered in ``CLAIMS`` of experiments/tables/registry.py."""

from __future__ import annotations

from fmt import GIB, Results, order_of, pct, span
from sections import (
    PER_LAYER,
    PER_LAYER_TARGET,
    RECOMMEND_RUNS,
    TRAIN,
    grid_text,
    policy_reports,
    shorter_seq,
    summary_run,
    sweep_local,
    sweep_rows,
)


def sweep_claims_cpu_doc(r: Results) -> list[str]:
    """Figures of experiments/configs/cpu.py's docstring (ASCII minus, as the docstring has)."""
    _, seqs, rows = sweep_local(r)
    _, seconds, _ = summary_run(r)
    grid, first = grid_text(r, 1)
    shape = first["model_fields"]
    out = [
        f"took {seconds // 60} min {seconds % 60} s of wall time",
        f"``{grid.replace(' (', '`` (byte-level, ', 1)}, {shape['num_layers']} layers, "
        f"d_model {shape['d_model']})",
    ]

    def peak(policy: str, s: int) -> str:
        return pct(rows[policy, s]["peak_bytes"], rows["no-remat", s]["peak_bytes"], "-")

    s1, s2 = seqs
    out.append(
        f"predicted peak {peak('save-nothing', s1)} (s={s1}) / {peak('save-nothing', s2)} (s={s2}) "
        f"with full remat, {peak('save-dots-no-batch', s1)} / {peak('save-dots-no-batch', s2)} "
        f"with ``save-dots-no-batch``; compiled matmul FLOPs "
        f"x{span((rows['save-nothing', s]['recompute_ratio'] for s in seqs), dash='-')} and "
        f"x{span((rows['save-dots-no-batch', s]['recompute_ratio'] for s in seqs), dash='-')}"
    )
    cpu = [
        100 * (x["step_cpu_s"] / rows["no-remat", s]["step_cpu_s"] - 1)
        for (p, s), x in rows.items()
        if p != "no-remat"
    ]
    out.append(f"(the others {min(cpu):+.1f}% to {max(cpu):+.1f}%)")
    worst = max(
        max(abs(a - b) for a, b in zip(x["losses"], rows["no-remat", s]["losses"], strict=True))
        for (p, s), x in rows.items()
    )
    out.append(f"every policy trains to the same losses (within {order_of(worst)} nats)")
    gpu = sweep_rows(r, local=False)
    big = [
        (m, x["peak_bytes"] / GIB)
        for (m, p, s), x in gpu.items()
        if p == "no-remat" and not x["fits"]
    ]
    fit = all(x["fits"] for (m, p, s), x in gpu.items() if p != "no-remat" and m in dict(big))
    sizes = " and ".join(f"{g:.0f}" for _, g in big)
    out.append(
        f"do not fit without remat ({sizes} GiB predicted) and fit with "
        f"{'either' if fit else 'not every'} remat"
    )
    return out


def analyze_claims_doc(r: Results) -> list[str]:
    """experiments/bench_analyze.py's docstring."""
    peak = policy_reports(r)["save-nothing"]["peak_bytes"] / GIB
    rows = [
        x
        for x in r.jsonl(PER_LAYER)
        if x["target"] == PER_LAYER_TARGET and x["policy"] == "save-nothing"
    ]
    full = all(x["compiled_bytes"] == x["textbook_bytes"] for x in rows)
    return [
        f"save-nothing peaks at {peak:.1f} GiB",
        f"full remat keeps {'exactly' if full else 'more than'} 2sbh per layer on the H100 target",
    ]


def recommend_claims_doc(r: Results) -> list[str]:
    """experiments/bench_recommend.py's docstring."""
    rec = r.json(RECOMMEND_RUNS[0])
    advice = sum(c["found_by"] == "advice" for c in rec["candidates"])
    named = [c for c in rec["candidates"] if c["found_by"] == "named"]
    least = min(named, key=lambda c: c["peak_bytes"])
    shorter = shorter_seq(rec)
    budget = f"{rec['budget_bytes'] / GIB:.2f} GiB"
    return [
        f"default budget (memory less 5% = {budget})",
        f"{rec['compiles']} compiles ({rec['compiles'] - advice} named programs + {advice} for the "
        f"shorter-sequence advice), nothing fits at {budget} (least: {least['policy']} at "
        f"{least['peak_bytes'] / GIB:.2f} GiB), seq {shorter['seq_len']} fits (compiled)",
    ]


def train_claims_doc(r: Results) -> list[str]:
    """experiments/train_demos.py's docstring."""
    pol, _, acc = (r.json(p) for p in TRAIN)
    losses = pol["runs"]["no-remat"]["losses"]
    ratios = [m["temp_ratio"] for m in acc["memory"].values()]
    return [
        f"loss {losses[0]:.1f} -> ~{losses[-1]:.1f} nats/byte in {len(losses)} steps",
        f"within ~{order_of(pol['max_abs_loss_diff'])} nats of no-remat",
        f"accumulation gradients within ~{order_of(acc['first_update']['grads_max_abs_diff'])}, "
        f"temp memory ~{span(ratios, '{:.1f}', '-')}x smaller with "
        f"{acc['micro_batches']} micro-batches",
    ]
