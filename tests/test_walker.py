"""The walker: every nested jaxpr read, and the doctor right on programs users write.

One small reproducer per kind of issue 14, then a clean-run matrix (every named policy x tiny
models x scan/unrolled on the h100-sxm target, plus user-style programs) that must report no
error or warning.
"""

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit
from remat_kit import doctor, walker
from remat_kit import policies as RP
from remat_kit.memory import hlo
from remat_kit.walker import FUSED_ATTENTION_FWD, traced_flops

cp = jax.checkpoint_policies
GPU = "h100-sxm"
pytestmark = pytest.mark.skipif(
    remat_kit.targets.cuda_plugin_module() is None,
    reason="JAX's CUDA plugin is not installed (pip install 'remat-kit[cuda12]')",
)


def _codes(findings):
    return {f.code for f in findings}


def _loud(findings):
    return [f.line() for f in findings if f.severity != "info"]


@pytest.fixture
def remat3():
    saved = jax.config.jax_remat3
    jax.config.update("jax_remat3", True)
    yield
    jax.config.update("jax_remat3", saved)


# -- User-style programs: make_loss(policy) -> loss(w, x) --------------------------------------

W = jax.ShapeDtypeStruct((3, 32, 32), jnp.float32)  # [layers, d, d]
X = jax.ShapeDtypeStruct((4, 16, 32), jnp.float32)  # [batch, seq, d]


def _layers(block, policy):
    f = jax.checkpoint(block, policy=policy)

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (f(h, w), None), x, ws)
        return (h**2).mean()

    return loss


def inner_scan(policy):
    """Attention-like block whose mixing runs as an inner lax.scan over chunks; output tagged
    ``context`` (stacked by the inner scan)."""

    def block(h, w):
        q = h @ w

        def chunk(c, qc):
            return c, jnp.tanh(qc) * jax.nn.softmax(qc, axis=-1)

        _, ctx = jax.lax.scan(chunk, 0.0, q.reshape(4, -1, q.shape[-1]))
        ctx = checkpoint_name(ctx.reshape(q.shape), "context")
        return h + jnp.sin(ctx) @ w.T

    return _layers(block, policy)


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


def _sin_fwd(x):
    y = checkpoint_name(jnp.cos(x), "context")  # named only in the forward rule
    return jnp.sin(x), (y,)


def _sin_bwd(res, ct):
    return (ct * res[0],)


_sin.defvjp(_sin_fwd, _sin_bwd)


def custom_vjp(policy):
    return _layers(lambda h, w: h + _sin(h @ w) @ w.T, policy)


def conv_block(policy):
    """Two 1-D convolutions per layer (x as [batch, seq, channels])."""

    def block(h, w):
        kernel = jnp.stack([w, w.T, w])  # [width 3, in, out]
        conv = lambda a: jax.lax.conv_general_dilated(  # noqa: E731
            a, kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )
        return h + conv(jnp.tanh(conv(h)))

    return _layers(block, policy)


def remat_in_vmap(policy):
    def block(h, w):
        a = checkpoint_name(h @ w, "mlpwi")
        return h + jnp.tanh(a) @ w.T

    f = jax.vmap(jax.checkpoint(block, policy=policy), in_axes=(0, None))

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (f(h, w), None), x, ws)
        return (h**2).mean()

    return loss


def elementwise(policy):
    def block(h, w):
        a = checkpoint_name(jnp.tanh(h) * w[0, 0], "decoder_layer_input")
        return jnp.sin(a) * jnp.cos(h)

    return _layers(block, policy)


def _offload(*names):
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host",
    )  # fmt: skip


# -- The walker ---------------------------------------------------------------------------


def test_walk_finds_every_nested_jaxpr():
    def f(x):
        x = jax.jit(lambda y: checkpoint_name(y, "a"))(x)
        x = jax.lax.cond(x.sum() > 0, lambda y: checkpoint_name(y, "b"), lambda y: y, x)
        x = jax.lax.while_loop(
            lambda c: c[1] < 2, lambda c: (checkpoint_name(c[0], "c"), c[1] + 1), (x, 0)
        )[0]
        x = jax.checkpoint(lambda y: checkpoint_name(y, "d"))(x)
        x, _ = jax.lax.scan(lambda c, _: (checkpoint_name(c, "e"), None), x, length=2)
        return _sin(x)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(4))
    assert walker.tags_in(jaxpr.jaxpr) == {"a", "b", "c", "d", "e"}
    # The custom_vjp forward rule's name is seen in the program of the forward pass.
    assert walker.emitted_tags(f, jnp.ones(4)) == {"a", "b", "c", "d", "e", "context"}


