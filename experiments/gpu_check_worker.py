"""What runs in each clean process of ``experiments/gpu_check.py`` (one point per process).

Every call whose API may differ between JAX versions is made through :func:`attempt`, so that a
failure costs one field of one point (recorded as ``errors[field]``: the exception text), not the
point, and never the run. ``run(kind, args)`` returns a JSON-ready dict with ``status`` ``ok``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from gpu_check_report import label

import remat_kit as rk
from remat_kit import policies as RP

_OOM_MARKERS = ("resource_exhausted", "out of memory", "oom")
#: A worker's result is the last stdout line with this prefix (JSON after it); a point may print
#: a partial result first, so that a timeout later in the point keeps what was measured.
RESULT_PREFIX = "GPU_CHECK_RESULT "


def emit(result: dict[str, Any]) -> None:
    """Print ``result`` as a result line (flushed: the parent reads it even after a kill)."""
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


def parse(stdout: str) -> dict[str, Any] | None:
    """The last result line of a worker's stdout, or None."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None


def classify(text: str) -> str:
    """``oom`` when ``text`` (an error or a stderr) says the device ran out of memory."""
    return "oom" if any(m in text.lower() for m in _OOM_MARKERS) else "error"


def attempt(errors: dict[str, str], field: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with ``errors[field]`` set to the exception's type and message."""
    try:
        return fn()
    except Exception as err:  # a version difference must cost one field, not the point
        errors[field] = f"{type(err).__name__}: {str(err)[:1500]}"
        return None


def spec_of(policy: str | dict[str, str]) -> rk.PolicySpec:
    """A registered policy name or a custom ``{tag: "save" | "offload"}`` mapping, as a spec."""
    return rk.get_policy_spec(policy) if isinstance(policy, str) else rk.custom_spec(policy)


def model_config(name: str, policy: str | dict[str, str], f32: bool = False) -> rk.ModelConfig:
    """The preset with ``policy`` and scanned layers (remat takes effect on CPU only in a scan)."""
    config = rk.get_config(name).replace(remat_policy=spec_of(policy), scan_layers=True)
    return config.replace(dtype="float32", param_dtype="float32") if f32 else config


def memory_stats() -> dict[str, Any] | None:
    """``memory_stats()`` of the first device (None: the backend reports none, e.g. CPU)."""
    return jax.devices()[0].memory_stats()


def peak_bytes_in_use() -> int | None:
    stats = memory_stats()
    return (
        None
        if not stats or stats.get("peak_bytes_in_use") is None
        else int(stats["peak_bytes_in_use"])
    )


def compiled_memory(compiled: Any) -> dict[str, int | None]:
    """XLA's ``memory_analysis()`` of an executable: peak = argument + output + temp - alias.

    Fields are None where the backend gives None or -1 (unknown, never 0: jax#18954).
    """
    ma = compiled.memory_analysis()

    def field(name: str) -> int | None:
        v = getattr(ma, name, None)
        return None if v is None or v < 0 else int(v)

    parts = [field(f"{n}_size_in_bytes") for n in ("argument", "output", "temp", "alias")]
    peak = None if None in parts else parts[0] + parts[1] + parts[2] - parts[3]  # type: ignore[operator]
    return {"compiled_peak_bytes": peak, "compiled_host_bytes": field("host_temp_size_in_bytes")}


def model_flops_per_token(config: rk.ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B (Chowdhery et al. 2022, arXiv:2204.02311):
    ``6 N + 12 L H Q T``: N parameters used in matmuls (an untied input embedding is a lookup,
    not a matmul), L layers, H*Q = query heads x head dim, T = ``seq_len``; no recomputation."""
    params = rk.abstract_train_state(config, rk.make_optimizer("adamw")).params
    n = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        top = getattr(path[0], "key", str(path[0]))
        if top == "pos_embed" or (top == "embed" and not config.tied_embeddings):
            continue
        n += math.prod(leaf.shape)
    head_dim = config.d_model // config.num_heads
    return 6.0 * n + 12.0 * config.num_layers * config.num_heads * head_dim * seq_len


def preflight(args: dict[str, Any]) -> dict[str, Any]:
    errors: dict[str, str] = {}
    device = jax.devices()[0]
    target = attempt(errors, "local_target", lambda: rk.get_target("local"))
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": device.device_kind,
        "memory_stats": attempt(errors, "memory_stats", memory_stats),
        "local_target": None
        if target is None
        else {
            "description": target.description,
            "memory_bytes": target.memory_bytes,
            "peak_flops_bf16": target.peak_flops_bf16,
            "supports_host_offload": target.supports_host_offload,
        },
        "errors": errors,
    }


def _batch(config: rk.ModelConfig, batch_size: int, seq_len: int, seed: int) -> dict:
    """Random tokens: {"inputs", "targets"}: int32 [batch, seq]."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    shape = (batch_size, seq_len)
    return {
        "inputs": jax.random.randint(k1, shape, 0, config.vocab_size, jnp.int32),
        "targets": jax.random.randint(k2, shape, 0, config.vocab_size, jnp.int32),
    }


def _init_state(config: rk.ModelConfig, opt: Any, errors: dict) -> Any:
    """The initial train state, built on the host CPU and copied to the device, so that the
    init's own temporaries never count in the device's ``peak_bytes_in_use`` (falls back to
    an init on the device, noted in ``errors``, if the CPU backend is not there)."""
    init = jax.jit(lambda k: rk.init_train_state(config, opt, k))

    def on_host():
        with jax.default_device(jax.devices("cpu")[0]):
            host = init(jax.random.key(0))
        return jax.device_put(host, jax.devices()[0])

    state = attempt(errors, "host_init", on_host)
    return init(jax.random.key(0)) if state is None else state


def _run_steps(args: dict[str, Any], config: rk.ModelConfig, out: dict, errors: dict) -> None:
    """Init, compile and time the train step; the measured peak goes in ``out``."""
    opt = rk.make_optimizer("adamw")
    state = _init_state(config, opt, errors)
    batch = _batch(config, args["batch_size"], args["seq_len"], 1)
    jax.block_until_ready((state, batch))
    out["peak_bytes_before_step"] = peak_bytes_in_use()
    t0 = time.perf_counter()
    compiled = rk.make_train_step(config, opt).lower(state, batch).compile()
    out["compile_s"] = time.perf_counter() - t0
    out.update(attempt(errors, "compiled_memory", lambda: compiled_memory(compiled)) or {})
    times, losses = [], []
    for i in range(args["warmup"] + args["timed"]):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - t0
        losses.append(float(metrics["loss"]))
        if i >= args["warmup"]:
            times.append(elapsed)
    out["measured_peak_bytes"] = peak_bytes_in_use()
    out["measured_peak_note"] = (
        "memory_stats()['peak_bytes_in_use'] of a fresh process after init + steps"
        if out["measured_peak_bytes"] is not None
        else f"the {jax.default_backend()} backend reports no peak_bytes_in_use"
    )
    out.update(step_times_s=times, step_time_s=statistics.median(times), losses=losses)
    if not all(math.isfinite(x) for x in losses):
        errors["losses"] = f"non-finite loss: {losses}"


def _predict_fields(report: Any) -> dict[str, Any]:
    return {
        "peak_bytes": report.peak_bytes,
        "host_bytes": report.host_bytes,
        "peak_bytes_without_offload": report.peak_bytes_without_offload,
        "flops": report.flops,
        "flops_no_remat": report.flops_no_remat,
        "recompute_ratio": report.recompute_ratio,
        "memory_bytes": report.memory_bytes,
        # the roofline's estimated step (remat_kit.memory.roofline), set beside the measured one
        "step_time_s": getattr(report, "step_time_s", None),
        "step_time": _step_breakdown(getattr(report, "step_time", None)),
        "runs_as": report.runs_as,  # not None: the remat implementation changed the policy
        "warnings": list(report.warnings)[:5],
    }


def _step_breakdown(step: Any) -> dict[str, Any] | None:
    """The estimate's terms, its three costliest kernels and its device figures' source."""
    if step is None:
        return None
    d = step.to_dict()
    d["top"] = d["top"][:3]
    return d


def measure(args: dict[str, Any]) -> dict[str, Any]:
    """Measured peak and step time in this (fresh) process, then the analyzer's local view."""
    errors: dict[str, str] = {}
    out: dict[str, Any] = {"device_kind": jax.devices()[0].device_kind}
    config = model_config(args["model"], args["policy"])
    try:
        _run_steps(args, config, out, errors)
    except Exception as err:  # OOM is a result; the prediction below is still worth having
        out["run_status"] = classify(f"{type(err).__name__} {err}")
        errors["run"] = f"{type(err).__name__}: {str(err)[:1500]}"
    emit({"status": out.get("run_status", "ok"), "errors": errors, "partial": True, **out})
    b, s = args["batch_size"], args["seq_len"]
    rep = attempt(
        errors,
        "predicted_local",
        lambda: rk.analyze_model(config, b, s, policy=spec_of(args["policy"]), target="local"),
    )
    out["predicted_local"] = None if rep is None else _predict_fields(rep)
    target = attempt(errors, "local_target", lambda: rk.get_target("local"))
    peak_flops = None if target is None else target.peak_flops_bf16
    per_token = attempt(errors, "model_flops", lambda: model_flops_per_token(config, s))
    step = out.get("step_time_s")
    out["model_flops_per_token"] = per_token
    out["tokens_per_s"] = None if step is None else b * s / step
    out["peak_flops"] = peak_flops
    out["mfu"] = (
        None if None in (step, per_token, peak_flops) else per_token * b * s / step / peak_flops
    )
    if out["mfu"] is None:
        out["mfu_note"] = "no step time or the device's peak FLOP/s is unknown (CPU)"
    status = out.get("run_status", "ok")
    return {"status": status, "errors": errors, **out}


def predict(args: dict[str, Any]) -> dict[str, Any]:
    """The analyzer's prediction for a (deviceless) target, every policy."""
    errors: dict[str, str] = {}
    policies = args["policies"]
    program = rk.preset(
        rk.get_config(args["model"]).replace(scan_layers=True), args["batch_size"], args["seq_len"]
    )
    reports = rk.analyze_policies(
        program,
        [spec_of(p) for p in policies],
        target=args["target"],
        raise_errors=False,
    )
    out = {}
    for policy, rep in zip(policies, reports, strict=True):
        key = label(policy)
        if isinstance(rep, Exception):
            errors[key] = f"{type(rep).__name__}: {str(rep)[:800]}"
        else:
            out[key] = _predict_fields(rep)
    return {"status": "ok", "errors": errors, "target": args["target"], "predictions": out}


def runs_as(policy: str | dict[str, str]) -> str | None:
    """What ``policy`` runs as under the remat implementation in use when not as named (a
    traced probe, :func:`remat_kit.policies.policy_effect`), else None."""
    effect = RP.policy_effect(spec_of(policy))
    return None if effect.as_named else effect.runs_as


def _loss_and_grads(config: rk.ModelConfig, params: Any, batch: dict) -> tuple[Any, Any, dict]:
    model = rk.make_model(config)

    def loss(p):
        logits = model.apply({"params": p}, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch["targets"]
        )
        return ce.mean()

    # Full float32 matmuls: TF32 rounding (the GPU default) could differ between two programs
    # whose kernels XLA picks differently, and would hide a real gradient difference or fake one.
    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    errors: dict[str, str] = {}
    memory = attempt(errors, "compiled_memory", lambda: compiled_memory(compiled)) or {}
    value, grads = compiled(params)
    return value, grads, {**memory, "errors": errors}


def grads(args: dict[str, Any]) -> dict[str, Any]:
    """Loss and gradients of each policy against no-remat (float32, same params and batch)."""
    base = model_config(args["model"], "no-remat", f32=True)
    params = jax.jit(lambda k: rk.make_model(base).init(k, jnp.zeros((1, 8), jnp.int32)))(
        jax.random.key(0)
    )["params"]
    batch = _batch(base, args["batch_size"], args["seq_len"], 1)
    ref_loss, ref_grads, _ = _loss_and_grads(base, params, batch)
    ref_leaves = [np.asarray(g) for g in jax.tree.leaves(ref_grads)]
    scale = max(float(np.max(np.abs(g))) for g in ref_leaves)
    rows, errors = {}, {}
    for policy in args["policies"][1:]:
        key = label(policy)

        def one(policy=policy):
            loss, g, memory = _loss_and_grads(
                model_config(args["model"], policy, True), params, batch
            )
            diff = max(
                float(np.max(np.abs(np.asarray(a) - b)))
                for a, b in zip(jax.tree.leaves(g), ref_leaves, strict=True)
            )
            return {
                "loss": float(loss),
                "loss_diff": abs(float(loss) - float(ref_loss)),
                "max_grad_diff": diff,
                "max_grad_diff_rel": diff / scale,
                "equal": diff / scale <= 1e-4 and abs(float(loss - ref_loss)) <= 1e-5,
                # what the policy runs as under this point's remat implementation (probe)
                "runs_as": runs_as(policy),
                **memory,
            }

        rows[key] = attempt(errors, key, one)
    return {
        "status": "ok",
        "errors": errors,
        "ref_loss": float(ref_loss),
        "tolerance": "max |grad - grad_no_remat| / max |grad_no_remat| <= 1e-4, "
        "|loss - loss_no_remat| <= 1e-5 (float32)",
        "backend": jax.default_backend(),
        "policies": rows,
    }


def recommend(args: dict[str, Any]) -> dict[str, Any]:
    """``remat_kit.recommend`` for the target and budget given, over the named policies."""
    rec = rk.recommend(
        args["model"],
        args["seq_len"],
        args["target"],
        batch_size=args["batch_size"],
        budget=args["budget_bytes"],
        policies=args["policies"],
        group_sizes=[1],
    )
    cands = [
        {
            "policy": c.label,
            "peak_bytes": c.peak_bytes,
            "host_bytes": c.host_bytes,
            "step_time_s": c.step_time_s,
            "fits": c.fits,
            "remat_group_size": c.remat_group_size,
        }
        for c in rec.candidates
    ]
    return {
        "status": "ok",
        "errors": {},
        "budget_bytes": rec.budget_bytes,
        "pick": None if rec.pick is None else rec.pick.label,
        "line": rec.line(),
        "candidates": cands,
        "notes": list(rec.notes),
    }


KINDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "preflight": preflight,
    "measure": measure,
    "predict": predict,
    "grads": grads,
    "recommend": recommend,
}


def implementation() -> dict[str, Any]:
    """The row fields saying what the point was traced with: ``jax_version`` and
    ``remat_impl`` (``classic`` / ``remat3``, read from a traced ``jax.checkpoint``; the text of
    the exception where this JAX's API differs), and ``jax_remat3_flag`` (None: no such flag)."""
    errors: dict[str, str] = {}
    impl = attempt(errors, "remat_impl", RP.remat_implementation)
    flag = attempt(errors, "jax_remat3_flag", RP.remat3_flag)
    return {"jax_version": jax.__version__, "remat_impl": impl or errors.get("remat_impl"),
            "jax_remat3_flag": flag}  # fmt: skip


def run(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one point of ``kind``; an exception is the point's result (status error / oom).
    ``args["remat_impl"]`` (optional): trace the point under that remat implementation."""
    try:
        with RP.using(args.get("remat_impl") or RP.remat_implementation()):
            return {"status": "ok", **KINDS[kind](args), **implementation()}
    except Exception as err:
        text = f"{type(err).__name__}: {str(err)[:1500]}"
        return {"status": classify(text), "error": text, "errors": {}, **implementation()}
