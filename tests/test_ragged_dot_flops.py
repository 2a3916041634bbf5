"""Ragged matmuls (``lax.ragged_dot``, as MoE layers dispatch tokens to experts) counted in the
jaxpr's FLOPs as the compiled program runs them."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit
from remat_kit.walker import traced_flops

M, K, N, G = 16, 8, 12, 4  # rows (tokens sorted by expert), in, out, groups (experts)


def _args():
    x = jnp.ones((M, K), jnp.float32)
    w = jnp.ones((G, K, N), jnp.float32)
    sizes = jnp.array([3, 5, 0, 8], jnp.int32)
    return x, w, sizes


def _grads(x, w, sizes):
    return jax.grad(lambda x, w: (jax.lax.ragged_dot(x, w, sizes) ** 2).sum(), (0, 1))(x, w)


def test_ragged_dot_counts_every_group():
    x, w, sizes = _args()
    assert traced_flops(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w) == 2 * M * K * N * G


def test_ragged_dot_jaxpr_flops_match_compiled_cpu():
    x, w, sizes = _args()
    report = remat_kit.analyze(_grads, x, w, sizes, target="cpu")
    walked = traced_flops(_grads, x, w, sizes)
    assert walked == 3 * 2 * M * K * N * G  # forward, and one per operand's gradient
    assert report.flops == pytest.approx(walked)


def test_save_dots_recomputes_ragged_dot_as_its_description_says():
    """save-dots' description says JAX's policy does not keep a ragged_dot's output."""
    from jax._src.ad_checkpoint import saved_residuals

    x, w, sizes = _args()
    assert "ragged_dot" in remat_kit.get_policy_spec("save-dots").description
    f = jax.checkpoint(
        lambda x, w: jnp.sin(jax.lax.ragged_dot(x, w, sizes)).sum(),
        policy=remat_kit.policy("save-dots"),
    )
    kept = [aval.shape for aval, source in saved_residuals(f, x, w) if "argument" not in source]
    assert (M, N) not in kept


def test_ragged_dot_routed_count_is_one_group_in_g():
    """A TPU runs the routed rows only: the count over the number of groups, every mode (the
    forward's ragged rows, and the gradients' ragged rows and ragged contraction)."""
    x, w, sizes = _args()
    assert traced_flops(_grads, x, w, sizes, tpu=True) == 3 * 2 * M * K * N


def _make_loss(policy):
    def layer(x, w):
        return jnp.tanh(jax.lax.ragged_dot(x, w, jnp.array([3, 5, 0, 8], jnp.int32)))

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)
    return lambda w, x: (body(x, w) ** 2).sum()


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)"
)
def test_ragged_dot_on_a_tpu_counts_the_routed_rows_compiled_and_traced():
    """libtpu's ragged-dot kernel is a custom call the compiled count read as 0 FLOPs; it is
    the routed rows' ``2 * M * K * N``, and the jaxpr's count on a TPU target is the same, so
    a step without remat recomputes nothing (it read 0 against the dense count, then 1/G)."""
    x, w, sizes = _args()
    assert remat_kit.analyze(_grads, x, w, sizes, target="v5e-1").flops == 3 * 2 * M * K * N
    program = remat_kit.Program.from_loss(_make_loss, w, x, optimizer="sgd")
    for target in ("v5e-1", "cpu"):
        (report,) = remat_kit.analyze_policies(program, ["no-remat"], target=target)
        assert report.recompute_ratio == pytest.approx(1.0), target