def test_sub_jaxprs_are_found_under_any_parameter_name():
    # closed_call keeps its body under "call_jaxpr", pjit under "jaxpr", cond under "branches":
    # the walker reads any parameter holding jaxprs, and hi primitives' own parameters.
    closed = jax.make_jaxpr(lambda x: (checkpoint_name(jnp.sin(x), "context"),))(jnp.ones(3))
    eqn = SimpleNamespace(
        primitive=SimpleNamespace(name="closed_call"), params={"call_jaxpr": closed},
        outvars=[object()],
    )  # fmt: skip
    assert walker.body(eqn) is closed.jaxpr
    hi = SimpleNamespace(
        primitive=SimpleNamespace(name="call_hi_primitive"),
        params={"_prim": SimpleNamespace(params={"jaxpr": closed})}, outvars=[object()],
    )  # fmt: skip
    assert walker.sub_jaxprs(hi) == [closed.jaxpr]


# -- Kind 1: residuals produced inside nested structures ----------------------------------------


def test_residual_stacked_by_an_inner_scan_is_attributed_to_its_tag():
    loss = inner_scan(cp.save_only_these_names("context"))
    rows = walker.group_by_tag(walker.saved_residuals(loss, W, X))
    assert [r.tag for r in rows if r.tag == "context"] == ["context"]
    findings = doctor.check_function(
        inner_scan, W, X, policy=cp.save_only_these_names("context"), target=GPU
    )
    assert _loud(findings) == []


def test_name_inside_a_custom_vjp_forward_rule_is_emitted():
    findings = doctor.check_function(
        custom_vjp, W, X, policy=cp.save_only_these_names("context"), target=GPU
    )
    assert "unknown-tag" not in _codes(findings)
    assert _loud(findings) == []


def test_a_forward_rule_name_remat3_drops_is_not_called_outside_remat():
    """jax_remat3 without jax_custom_vjp3 ignores a checkpoint_name inside a custom_vjp's
    forward rule: the doctor says so, not that the name is applied outside every remat segment
    (it is inside the checkpointed layer)."""
    if getattr(jax.config, "jax_custom_vjp3", False):
        pytest.skip("jax_custom_vjp3 is on: remat3 sees the forward rule's names")
    with RP.using("remat3"):
        findings = doctor.check_function(
            custom_vjp, W, X, policy=cp.save_only_these_names("context"), target="cpu"
        )
    full = next(f for f in findings if f.code == "acts-as-full-remat")
    assert "custom_vjp forward rule" in full.cause
    assert "outside every remat segment" not in full.cause


# -- Kind 1b: a matmul kept by a kind-based policy is the value a name binds -------------------


@jax.custom_vjp
def _proj_vjp(h, w):
    return h @ w


def _proj_fwd(h, w):
    return checkpoint_name(h @ w, "proj"), (h, w)


def _proj_bwd(res, g):
    h, w = res
    return g @ w.T, jnp.einsum("bsi,bso->io", h, g)


_proj_vjp.defvjp(_proj_fwd, _proj_bwd)


def _haiku_linear(h, w):
    """As Haiku's ``hk.Linear`` adds its bias: broadcast to the output's whole shape first."""
    out = jnp.dot(h, w)
    return out + jnp.broadcast_to(w[0].astype(jnp.bfloat16), out.shape).astype(out.dtype)


