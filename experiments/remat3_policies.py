"""What each named policy does under each remat implementation of JAX, measured (issue 31).

Command (CPU machine; the GPU target compiles deviceless with the CUDA plugin)::

    JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/remat3_policies.py     # ~2-4 min, 2 cores
    python experiments/remat3_policies.py --markdown    # the docs/remat3.md tables, from the JSON
    python experiments/remat3_policies.py --write-docs docs/remat3.md    # rewrite them there

Writes ``experiments/results/remat3/policies.json``: machine, backend and jax version, and

1. ``policies``: per implementation (``classic``, ``remat3``) and registered policy, the probe of
   :func:`remat_kit.policies.policy_effect` (promised and observed action per checkpoint name,
   what it runs as) beside what the analyzer measures for tiny-gpt (b=2, s=64, scanned) compiled
   for a deviceless ``h100-sxm``: device peak, compiled host bytes, the jaxpr's residual bytes
   on device and on host, the compiled program's hash (two policies with one hash compiled to
   one program), ``runs_as`` and the report's one-line warning.
2. ``offload_formulations``: the ways of offloading under ``jax_remat3`` tried on this JAX, each
   on a 8-layer [256, 512] float32 MLP (scanned, and unrolled) under both implementations: the
   memory kind of the named residual in the jaxpr and the compiled host bytes (or the compile
   error): ``save_and_offload_only_these_names`` (the registry's), ``host_copy_named`` (public
   API: name a ``jax.device_put`` host copy and save that name with ``save_only_these_names``,
   the forward value taken from the copy brought back by a custom_jvp whose tangent is the
   original's), and ``custom_remat`` (``jax._src.ad_checkpoint.custom_remat``, private in jax
   0.10.2 and with another signature in 0.11: residual put on host by its forward rule; it runs
   only inside a ``jax_remat3`` checkpoint).

Expected on a 2-core x86 VM, jax 0.10.2: under classic remat every policy runs as named and the
offload policies put bytes in host memory; under ``jax_remat3`` the three offload policies run as
save-nothing (same program hash, host bytes 0) and the others as named; no formulation offloads
under ``jax_remat3`` (host bytes 0 or a compile error). JAX offloads under ``jax_remat3`` from
jax 0.11.0 (``SaveAndOffloadOnlyTheseNames``, commit b69022a): the GPU check's
``grads/remat3`` point records what jax 0.11.2 does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "remat3"
MODEL, BATCH, SEQ, TARGET = "tiny-gpt", 2, 64, "h100-sxm"


def _policy_rows() -> list[dict]:
    import remat_kit as rk
    from remat_kit import policies as RP

    names = rk.policy_names()
    rows = []
    for impl in RP.IMPLEMENTATIONS:
        with RP.using(impl):  # traces (and the jobs' notes) under this implementation
            t0 = time.perf_counter()
            reports = rk.analyze_policies(
                rk.preset(MODEL, BATCH, SEQ),
                names,
                target=TARGET,
                raise_errors=False,
                compare_offload=False,
            )
            wall = time.perf_counter() - t0
        for name, rep in zip(names, reports, strict=True):
            effect = RP.policy_effect(name, impl)
            row = {"implementation": impl, "policy": name, "probe": effect.to_dict()}
            if isinstance(rep, Exception):
                row["error"] = str(rep)
            else:
                line = effect.line()
                row.update(
                    peak_bytes=rep.peak_bytes,
                    host_bytes=rep.host_bytes,
                    activation_bytes=rep.activation_bytes,
                    offloaded_bytes=rep.offloaded_bytes,
                    program_sha256=rep.program_sha256,
                    remat_impl=rep.remat_impl,
                    runs_as=rep.runs_as,
                    warning=next((w for w in rep.warnings if w == line), None),
                )
            rows.append(row)
        print(f"[remat3] {impl}: {len(names)} policies in {wall:.1f} s", flush=True)
    return rows


def _formulation_rows() -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    import remat_kit as rk
    from remat_kit import policies as RP
    from remat_kit.walker import saved_residuals

    cp = jax.checkpoint_policies

    @jax.custom_jvp
    def value_of_first(a, b):  # the value of a, the tangent of b
        return a

    @value_of_first.defjvp
    def _(primals, tangents):
        return primals[0], tangents[1]

    def host_copy_named(x, name):
        host = jax.device_put(jax.lax.stop_gradient(x), jax.memory.Space.Host)
        back = jax.device_put(checkpoint_name(host, name), jax.memory.Space.Device)
        return value_of_first(back, x)

    def custom_remat_offload():
        from jax._src.ad_checkpoint import custom_remat  # private in jax 0.10.2

        def fwd(x):  # the value, and its host copy as the residual
            return x, jax.device_put(x, jax.memory.Space.Host)

        def rem(res, x):
            return jax.device_put(res, jax.memory.Space.Device), None

        def bwd(_, g):
            return None, g

        off = custom_remat(lambda x: x, fwd, rem, bwd)
        return lambda x, name: off(checkpoint_name(x, name))

    offload = cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
        offload_src="device", offload_dst="pinned_host",
    )  # fmt: skip
    forms = {
        "save_and_offload_only_these_names": (lambda: checkpoint_name, offload),
        "host_copy_named": (lambda: host_copy_named, cp.save_only_these_names("h")),
        "custom_remat": (custom_remat_offload, cp.nothing_saveable),
        "save_only_these_names (on device, for scale)": (
            lambda: checkpoint_name, cp.save_only_these_names("h")
        ),
        "nothing_saveable (for scale)": (lambda: checkpoint_name, cp.nothing_saveable),
    }  # fmt: skip

    def make(tag, policy, scanned):
        def layer(h, w):  # h [256, 512], w [512, 512]
            y = tag(jnp.tanh(h @ w), "h")
            return jnp.sin(y @ w.T) + h, None

        step = jax.checkpoint(layer, policy=policy)

        def loss(ws, x):  # ws [8, 512, 512], x [256, 512]
            if scanned:
                h, _ = jax.lax.scan(step, x, ws)
            else:
                h = x
                for i in range(ws.shape[0]):
                    h, _ = step(h, ws[i])
            return jnp.sum(h * h)

        return loss

    ws = jax.ShapeDtypeStruct((8, 512, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    rows = []
    for impl in RP.IMPLEMENTATIONS:
        for form, (tag_of, policy) in forms.items():
            for scanned in (True, False):
                row = {"implementation": impl, "formulation": form, "scanned": scanned}
                with RP.using(impl):
                    try:
                        loss = make(tag_of(), policy, scanned)
                        kinds = sorted(
                            {r.memory for r in saved_residuals(loss, ws, x) if r.tag == "h"}
                        )
                        row["residual_memory"] = kinds or ["recomputed"]
                        rep = rk.analyze(jax.jit(jax.grad(loss)), ws, x, target=TARGET)
                        row.update(host_bytes=rep.host_bytes, peak_bytes=rep.peak_bytes)
                    except Exception as err:  # a failure is this formulation's result
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                rows.append(row)
                print(f"[remat3] {impl} {form} scanned={scanned}: {row}", flush=True)
    return rows


def run(out: Path) -> dict:
    import jax

    from remat_kit.memory.xla_compile import jax_backend_description
    from remat_kit.sweep.results import environment

    t0 = time.perf_counter()
    result = {
        "command": "JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/remat3_policies.py",
        "model": MODEL, "batch_size": BATCH, "seq_len": SEQ, "target": TARGET,
        "backend": jax_backend_description("cuda", True),
        "jax": jax.__version__,
        "machine": {k: environment()[k] for k in ("cpu_model", "cpu_count", "machine")},
        "policies": _policy_rows(),
        "offload_formulations": _formulation_rows(),
    }  # fmt: skip
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policies.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(result: dict) -> str:
    """The tables of docs/remat3.md from a ``policies.json`` result."""
    by = {(r["implementation"], r["policy"]): r for r in result["policies"]}
    names = list(dict.fromkeys(r["policy"] for r in result["policies"]))
    head = (
        f"{result['model']}, batch {result['batch_size']}, seq {result['seq_len']}, target "
        f"{result['target']} ({result['backend']}); machine: {result['machine']['cpu_model']} "
        f"({result['machine']['cpu_count']} cores). Command: `{result['command']}`."
    )
    lines = [
        head,
        "",
        "| policy | classic remat: runs as | host MiB | device peak MiB "
        "| jax_remat3: runs as | host MiB | device peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        cells = [name]
        for impl in ("classic", "remat3"):
            r = by[(impl, name)]
            runs = r["probe"]["runs_as"]
            cells += [
                "as named" if runs == "as named" else f"**{runs}**",
                _gib(r.get("host_bytes")),
                _gib(r.get("peak_bytes")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Offload formulations tried under each implementation (8-layer [256, 512] float32 MLP, "
        "compiled for the same target):",
        "",
        "| formulation | layers | implementation | residual in the jaxpr | compiled host MiB |",
        "|---|---|---|---|---|",
    ]
    for r in result["offload_formulations"]:
        host = r["error"][:90] if "error" in r else _gib(r.get("host_bytes"))
        memory = ", ".join(r.get("residual_memory", ["-"]))
        layers = "scan" if r["scanned"] else "unrolled"
        lines.append(
            f"| {r['formulation']} | {layers} | {r['implementation']} | {memory} | {host} |"
        )
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- remat3-table:begin -->", "<!-- remat3-table:end -->"


def with_tables(page: str, result: dict) -> str:
    """``page`` (docs/remat3.md) with the text between its table markers replaced by
    :func:`markdown` of ``result``.

    Raises:
      ValueError: the page lacks the markers.
    """
    if BEGIN not in page or END not in page:
        raise ValueError(f"the page has no {BEGIN} ... {END} section")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{markdown(result)}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="output folder")
    parser.add_argument(
        "--markdown", action="store_true", help="print the docs tables from OUT/policies.json"
    )
    parser.add_argument(
        "--write-docs", metavar="PAGE", help="rewrite PAGE's table section from OUT/policies.json"
    )
    args = parser.parse_args(argv)
    if args.write_docs:
        page = Path(args.write_docs)
        result = json.loads((Path(args.out) / "policies.json").read_text())
        page.write_text(with_tables(page.read_text(), result))
        return 0
    if args.markdown:
        print(markdown(json.loads((Path(args.out) / "policies.json").read_text())), end="")
        return 0
    sys.path.insert(0, str(REPO))
    result = run(Path(args.out))
    print(markdown(result), end="")
    print(f"[remat3] done in {result['wall_s']} s on {platform.node()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