def test_doctor_says_a_dots_policy_recomputes_the_ragged_experts():
    """save-dots on a MoE layer whose experts run as lax.ragged_dot kept the router's matmul
    and recomputed the experts, with no finding (MoE user trial): now a warning says so, and
    a policy saving the experts' name gets none."""

    def make_loss(policy):
        def layer(x, w):
            h = jnp.tanh(x @ w["router"])  # a dot_general the dots policies keep
            y = jax.lax.ragged_dot(h, w["experts"], jnp.array([3, 5, 0, 8], jnp.int32))
            return jnp.sin(checkpoint_name(y, "mlpwo"))

        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return lambda w, x: (body(x, w) ** 2).sum()

    w = {"router": jnp.ones((K, K)), "experts": jnp.ones((G, K, N))}
    program = remat_kit.Program.from_loss(make_loss, w, jnp.ones((M, K)), optimizer="sgd")
    dots, named = (
        remat_kit.check(program, policy=p, target="cpu") for p in ("save-dots", {"mlpwo": "save"})
    )
    assert "ragged-dot-recomputed" not in [f.code for f in named]
    (line,) = [f.line() for f in dots if f.code == "ragged-dot-recomputed"]
    assert "1 lax.ragged_dot equation(s)" in line and "checkpoint_name" in line


#: The kernel's estimate, deliberately not its body's 2 * 128**3: both counts must read it.
ESTIMATE = 3 * 128**3


def _pallas_matmul(x, y, estimated=True):
    """A Pallas TPU kernel multiplying two [128, 128] blocks, with its author's cost estimate
    (as JAX's flash attention forward gives its own) or without (as its backward)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    estimate = pl.CostEstimate(flops=ESTIMATE, transcendentals=0, bytes_accessed=3 * 4 * 128**2)
    out = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    return pl.pallas_call(kernel, out_shape=out, cost_estimate=estimate if estimated else None)(
        x, y
    )


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)"
)
def test_a_pallas_kernel_on_a_tpu_counts_its_cost_estimate_compiled_and_traced():
    """A Mosaic kernel (splash attention, megablox, a user's Pallas kernel) was 0 FLOPs in the
    compiled count on a TPU; it is its cost estimate, which JAX writes into the custom call,
    and the jaxpr's count on a TPU target reads the same estimate, so a no-remat step holding
    one recomputes nothing."""
    x = jnp.ones((128, 128), jnp.float32)
    assert remat_kit.analyze(_pallas_matmul, x, x, target="v5e-1").flops == ESTIMATE
    assert traced_flops(_pallas_matmul, x, x, tpu=True) == ESTIMATE

    def make_loss(policy):
        def layer(w, x):  # the kernel (which has no JVP rule) on values without tangents
            c = jax.lax.stop_gradient(x)
            return jnp.tanh(x @ w) * _pallas_matmul(c, c)

        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return lambda w, x: (body(w, x) ** 2).sum()

    program = remat_kit.Program.from_loss(make_loss, x, x, optimizer="sgd")
    (report,) = remat_kit.analyze_policies(program, ["no-remat"], target="v5e-1")
    assert report.flops == report.flops_no_remat and report.recompute_ratio == pytest.approx(1.0)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the tpu extra)"
)
def test_a_tpu_kernel_without_an_estimate_is_named_and_left_out_of_both_counts():
    """JAX's flash attention backward and splash attention carry no cost estimate: the
    compiled count read them as 0 while the walk counted the kernel body once (not per grid
    step), so no-remat read x0.9976 (Pallas TPU trial). Both counts now leave them out, the
    ratio is 1, and a warning names the kernels the figures miss."""
    x = jnp.ones((128, 128), jnp.float32)

    def make_loss(policy):
        def layer(w, x):
            c = jax.lax.stop_gradient(x)
            return jnp.tanh(x @ w) * _pallas_matmul(c, c, estimated=False)

        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return lambda w, x: (body(w, x) ** 2).sum()

    program = remat_kit.Program.from_loss(make_loss, x, x, optimizer="sgd")
    (report,) = remat_kit.analyze_policies(program, ["no-remat"], target="v5e-1")
    assert report.flops == report.flops_no_remat and report.recompute_ratio == 1.0
    (line,) = [w for w in report.warnings if "carry no cost estimate" in w]
    assert line.startswith("1 TPU kernel(s) carry no cost estimate ("), line
    estimated = remat_kit.analyze(_pallas_matmul, x, x, target="v5e-1")
    assert not any("carry no cost estimate" in w for w in estimated.warnings)