#: Where ``checkpoint_name(h @ w, "proj")`` can sit relative to the matmul a dots policy keeps.
NAMED_MATMULS = {
    "direct": lambda h, w: checkpoint_name(h @ w, "proj"),
    "after-bias": lambda h, w: checkpoint_name(h @ w + w[0], "proj"),  # linen Dense(use_bias)
    # hk.Linear: the added operand is as large as the matmul's output (it read as a residual
    # stream's sum, so the kept matmul showed as <dot_general>)
    "after-broadcast-bias": lambda h, w: checkpoint_name(_haiku_linear(h, w), "proj"),
    "name-in-jit": lambda h, w: jax.jit(lambda a: checkpoint_name(a, "proj"))(h @ w),
    "matmul-in-jit": lambda h, w: checkpoint_name(jax.jit(jnp.matmul)(h, w), "proj"),
    "name-in-remat": lambda h, w: jax.checkpoint(lambda a: checkpoint_name(a, "proj"))(h @ w),
    "custom-vjp": _proj_vjp,
    # the name applied after a layout change (an einsum's output transposed: attention's context)
    "after-transpose": lambda h, w: jnp.swapaxes(
        checkpoint_name(jnp.swapaxes(h @ w, -1, -2), "proj"), -1, -2
    ),
}
PROJ_BYTES = 3 * 4 * 16 * 32 * 4  # [layers, batch, seq, d] float32


def _proj_rows(where, policy):
    block = lambda h, w: h + jnp.tanh(NAMED_MATMULS[where](h, w)) @ w.T  # noqa: E731
    return walker.bytes_by_tag(
        walker.group_by_tag(walker.saved_residuals(_layers(block, policy), W, X))
    )


@pytest.mark.parametrize("where", sorted(NAMED_MATMULS))
@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_matmul_kept_by_a_dots_policy_is_attributed_to_the_name_it_feeds(where, policy):
    """The residual is the dot_general's own output (through JAX's reduce_precision); the name
    binds a new variable, in the same jaxpr or inside a jit / remat / custom_vjp around it."""
    rows = _proj_rows(where, getattr(cp, policy))
    assert rows.get("proj") == PROJ_BYTES and "<dot_general>" not in rows, rows


@pytest.mark.parametrize(
    "where", ["direct", "after-bias", "after-broadcast-bias", "name-in-jit", "matmul-in-jit"]
)
def test_matmul_kept_under_remat3_is_attributed_to_the_name_it_feeds(remat3, where):
    rows = _proj_rows(where, cp.dots_saveable)
    assert rows.get("proj") == PROJ_BYTES and "<dot_general>" not in rows, rows


def test_a_sum_of_two_matmuls_is_not_attributed_to_the_name_of_the_sum():
    """Only the named value itself (or a matmul before its bias add) takes the name: two kept
    matmuls added together are two other values, not two copies of the tag."""
    block = lambda h, w: h + jnp.tanh(checkpoint_name(h @ w + h @ w.T, "proj")) @ w.T  # noqa: E731
    rows = walker.bytes_by_tag(
        walker.group_by_tag(walker.saved_residuals(_layers(block, cp.dots_saveable), W, X))
    )
    assert "proj" not in rows and rows["<dot_general>"] == 2 * PROJ_BYTES, rows
    named = _layers(block, cp.save_only_these_names("proj"))
    assert (
        walker.bytes_by_tag(walker.group_by_tag(walker.saved_residuals(named, W, X)))["proj"]
        == PROJ_BYTES
    )


def test_a_cast_of_a_named_value_is_another_value_not_the_name():
    """A norm's ``x.astype(float32)`` of a bf16 name (MaxText's decoder_layer_input) kept by the
    backward pass was listed under the name at twice its bytes (no-remat showed
    decoder_layer_input 1.00 MiB against 0.50 under every policy: two outside trials), and a
    cast of an argument was read as the argument itself (no new buffer). Both are new values of
    their own bytes; a same-dtype copy or an offload still carries the name."""
    x = jax.ShapeDtypeStruct((4, 16, 32), jnp.bfloat16)

    def norm(x):
        x = checkpoint_name(x, "layer_in")
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)).sum()

    rows = walker.saved_residuals(norm, x)
    (cast,) = [r for r in rows if r.source == "convert_element_type"]
    assert cast.tag is None and cast.nbytes == 4 * 16 * 32 * 4 and not cast.is_argument
    assert not any(r.tag == "layer_in" for r in rows)
    same = walker.saved_residuals(
        lambda x: norm(x.astype(jnp.float32)), x.update(dtype=jnp.float32)
    )
    assert {r.source for r in same} <= {"argument [0]", "mul", "rsqrt", "broadcast_in_dim"}


