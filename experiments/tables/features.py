"""Renderers of the docs' generated tables for the timeline, layer structure, crash safety
and your-own-model results (registered in ``registry.TABLES``)."""

from __future__ import annotations

from typing import Any

from fmt import GIB, MIB, Results, table

from remat_kit.sweep.results import option_markdown

TIMELINE = "timeline/bench.json"
STRUCTURE = ("structure/llama3-8b.jsonl", "structure/llama3-8b-cudnn.jsonl")
CHEN = "structure/chen.jsonl"
SOAK = "soak/soak.json"
OWN_MODEL = "own_model/linen_lm_h100-sxm.json"
OPTIONS = "options/sweep.jsonl"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def timeline_table(r: Results) -> str:
    """Peak as run vs the policy alone (XLA's remat pass off), both recompute ratios."""
    bench = r.json(TIMELINE)
    rows = []
    for x in bench["timeline"]["policies"]:
        rows.append([
            x["policy"], f"{x['peak_gib']:.2f}", f"{x['timeline_max_gib']:.2f}",
            f"{x['policy_only_peak_gib']:.2f}" if x.get("policy_only_peak_gib") else "-",
            f"{x['recompute_ratio_policy']:.2f} / {x['recompute_ratio_compiled']:.2f}",
            str(x.get("xla_remat_instructions") or 0), x["peak_phase"],
        ])  # fmt: skip
    header = ["policy", "peak GiB (as run)", "timeline max GiB", "policy alone GiB",
              "FLOPs × policy / compiled", "XLA remat instr.", "peak in"]  # fmt: skip
    out = table(header, ["---", "---:", "---:", "---:", "---:", "---:", "---"], rows)
    base, tl = bench["baseline"], bench["timeline"]
    return out + (
        f"\nThe four analyses with timelines and the pass-off compiles: {tl['wall_s']:.1f} s wall "
        f"({tl['cpu_s']:.1f} CPU-s) against {base['wall_s']:.1f} s ({base['cpu_s']:.1f} CPU-s) "
        f"without (x{tl['wall_s'] / base['wall_s']:.2f} wall), 2-core CPU under load "
        f"{base['loadavg_before'][0]:.0f}, jax {tl['jax']} (`{bench['command']}`).\n"
    )


def structure_table(r: Results) -> str:
    """Per-layer vs nested vs partial remat and chunked loss, llama3-8b on h100-sxm."""
    rows = []
    for path in STRUCTURE:
        for x in r.jsonl(path):
            rows.append([
                x["variant"], x["attention"], _gib(x["peak_bytes"]),
                _gib(x["stored_residual_bytes"]), _gib(x["stored_stacked_bsh_bytes"]),
                _gib(x.get("logits_live_at_peak_bytes")),
                f"{x['flops_ratio_traced']:.3f}", f"{x['flops_ratio']:.3f}",
            ])  # fmt: skip
    header = ["variant", "attention", "peak GiB", "stored GiB", "layer inputs / carries GiB",
              "logits live at peak GiB", "FLOPs × traced", "FLOPs × compiled"]  # fmt: skip
    return table(header, ["---", "---", *["---:"] * 6], rows)


def chen_table(r: Results) -> str:
    """Stored layer inputs against L: per-layer save-nothing vs nested (sqrt(L) groups)."""
    rows: dict[int, dict[str, Any]] = {}
    for x in r.jsonl(CHEN):
        rows.setdefault(x["num_layers"], {})[x["variant"]] = x
    out = []
    for layers, v in sorted(rows.items()):
        per = v.get("per-layer save-nothing")
        nested = next(
            (x for k, x in v.items() if k.startswith("nested") and "save-nothing" in k), None
        )
        chen = next((x for k, x in v.items() if k.startswith("nested") and "no remat" in k), None)
        if per is None or nested is None:
            continue
        out.append([
            str(layers), str(nested["outer_groups"]),
            f"{per['stored_stacked_bsh_bytes'] / MIB:.0f} → "
            f"{nested['stored_stacked_bsh_bytes'] / MIB:.0f}",
            f"{per['peak_less_arguments_bytes'] / MIB:.0f}",
            f"{nested['peak_less_arguments_bytes'] / MIB:.0f}",
            f"{v['no-remat']['peak_less_arguments_bytes'] / MIB:.0f} → "
            f"{chen['peak_less_arguments_bytes'] / MIB:.0f}" if chen and "no-remat" in v else "-",
        ])  # fmt: skip
    header = [
        "L",
        "G",
        "stored layer inputs MiB (per-layer → nested)",
        "peak MiB per-layer save-nothing",
        "peak MiB nested",
        "peak MiB no-remat → Chen",
    ]
    return table(header, ["---:"] * 6, out)


