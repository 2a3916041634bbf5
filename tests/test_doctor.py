"""remat-kit doctor: one small reproducer per finding kind, and no false alarms."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit
from remat_kit import doctor
from remat_kit.memory import analyze_model

cp = jax.checkpoint_policies
WEIGHTS = [jax.ShapeDtypeStruct((128, 128), jnp.float32) for _ in range(3)]
X = jax.ShapeDtypeStruct((32, 128), jnp.float32)


def _mlp_stack(prevent_cse=True, scan=False):
    """make_loss for check_function: 3 residual MLP layers, each under jax.checkpoint."""

    def make_loss(policy):
        def layer(h, w):
            a = checkpoint_name(h @ w, "mlpwi")
            return checkpoint_name(jnp.tanh(a) @ w.T, "mlpwo") + h

        f = jax.checkpoint(layer, policy=policy, prevent_cse=prevent_cse)

        def loss(ws, x):
            h = x
            if scan:
                h, _ = jax.lax.scan(lambda h, w: (f(h, w), None), h, jnp.stack(ws))
            else:
                for w in ws:
                    h = f(h, w)
            return (h**2).mean()

        return loss

    return make_loss


def _codes(findings):
    return {f.code for f in findings}


def test_unknown_tag_suggests_the_emitted_one():
    findings = doctor.check("tiny-gpt", 2, 32, {"mlpwi_0": "save"}, "cpu")
    unknown = [f for f in findings if f.code == "unknown-tag"]
    assert unknown and "'mlpwi_0'" in unknown[0].what and "use 'mlpwi'" in unknown[0].fix
    assert doctor.has_errors(findings)


def test_no_op_policy():
    findings = doctor.check_function(_mlp_stack(), WEIGHTS, X, policy=cp.everything_saveable)
    assert "no-op-policy" in _codes(findings)


def test_save_anything_except_these_names_saves_everything():
    policy = cp.save_anything_except_these_names("mlpwi")
    findings = doctor.check_function(_mlp_stack(scan=True), WEIGHTS, X, policy=policy)
    # one finding for the one fact (its no-op twin, with a cause about the layers' placement,
    # is dropped: the layers are inside jax.checkpoint)
    assert "saves-everything" in _codes(findings) and "no-op-policy" not in _codes(findings)


def test_remat_undone_by_cse():
    # Unrolled with prevent_cse=False: XLA merges the recomputation into the forward pass.
    findings = doctor.check_function(
        _mlp_stack(prevent_cse=False), WEIGHTS, X, policy=cp.nothing_saveable, target="h100-sxm"
    )
    assert "cse-undid-remat" in _codes(findings)


def test_unrolled_on_cpu_saves_no_memory():
    config = remat_kit.get_config("tiny-gpt", scan_layers=False)
    findings = doctor.check(config, 2, 64, "save-nothing", "cpu")
    assert "no-op-policy" in _codes(findings)
    assert "outside lax.scan" in findings[0].cause
    # Each figure in its own unit: no "0.00 GiB" on a small model.
    assert "GiB" not in findings[0].what and "KiB" in findings[0].what


def test_composed_policy_acts_as_full_remat_under_remat3():
    composed = cp.save_from_both_policies(
        cp.save_only_these_names("mlpwi"), cp.save_only_these_names("mlpwo")
    )
    jax.config.update("jax_remat3", True)
    try:
        findings = doctor.check_function(_mlp_stack(scan=True), WEIGHTS, X, policy=composed)
    finally:
        jax.config.update("jax_remat3", False)
    assert {"composed-policy", "acts-as-full-remat"} <= _codes(findings)
    # Without remat3 the same callable works: a warning about the future, no error.
    findings = doctor.check_function(_mlp_stack(scan=True), WEIGHTS, X, policy=composed)
    assert _codes(findings) == {"composed-policy"}
    assert not doctor.has_errors(findings)


def test_offload_of_a_value_never_kept_acts_as_full_remat():
    # mlpwo feeds only a residual add: the backward pass never needs it, nothing is offloaded.
    findings = doctor.check_function(_mlp_stack(), WEIGHTS, X, policy={"mlpwo": "offload"})
    assert "acts-as-full-remat" in _codes(findings)


def test_offload_ignored_on_cpu():
    findings = doctor.check("tiny-gpt", 2, 32, "offload-to-host", "cpu")
    assert [f.code for f in findings] == ["offload-ignored"]
    assert not doctor.has_errors(findings)


@pytest.fixture(scope="module")
def offload_report():
    return analyze_model("tiny-llama", 2, 64, "offload-layer-inputs", "h100-sxm")


def _compare_offload(report):
    spec = remat_kit.get_policy_spec("offload-layer-inputs")
    no_remat = dataclasses.replace(report, temp_bytes=report.temp_bytes * 4)
    kept = doctor.Residuals(device_bytes=0, host_bytes=4096, tags=frozenset(), dots=False)
    kept_base = doctor.Residuals(device_bytes=10**6, host_bytes=0, tags=frozenset(), dots=False)
    return doctor.compare(
        spec, report, no_remat, kept, kept_base, remat_kit.targets.get_target("h100-sxm")
    )


def test_offload_rules_on_real_gpu_target_report(offload_report):
    # Real report of the H100 target: host bytes present; the rules judge it against its
    # on-device twin (peak_bytes_without_offload), never assumed.
    assert offload_report.host_bytes > 0
    assert offload_report.peak_bytes_without_offload is not None
    codes = _codes(_compare_offload(offload_report))
    lowered = offload_report.peak_bytes < offload_report.peak_bytes_without_offload
    assert ("offload-no-device-saving" in codes) == (not lowered)
    # The same report with the host bytes gone (XLA dropping the offload) and with a device
    # peak no lower than on device: each rule fires.
    dropped = dataclasses.replace(offload_report, host_bytes=0)
    assert "offload-no-host-bytes" in _codes(_compare_offload(dropped))
    useless = dataclasses.replace(
        offload_report, peak_bytes_without_offload=offload_report.peak_bytes
    )
    assert "offload-no-device-saving" in _codes(_compare_offload(useless))


def test_static_argnums_counting_self():
    x = jnp.ones(3)
    assert _codes(doctor.check_remat_static_argnums((1,), [x, 4])) == {"static-argnums-self"}
    assert doctor.check_remat_static_argnums((2,), [x, 4]) == []
    assert doctor.check_remat_static_argnums((1,), [np.ones(3), 4])  # numpy arrays too


# The clean-run matrix (every named policy, h100-sxm, scan and unrolled) is in test_walker.py.


def test_save_dots_not_lowering_the_peak_says_what_it_recomputes():
    """save-dots keeps its matmuls (1.00x the matmul FLOPs in analyze's column): the doctor's
    remat-not-lowering-peak says it recomputes its elementwise work, not just "recomputes"."""
    from types import SimpleNamespace as NS

    from remat_kit.doctor.compare import _not_effective

    mib = 2**20
    report, base = NS(flops=100.0, temp_bytes=9 * mib), NS(flops=100.0, temp_bytes=9 * mib)
    finding = _not_effective(
        NS(name="save-dots", base="dots"), report, base, promised=8 * mib, achieved=0,
        target=NS(platform="cuda"), scan_layers=True, ops=None, around_loop=0,
    )  # fmt: skip
    assert finding.code == "remat-not-lowering-peak"
    assert "recomputes its elementwise work (its matmuls are saved)" in finding.what


def test_doctor_and_analyze_default_to_the_same_target():
    """Both judge the program where the user runs them (``local``): the doctor once defaulted
    to ``cpu``, so on a GPU machine it judged a program analyze compiled for the GPU on XLA:CPU,
    which undoes remat outside a scan."""
    import inspect

    from remat_kit.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001
    defaults = {name: commands[name].parse_args(["--model", "tiny-gpt"]).target
                for name in ("analyze", "doctor")}  # fmt: skip
    assert defaults == {"analyze": "local", "doctor": "local"}
    for fn in (doctor.check, doctor.check_policies, remat_kit.analyze):
        assert inspect.signature(fn).parameters["target"].default == "local", fn


def test_analyze_of_one_policy_judges_it_against_no_remat_as_the_doctor_does():
    """The doctor compiles no-remat beside every policy, so it said an unrolled save-nothing
    frees no memory on the CPU; ``analyze`` said it only when no-remat was among the policies
    asked for. It now compiles the no-remat step unseen and warns alike, reporting only the
    policies asked for."""
    config = remat_kit.get_config("tiny-gpt", scan_layers=False, num_layers=2)
    program = remat_kit.preset(config, 2, 32)
    (alone,) = remat_kit.analyze_policies(program, ["save-nothing"], "cpu")
    both = remat_kit.analyze_policies(program, ["save-nothing", "no-remat"], "cpu")
    assert [r.policy for r in both] == ["save-nothing", "no-remat"]

    def freed_warning(report):
        return [w for w in report.warnings if "the compiled step's temp memory" in w]

    assert freed_warning(alone) and freed_warning(alone) == freed_warning(both[0])
    (finding,) = [f for f in doctor.check(program, policy="save-nothing", target="cpu")
                  if f.code == "no-op-policy"]  # fmt: skip
    # the single-report API compiles only what it is asked
    assert not freed_warning(remat_kit.analyze_model(config, 2, 32, "save-nothing", "cpu"))