def test_a_named_value_split_into_heads_keeps_its_name():
    """Attention keeps ``q.reshape(seq, heads, hd)`` of a named projection for its score
    matmul's backward pass: no-remat listed it as <reshape> (an eqx decoder's table showed
    query_proj '-' under no-remat, 0.50 MiB under save-qkv-proj: an outside trial). It is the
    named value's bytes in another layout; a reshape of an unnamed value stays unnamed."""
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32)

    def attn(x, w, name=True):
        q = x @ w
        q = checkpoint_name(q, "query_proj") if name else q
        q = jnp.swapaxes(q.reshape(16, 4, 8), 0, 1)  # [heads, seq, hd]
        return jnp.einsum("hqd,hkd->hqk", q, jnp.sin(q)).sum()

    rows = walker.saved_residuals(attn, x, w)
    heads = [r for r in rows if r.source in ("reshape", "transpose")]
    assert heads and all(r.tag == "query_proj" for r in heads), rows
    plain = walker.saved_residuals(lambda x, w: attn(x, w, name=False), x, w)
    assert not any(r.tag for r in plain), plain


# -- Kind 2: jax_remat3 -------------------------------------------------------------------------


def test_remat3_tags_are_read_and_degraded_policies_reported(remat3):
    loss = inner_scan(cp.save_only_these_names("context"))
    tags = {r.tag for r in walker.saved_residuals(loss, W, X)}
    assert "context" in tags and not any(t and "call_hi" in t for t in tags)
    assert walker.emitted_tags(loss, W, X) >= {"context"}
    assert doctor.remat3_honours(cp.save_only_these_names("context"))
    offloaded = {r.tag for r in walker.saved_residuals(inner_scan(_offload("context")), W, X)
                 if r.memory == "host"}  # fmt: skip
    findings = doctor.check_function(inner_scan, W, X, policy=_offload("context"), target=GPU)
    assert "unknown-tag" not in _codes(findings)
    if remat_kit.policies.remat3_asks_any_policy():
        # jax 0.12: jax_remat3 asks the offloading closure at the name and offloads it
        assert doctor.remat3_honours(_offload("context")) and offloaded == {"context"}
        assert "remat3-full-remat" not in _codes(findings)
        return
    # jax 0.10.2: the closure is not data jax_remat3 reads: full remat, nothing on host
    assert not doctor.remat3_honours(_offload("context")) and not offloaded
    assert "remat3-full-remat" in _codes(findings)
    remat3_error = next(f for f in findings if f.code == "remat3-full-remat")
    assert "host" in remat3_error.what


def test_remat3_keeps_matmuls_for_dots_policies_but_not_offloads(remat3):
    def loss_of(policy):
        return _layers(lambda h, w: h + checkpoint_name(jnp.tanh(h @ w), "mlpwi") @ w.T, policy)

    def kept(policy):
        return [r for r in walker.saved_residuals(loss_of(policy), W, X) if not r.is_argument]

    assert any(r.source == "dot_general" for r in kept(cp.dots_saveable))
    assert doctor.remat3_honours(cp.dots_saveable)
    host = [r for r in kept(_offload("mlpwi")) if r.memory == "host"]
    if remat_kit.policies.remat3_asks_any_policy():  # jax 0.12 honours Offloadable answers
        assert host and {r.tag for r in host} == {"mlpwi"}
        assert len(kept(_offload("mlpwi"))) > len(kept(cp.nothing_saveable))
    else:  # jax 0.10.2: an offloading closure runs as full remat
        assert not host
        assert len(kept(_offload("mlpwi"))) == len(kept(cp.nothing_saveable))


# -- Kind 3: recomputation judged from the compiled program ------------------------------------


def test_offload_on_elementwise_layers_is_judged_by_host_bytes():
    findings = doctor.check_function(
        elementwise, W, X, policy=_offload("decoder_layer_input"), target=GPU
    )
    assert "cse-undid-remat" not in _codes(findings)
    assert not any("XLA:CPU" in f.cause for f in findings)


def test_recomputed_ops_are_counted_in_the_compiled_program():
    g = jax.grad(elementwise(cp.nothing_saveable))
    target = remat_kit.targets.get_target(GPU)
    assert doctor.recomputed_ops(g, (W, X), target) > 0