def soak_table(r: Results) -> str:
    """Kills and resumes of the soak benchmark, with where the kills landed."""
    d = r.json(SOAK)
    rows = [
        [what, str(x["kills"]), str(x["killed_while_running"]),
         f"{x.get('killed_after_first_event', '-')} / {x.get(landed, '-')}",
         str(x["failed_resumes"]), str(x["lost"]), str(x["duplicated"]),
         f"{x['final_equal']}/{x['kills']}"]
        for what, x, landed in (
            ("experiments/train.py", d["train"], "resumed_from_checkpoint"),
            ("experiments/sweep.py --config quick", d["sweep"], "rows_kept_at_kill"),
        )
    ]  # fmt: skip
    header = [
        "run",
        "kills",
        "killed mid-run",
        "after the first step or row / with a checkpoint or row to resume from",
        "failed resumes",
        "lost",
        "duplicated",
        "bitwise equal to uninterrupted",
    ]
    return table(header, ["---", *["---:"] * 7], rows) + (
        f"\n`{d['command']}`, {d['machine']}, jax {d['jax']}, {d['wall_s'] / 60:.0f} min.\n"
    )


def own_model_table(r: Results) -> str:
    """The model written elsewhere under every named policy and the user's own spec."""
    d = r.json(OWN_MODEL)
    rows = []
    for x in d["reports"]:
        kept = ", ".join(f"{k.split('@')[0]}{' (host)' if k.endswith('@host') else ''}"
                         for k in sorted(x["residuals"])) or "-"  # fmt: skip
        note = (
            "runs as save-nothing"
            if any("runs as save-nothing" in w for w in x["warnings"])
            else ""
        )
        rows.append([x["policy"], _gib(x["peak_bytes"]), _gib(x["host_bytes"]),
                     f"{x['recompute_ratio']:.3f}", kept, note])  # fmt: skip
    header = ["policy", "peak GiB", "host GiB", "FLOPs ×", "tagged residuals kept", "note"]
    rec = d["recommend"]
    s = d["shape"]
    out = table(header, ["---", "---:", "---:", "---:", "---", "---"], rows)
    out += (
        f"\n{d['model']}: d_model {s['emb_dim']}, {s['num_heads']} heads, d_ff {s['mlp_dim']}, "
        f"{s['num_layers']} layers, vocab {s['vocab_size']}, batch {s['batch']} x {s['seq']} "
        f"tokens, float32, AdamW; {d['target']} compiled deviceless on a "
        f"{d['machine'].split(',')[0]}, "
        f"jax {d['jax']}; {len(d['reports'])} policies analysed in {d['analyze_s']:.0f} s.\n\n"
        f"Doctor: save-dots-no-batch: {'; '.join(d['doctor']['save-dots-no-batch']) or 'ok'}; "
        f"the misspelled `mlpwi_typo=save`: {(d['doctor']['mlpwi_typo=save'] or ['ok'])[0]}\n\n"
        f"Recommend, budget {_gib(rec['budget_bytes'])} GiB (half-way between no-remat's and "
        f"save-dots' peaks), `--solve`: pick **{rec['pick']}** at {_gib(rec['pick_peak_bytes'])} "
        f"GiB, {rec['compiles']} compiles in {d['recommend_s']:.0f} s.\n"
    )
    return out


RECOMMEND_STRUCTURE = ("recommend/h100_structure.json", "recommend/h200_structure.json")


