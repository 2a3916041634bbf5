"""A model written elsewhere, through remat-kit: tag, analyze, doctor, recommend (issue 15).

The model is ``tests/user_models/linen_lm.py``: a decoder-only LM in flax.linen written the way
flax's lm1b example writes one (sinusoidal positions, ReLU MLP, linen's attention, an unrolled
loop over layers, ``nn.remat`` around each block when given a policy), knowing nothing of
remat-kit. Here at a GPT-2-medium-like shape (d_model 1024, 16 heads, d_ff 4096, 8 layers,
vocab 32000), batch 8 x 1024 tokens, float32, AdamW, compiled deviceless for an H100 SXM.

Steps: (1) tag its submodules with MaxText's names by module path (``remat_kit.tag_linen``) so
the named policies apply; (2) ``analyze_policies`` on every named policy plus a per-tag spec;
(3) the doctor on a correct policy and on a misspelled tag; (4) ``recommend`` under a budget
set between the compiled peaks so the choice matters.

Command (2-core CPU, ~3-6 min; GPU target compiled deviceless)::

    JAX_PLATFORMS=cpu python experiments/bench_own_model.py

Writes ``experiments/results/own_model/linen_lm_h100-sxm.json``. ``--analysis-only``: step (2)
alone, timed and printed, nothing written (the issue-29 benchmark: ``REMAT_KIT_NO_CACHE=1
JAX_PLATFORMS=cpu python experiments/bench_own_model.py --analysis-only``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/user_models: the model written elsewhere

import remat_kit  # noqa: E402
from remat_kit import Program  # noqa: E402
from remat_kit.doctor import check_policies  # noqa: E402
from remat_kit.recommend import recommend  # noqa: E402
from tests.user_models import linen_lm  # noqa: E402

OUT = REPO / "experiments" / "results" / "own_model" / "linen_lm_h100-sxm.json"
TARGET = "h100-sxm"
CONFIG = linen_lm.Config(
    vocab_size=32000, emb_dim=1024, num_heads=16, mlp_dim=4096, num_layers=8, max_len=1025
)
BATCH, SEQ = 8, 1025  # 1024 tokens in, 1024 targets
#: Module path glob -> MaxText checkpoint name (the paths linen gives this model's modules).
TAGS = {
    "layers_*/MultiHeadDotProductAttention_0/query": "query_proj",
    "layers_*/MultiHeadDotProductAttention_0/key": "key_proj",
    "layers_*/MultiHeadDotProductAttention_0/value": "value_proj",
    "layers_*/MultiHeadDotProductAttention_0/out": "out_proj",
    "layers_*/MlpBlock_0/Dense_0": "mlpwi",
    "layers_*/MlpBlock_0/Dense_1": "mlpwo",
}
OWN_SPEC = {"query_proj": "save", "key_proj": "save", "value_proj": "save", "mlpwi": "offload"}


def program() -> Program:
    """The tagged model as a remat-kit Program (on the command line:
    ``--model experiments/bench_own_model.py:program``)."""

    def wrap(apply):
        return remat_kit.tag_linen(apply, TAGS)

    params, opt_state, tokens = linen_lm.abstract_args(BATCH, SEQ, CONFIG)
    return Program.from_step(
        lambda p: linen_lm.make_step(p, CONFIG, apply_wrapper=wrap),
        params, opt_state, tokens, donate_argnums=(0, 1),
        make_loss=lambda p: linen_lm.make_loss(p, CONFIG, apply_wrapper=wrap),
        loss_args=(params, tokens), name="linen-lm (flax lm1b style)",
    )  # fmt: skip


def _row(label: str, r) -> dict:
    return {
        "policy": label,
        "peak_bytes": r.peak_bytes,
        "host_bytes": r.host_bytes,
        "activation_bytes": r.activation_bytes,
        "recompute_ratio": r.recompute_ratio,
        "residuals": {
            f"{t.tag}@{t.memory}": t.nbytes for t in r.residuals if not t.tag.startswith("<")
        },
        "warnings": list(r.warnings),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--analysis-only", action="store_true", help="time step (2) only")
    args = parser.parse_args()
    prog = program()
    t0, cpu0 = time.perf_counter(), time.process_time()
    names = remat_kit.policy_names()
    reports = remat_kit.analyze_policies(prog, [*names, OWN_SPEC], target=TARGET)
    analyze_s = time.perf_counter() - t0
    rows = [_row(n, r) for n, r in zip([*names, "own spec"], reports, strict=True)]
    for row in rows:
        print(f"{row['policy']:22s} peak {row['peak_bytes'] / 2**30:7.2f} GiB  host "
              f"{row['host_bytes'] / 2**30:5.2f}  x{row['recompute_ratio']:.3f}")  # fmt: skip
    print(
        f"analysis: {len(rows)} policies in {analyze_s:.1f} s wall, "
        f"{time.process_time() - cpu0:.1f} s process CPU (jax {__import__('jax').__version__})"
    )
    if args.analysis_only:
        return
    t0 = time.perf_counter()
    doctor = {
        label: [f.line() for f in findings]
        for label, findings in zip(
            ["save-dots-no-batch", "mlpwi_typo=save"],
            check_policies(prog, ["save-dots-no-batch", {"mlpwi_typo": "save"}], TARGET),
            strict=True,
        )
    }  # fmt: skip
    doctor_s = time.perf_counter() - t0
    print(json.dumps(doctor, indent=1))
    # A budget half-way between no-remat's and save-dots' compiled peaks: no-remat must not fit.
    peaks = {row["policy"]: row["peak_bytes"] for row in rows}
    budget = (peaks["no-remat"] + peaks["save-dots"]) // 2
    t0 = time.perf_counter()
    rec = recommend(prog, target=TARGET, budget=budget, solve=True)
    recommend_s = time.perf_counter() - t0
    pick = rec.pick
    recommended = {
        "budget_bytes": budget,
        "pick": None if pick is None else pick.label,
        "pick_peak_bytes": None if pick is None else pick.peak_bytes,
        "pick_step_s": None if pick is None else pick.step_time_s,
        "compiles": rec.compiles,
        "candidates": [
            {"label": c.label, "peak_bytes": c.peak_bytes, "fits": c.fits, "step_s": c.step_time_s}
            for c in rec.candidates
        ],
        "notes": list(rec.notes),
    }
    print(json.dumps(recommended, indent=1, default=str))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "model": prog.name,
        "shape": {"batch": BATCH, "seq": SEQ - 1, **vars(CONFIG)},
        "target": TARGET,
        "jax": __import__("jax").__version__,
        "machine": "2-core x86_64 CPU, XLA:CPU; GPU target compiled deviceless",
        "analyze_s": round(analyze_s, 1),
        "doctor_s": round(doctor_s, 1),
        "reports": rows,
        "doctor": doctor,
        "recommend_s": round(recommend_s, 1),
        "recommend": recommended,
    }
    OUT.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