# -- Kind 4: convolutions and fused attention -------------------------------------------------


def test_convolutions_count_as_dots_and_flops():
    assert traced_flops(conv_block(cp.nothing_saveable), W, X) > 0
    findings = doctor.check_function(conv_block, W, X, policy=cp.dots_saveable, target=GPU)
    assert "acts-as-full-remat" not in _codes(findings)
    assert _loud(findings) == []


def test_fused_attention_flops_in_jaxpr_and_compiled_hlo():
    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    g = jax.grad(loss, argnums=(0, 1, 2))
    fwd = 4 * 2 * 4 * 128 * 128 * 64 / 2  # causal: half of 4*b*h*s*s*d
    assert traced_flops(g, q, q, q) == pytest.approx(fwd * (1 + 2.5))
    report = remat_kit.analyze(g, q, q, q, target=GPU)
    assert report.flops == pytest.approx(fwd * (1 + 2.5))


def test_recomputed_fused_attention_is_counted_and_can_be_kept():
    """A selective policy with cuDNN attention re-runs the fused kernel in the backward pass (its
    output and softmax statistics are residuals of the kernel's custom_vjp, not named); saving
    the outputs of the kernel's forward primitive keeps them, and the kernel runs once."""
    names = cp.save_only_these_names("context")

    def keep_fused(prim, *args, **params):  # classic remat only: a callable
        return prim.name in FUSED_ATTENTION_FWD or names(prim, *args, **params)

    def grad_of(policy):
        def block(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            return checkpoint_name(out, "context")

        f = jax.checkpoint(block, policy=policy)
        loss = lambda q, k, v: jnp.tanh(f(q, k, v)).astype(jnp.float32).sum()  # noqa: E731
        return loss, jax.grad(loss, argnums=(0, 1, 2))

    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    fwd = 4 * 2 * 4 * 128 * 128 * 64 / 2
    (_, g_names), (loss_keep, g_keep) = grad_of(names), grad_of(keep_fused)
    assert remat_kit.analyze(g_names, q, q, q, target=GPU).flops == pytest.approx(fwd * 4.5)
    assert remat_kit.analyze(g_keep, q, q, q, target=GPU).flops == pytest.approx(fwd * 3.5)
    kept = {r.source for r in walker.saved_residuals(loss_keep, q, q, q)}
    assert "dot_product_attention_fwd_wrapper" in kept


# -- Kind 5: unknown memory figures -----------------------------------------------------------


def test_hlo_conv_flops_parse():
    text = """HloModule m

ENTRY %main (p0: f32[4,16,32], p1: f32[3,32,32]) -> f32[4,16,32] {
  %p0 = f32[4,16,32]{2,1,0} parameter(0)
  %p1 = f32[3,32,32]{2,1,0} parameter(1)
  ROOT %conv = f32[4,16,32]{2,1,0} convolution(%p0, %p1), window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f
}
"""
    count = hlo.count_flops(hlo.parse_hlo_module(text))
    assert count.flops == 2 * 4 * 16 * 32 * 3 * 32


def test_cudnn_convolution_calls_cost_their_forward_convolution():
    """A cuDNN backward-filter call (operands: the input and the output gradient; result: the
    kernel's gradient) was counted with the output gradient read as the kernel, its batch as
    the output features: 16x a ViT patch embedding's work on H100 (outside trial, session 16),
    so no-remat showed 'recompute 1.05x'. Every kind costs its forward convolution: for this
    one 2 x [8, 8, 8, 128] outputs x (4 x 4 x 3) taps."""
    forward = 2 * (8 * 8 * 8 * 128) * (4 * 4 * 3)
    labels = "window={size=4x4 stride=4x4}, dim_labels=b01f_o01i->b01f, custom_call_target="
    calls = {
        "convBiasActivationForward": "(f32[8,8,8,128]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w, %b)",
        "convBackwardFilter": "(f32[128,4,4,3]{3,2,1,0}, u8[0]{0}) custom-call(%x, %dy)",
        "convBackwardInput": "(f32[8,32,32,3]{3,2,1,0}, u8[0]{0}) custom-call(%dy, %w)",
    }
    for target, call in calls.items():
        text = f"""HloModule m

ENTRY %main (x: f32[8,32,32,3], w: f32[128,4,4,3], dy: f32[8,8,8,128], b: f32[128]) -> f32[1] {{
  %x = f32[8,32,32,3]{{3,2,1,0}} parameter(0)
  %w = f32[128,4,4,3]{{3,2,1,0}} parameter(1)
  %dy = f32[8,8,8,128]{{3,2,1,0}} parameter(2)
  %b = f32[128]{{0}} parameter(3)
  %c = {call}, {labels}"__cudnn${target}"
  ROOT %r = f32[1]{{0}} constant({{0}})
}}
"""
        count = hlo.count_flops(hlo.parse_hlo_module(text))
        assert count.flops == forward, (target, count.flops)


# -- Kind 6: policies read whatever their names ------------------------------------------------


def test_raw_offload_policy_with_a_typo_is_reported():
    def mlp(policy):
        return _layers(lambda h, w: h + checkpoint_name(h @ w, "decoder_layer_input"), policy)

    policy = _offload("decoder_layer_input_typo")
    promise, _ = doctor.describe_callable(policy)
    assert promise.offload == {"decoder_layer_input_typo"}
    findings = doctor.check_function(mlp, W, X, policy=policy, target=GPU)
    assert "unknown-tag" in _codes(findings)


# -- Kind 7: advice --------------------------------------------------------------------------


def test_policy_none_means_save_nothing():
    with pytest.raises(ValueError, match="save-nothing"):
        doctor.resolve_policy("none")


def test_static_argnums_numpy_and_past_the_arguments():
    x = np.ones(3)
    findings = doctor.check_remat_static_argnums((1,), [x, True])
    assert _codes(findings) == {"static-argnums-self"} and "index 2" in findings[0].fix
    past = doctor.check_remat_static_argnums((3,), [x, True])
    assert past and "valid indices here are 1..2" in past[0].fix
    assert doctor.check_remat_static_argnums((2,), [x, True]) == []


def test_static_argnums_checked_by_check_function():
    findings = doctor.check_function(
        _mlp_unrolled, W, X, policy=None, target="cpu",
        remat_static_argnums=(1,), remat_call_args=[np.ones(2)],
    )  # fmt: skip
    assert "static-argnums-self" in _codes(findings)


def _mlp_unrolled(policy):
    f = jax.checkpoint(lambda h, w: h + jnp.tanh(h @ w) @ w.T, policy=policy)

    def loss(ws, x):
        for i in range(ws.shape[0]):
            x = f(x, ws[i])
        return (x**2).mean()

    return loss


# -- The clean-run matrix ---------------------------------------------------------------------

USER_PROGRAMS = [
    ("inner-scan", inner_scan, cp.save_only_these_names("context")),
    ("custom-vjp", custom_vjp, cp.save_only_these_names("context")),
    ("conv-block", conv_block, cp.dots_saveable),
    ("remat-in-vmap", remat_in_vmap, cp.save_only_these_names("mlpwi")),
    ("remat-in-vmap-nothing", remat_in_vmap, cp.nothing_saveable),
]


#: (model, scanned, layers): the default suite runs one model and layout (SwiGLU + RoPE,
#: unrolled, 13 policies) at 2 layers (a block following a block; ~0.6x the CPU time of the
#: presets' 4 layers); set REMAT_KIT_FULL_MATRIX=1 for every model x layout at the presets' 4
#: layers (4 x 13 policies, ~10 min on 2 cores).
MATRIX = (
    [(m, scan, 4) for m in ("tiny-gpt", "tiny-llama") for scan in (True, False)]
    if os.environ.get("REMAT_KIT_FULL_MATRIX") == "1"
    else [("tiny-llama", False, 2)]
)
#: Measured, not inferred: the offloading step's device peak against the same step keeping
#: those tensors on device, both compiled. On these tiny models offloading does not lower the
#: peak (the transfers' buffers outweigh kilobytes of residuals): a true finding.
MEASURED = ("offload-no-device-saving",)


def preset_false_alarms(matrix=MATRIX, names=None) -> list[tuple[str, str]]:
    """(case, finding line) for every error or warning of the presets' clean-run matrix under
    ``names`` (default every registered policy)."""
    out = []
    names = remat_kit.policy_names() if names is None else names
    for model, scan, layers in matrix:
        config = remat_kit.get_config(model, scan_layers=scan, num_layers=layers)
        results = doctor.check_policies(remat_kit.preset(config, 2, 64), names, GPU)
        for name, findings in zip(names, results, strict=True):
            loud = [f.line() for f in findings if f.severity != "info" and f.code not in MEASURED]
            out += [(f"{model} scan={scan} layers={layers} {name}", line) for line in loud]
    return out


@pytest.fixture(scope="module")
def clean_run_alarms() -> dict[str, list[tuple[str, str]]]:
    """{policy: its false alarms} for every registered policy, from one doctor run over the
    matrix (one no-remat baseline per case; ``--dist loadscope`` keeps a module's tests on one
    xdist worker, so halves checked apart ran one after the other, each with its own)."""
    names = remat_kit.policy_names()
    alarms = preset_false_alarms(names=names)
    return {n: [a for a in alarms if a[0].rsplit(" ", 1)[1] == n] for n in names}


@pytest.mark.parametrize("half", [0, 1])
def test_clean_run_matrix_has_no_false_alarms(half, clean_run_alarms):
    """Every registered policy, in two halves of the one doctor run."""
    names = remat_kit.policy_names()
    assert [a for n in names[half::2] for a in clean_run_alarms[n]] == []


@pytest.mark.parametrize(
    "label, make_loss, policy", USER_PROGRAMS, ids=[u[0] for u in USER_PROGRAMS]
)
def test_clean_user_programs_have_no_false_alarms(label, make_loss, policy):
    """The user-written programs of the clean-run set, each its own test (xdist spreads them)."""
    findings = doctor.check_function(make_loss, W, X, policy=policy, target=GPU)
    assert _loud(findings) == [], label


def test_residual_rows_keep_each_shape_apart():
    """Values of one tag (or untagged values of one primitive) with different shapes get a row
    per shape, each with its own bytes; bytes_by_tag sums a tag over its shapes."""

    def loss(w, x):
        h = checkpoint_name(jnp.tanh(x @ w), "proj")  # [4, 16, 32]
        wide = checkpoint_name(jnp.tanh(jnp.concatenate([h, h], -1)), "proj")  # [4, 16, 64]
        return jnp.sum(jnp.sin(wide @ jnp.ones((64, 8))))  # untagged [4, 16, 8] too

    f = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names("proj"))
    rows = walker.group_by_tag(
        walker.saved_residuals(f, jax.ShapeDtypeStruct((32, 32), jnp.float32), X)
    )
    proj = {r.shape: r.nbytes for r in rows if r.tag == "proj"}
    assert proj == {(4, 16, 32): 4 * 16 * 32 * 4, (4, 16, 64): 4 * 16 * 64 * 4}
    assert walker.bytes_by_tag(rows)["proj"] == sum(proj.values())
    for r in rows:  # every row's bytes are count arrays of its own shape
        assert r.nbytes == r.count * int(np.prod(r.shape)) * jnp.dtype(r.dtype).itemsize, r


@jax.custom_vjp
def _square(x):
    return x * x


def _square_fwd(x):
    twice = checkpoint_name(2.0 * x, "twice")  # the one residual, named in the rule
    return x * x, (twice,)


def _square_bwd(res, ct):
    return (ct * res[0],)


_square.defvjp(_square_fwd, _square_bwd)


def test_a_forward_rule_name_whose_saving_spares_a_matmul_is_a_saver():
    """Classic remat keeps a name applied in a custom_vjp forward rule: saving ``twice`` spares
    the backward pass recomputing ``h @ w``, so the doctor lists it among the savers."""
    if RP.remat_implementation() != "classic":
        pytest.skip("classic remat only: jax_remat3 ignores a forward rule's names")

    def make_loss(policy):
        return _layers(lambda h, w: h + _square(h @ w), policy)

    program = remat_kit.Program.from_loss(make_loss, W, X)
    from remat_kit.doctor.checks import _facts

    facts = _facts(program, frozenset({"twice"}))
    assert facts.in_fwd_rule == {"twice"}
    assert "twice" in facts.savers()