def recommend_structure_table(r: Results) -> str:
    """recommend with the structure dimensions: the pick, its options and what they did."""
    rows = []
    for path in RECOMMEND_STRUCTURE:
        d = r.json(path)
        p = d["pick"]
        q = {**p, "nested_remat": True} if p.get("nested_groups") else p
        keys = ("attention", "loss_chunk_size", "nested_remat", "nested_groups", "remat_layers")
        opts = ", ".join(f"{k}={q[k]!r}" for k in keys if q.get(k) not in (None, "xla"))
        rows.append([
            f"{d['model']} s={d['seq_len']} b={d['batch_size']}, {d['target']}, "
            f"budget {_gib(d['budget_bytes'])} GiB",
            f"{p['policy']}" + (f" ({opts})" if opts else ""),
            _gib(p["peak_bytes"]), f"{1000 * p['step_time_s']:.1f}",
            _against_save_nothing(d), str(d["compiles"]), d.get("made_fit") or "-",
        ])  # fmt: skip
    header = ["run", "pick", "peak GiB", "est. step ms", "save-nothing on every layer",
              "compiles", "what the options did"]  # fmt: skip
    return table(header, ["---", "---", "---:", "---:", "---", "---:", "---"], rows)


def _against_save_nothing(d: dict) -> str:
    """The plain step's save-nothing candidate (every layer, no structural option) against the
    pick: its compiled peak, estimated step time and how much faster the pick is."""
    plain = [
        c for c in d["candidates"]
        if c["policy"] == "save-nothing" and c.get("attention", "xla") == "xla"
        and not any(c.get(k) for k in ("remat_layers", "nested_groups", "loss_chunk_size"))
    ]  # fmt: skip
    if not plain:
        return "not compiled"
    c, p = plain[0], d["pick"]
    if not c["fits"]:
        return f"{_gib(c['peak_bytes'])} GiB, does not fit"
    gain = 1 - p["step_time_s"] / c["step_time_s"]
    return (
        f"{_gib(c['peak_bytes'])} GiB, est. {1000 * c['step_time_s']:.1f} ms "
        f"(pick {100 * gain:.1f}% less)"
    )


def options_table(r: Results) -> str:
    """The options sweep (one option at a time against the plain step), as the sweep's own
    summary writes it (:func:`remat_kit.sweep.results.option_markdown`)."""
    rows = r.jsonl(OPTIONS)
    first = rows[0]
    return option_markdown(rows) + (
        f"\n{first['cpu_count']}-CPU {first['machine']} ({first['backend']} backend), jax "
        f"{first['jax']}; GPU targets compiled deviceless (no step time: `-`).\n"
    )


# ---------------------------------------------------------------- the policy registry

#: What a policy selecting by kind keeps on device, in words.
_KEPT_BY_BASE = {
    "everything": "everything",
    "dots": "every matmul output",
    "dots_no_batch": "weight-matmul outputs",
}


def maxtext_policies_table(r: Results) -> str:
    """MaxText's ``remat_policy`` names and remat-kit's policy saving the same names
    (:data:`remat_kit.policies.MAXTEXT_POLICIES`): not from results; ``r`` unused."""
    from remat_kit.policies import MAXTEXT_POLICIES, policy_names

    rows = [
        [f"`{name}`", f"`{meant}`" + ("" if meant in policy_names() else " (per-tag spec)")]
        for name, meant in MAXTEXT_POLICIES.items()
    ]
    rows.insert(0, ["`minimal`", "`minimal` (the same name)"])
    rows.append(["`custom`", "a per-tag spec: `device` is `save`, `remat` is `recompute`"])
    return table(["MaxText remat_policy", "remat-kit"], ["---"] * 2, rows)


def policies_table(r: Results) -> str:
    """The registered policies (:func:`remat_kit.policy_specs`): not from results; ``r`` unused."""
    from remat_kit import policy_specs

    def names(tags: frozenset[str]) -> str:
        return ", ".join(sorted(tags)) or "\u2014"

    rows = [
        [
            f"`{s.name}`",
            _KEPT_BY_BASE.get(s.base) or names(s.save),
            names(s.offload),
            s.description,
            s.source,
        ]
        for s in policy_specs().values()
    ]
    header = ["policy", "saved on device", "offloaded to host", "what it does", "source"]
    return table(header, ["---"] * 5, rows)
