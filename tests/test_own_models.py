"""Models from other JAX libraries, as their authors write them (issue 27): an equinox
transformer (modules with Python float / bool leaves, ``eqx.filter_checkpoint`` per layer under
``lax.scan``, a step under ``eqx.filter_jit``) and a Hugging-Face-style linen LM whose blocks call
``nn.remat`` themselves without a policy (reached with ``remat_kit.inject_policy``). Each goes
through analyze, doctor and recommend with per-policy figures, its residuals by tag checked
against JAX's own ``print_saved_residuals``; bad input gets one line naming what to pass.

The equinox model compiles for the CPU (its layers are scanned: remat holds there); the
unrolled HF-style model for the H100 target, deviceless (XLA:CPU merges recomputation back in an
unrolled loop)."""

from __future__ import annotations

import re
from collections import Counter

import equinox as eqx  # the dev extra installs it (remat-kit[eqx])
import flax.linen as nn
import jax
import jax.numpy as jnp
import measured  # experiments/ on sys.path: tests/conftest.py
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import remat_kit
from remat_kit import Program, doctor, inject_policy, tag_eqx, tag_linen
from remat_kit.memory.api import analyze_policies
from remat_kit.recommend import recommend
from remat_kit.walker import saved_residuals, walk
from tests.conftest import needs_cuda_plugin
from tests.user_models import eqx_lm, hf_style, plain_jax

EQX_TAGS = {"layers/ff_block/mlp": "mlp_hidden", "layers/attention_block/attention/*_proj": "attn"}
HF_TAGS = {"h/*/mlp/c_fc": "mlp_hidden"}
SAVE_MLP = {"mlp_hidden": "save"}


def _jax_residuals(fn, *args, capsys) -> list[tuple[str, str]]:
    """``(aval, source)`` lines of ``jax.ad_checkpoint.print_saved_residuals``."""
    capsys.readouterr()
    print_saved_residuals(fn, *args)
    lines = capsys.readouterr().out.strip().splitlines()
    return [tuple(line.split(" ", 1)) for line in lines]


def _short(r) -> str:
    return jax.core.ShapedArray(r.shape, jnp.dtype(r.dtype)).str_short(short_dtypes=True)


def _nbytes(aval: str) -> int:
    dtype, dims = re.fullmatch(r"(\w+)\[([\d,]*)\]", aval).groups()
    size = {"f32": 4, "i32": 4, "bool": 1, "bf16": 2, "f16": 2}[dtype]
    for d in filter(None, dims.split(",")):
        size *= int(d)
    return size


def _same_residuals_as_jax(pure, capsys) -> None:
    """remat-kit's residuals of a program's loss are JAX's, value for value (shape and dtype of
    every non-argument residual)."""
    ours = Counter(_short(r) for r in saved_residuals(pure.fn, *pure.args) if not r.is_argument)
    theirs = Counter(
        a for a, src in _jax_residuals(pure.fn, *pure.args, capsys=capsys)
        if not src.startswith("from the argument")
    )  # fmt: skip
    assert ours == theirs


# --- equinox ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eqx_args():
    return eqx_lm.abstract_arguments()


@pytest.fixture(scope="module")
def eqx_program(eqx_args):
    model, _, tokens = eqx_args
    model = tag_eqx(model, EQX_TAGS)  # before the optimizer state: tagging changes the treedef
    arrays = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt_state = jax.eval_shape(eqx_lm.OPTIMIZER.init, arrays)
    return Program.from_step(
        eqx_lm.make_step, model, opt_state, tokens, donate_argnums=(0, 1),
        make_loss=eqx_lm.make_loss, loss_args=(model, tokens), name="eqx-lm",
    )  # fmt: skip


def test_tag_eqx_keeps_the_model_and_names_unknown_paths(eqx_args):
    model, _, tokens = eqx_args
    tagged = tag_eqx(model, EQX_TAGS)
    assert type(model.layers.ff_block.mlp) is eqx.nn.Linear  # the original is unchanged
    assert isinstance(tagged.layers.ff_block.mlp, eqx.nn.Linear)
    assert type(tagged.layers.ff_block.mlp) is not eqx.nn.Linear
    assert jax.tree.leaves(tagged) == jax.tree.leaves(model)
    loss = eqx_lm.make_loss(jax.checkpoint_policies.nothing_saveable)
    arrays, static = remat_kit.pure.partition(tagged)  # eqx.partition, ShapeDtypeStructs too
    traced = jax.make_jaxpr(lambda a, t: loss(remat_kit.pure.combine(a, static), t))(arrays, tokens)
    tags = remat_kit.walker.tags_in(traced.jaxpr)
    assert tags == {"mlp_hidden", "attn"}
    with pytest.raises(ValueError, match="'layers/ff_block/mlpx' matches no module; closest: "
                       "layers/ff_block/mlp") as err:  # fmt: skip
        tag_eqx(model, {"layers/ff_block/mlpx": "x"})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="already tagged 'mlp_hidden'"):
        tag_eqx(tagged, {"layers/ff_block/mlp": "other"})
    with pytest.raises(ValueError, match="takes an equinox.Module, got dict"):
        tag_eqx({"w": jnp.ones(2)}, EQX_TAGS)


class _Tiny(eqx.Module):
    """An equinox module with a float, a bool and a function among its leaves."""

    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    scale: float
    activation: object

    def __call__(self, x):  # x: [4]
        return self.activation(self.dropout(self.linear(x))) * self.scale


def test_eqx_from_loss_takes_the_module_as_it_is():
    """The model (with its float / bool / function leaves) as the parameters: the optimizer
    state is over its arrays, the step's loss is the loss, its update moves every array."""
    model = _Tiny(eqx.nn.Linear(4, 4, key=jax.random.key(0)), eqx.nn.Dropout(0.1, inference=True),
                  0.5, jax.nn.gelu)  # fmt: skip
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

    def make_loss(policy):
        return lambda m, x: (jax.vmap(m)(x) ** 2).mean()

    program = Program.from_loss(make_loss, model, x, optimizer="sgd")
    assert program.argument_names == ("opt_state", "m", "x")
    pure = program.step(remat_kit.get_policy_spec("no-remat"))
    _, new_params, loss = jax.jit(pure.fn)(*pure.args)
    assert float(loss) == pytest.approx(float(make_loss(None)(model, x)), rel=1e-6)
    before = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    after = jax.tree.leaves(new_params)
    assert len(after) == len(before) == 2 and all(
        not jnp.array_equal(a, b) for a, b in zip(after, before, strict=True)
    )


def test_eqx_analyze_doctor_recommend(eqx_program, capsys):
    reports = analyze_policies(eqx_program, ["no-remat", SAVE_MLP], "local", compare_offload=False)
    no_remat, saving = reports
    assert no_remat.program_sha256 != saving.program_sha256
    assert no_remat.peak_bytes > saving.peak_bytes, (no_remat.peak_bytes, saving.peak_bytes)
    saved = {r.tag: r.nbytes for r in saving.residuals}
    layers_batch_seq_ff = eqx_lm.LAYERS * 2 * eqx_lm.SEQ * eqx_lm.F * 4
    assert saved["mlp_hidden"] == layers_batch_seq_ff
    _same_residuals_as_jax(eqx_program.loss(remat_kit.get_policy_spec(SAVE_MLP)), capsys)
    # the doctor: the saving policy is clean (its names are emitted, it keeps them)
    result = doctor.check_policies(eqx_program, [SAVE_MLP], "local")
    assert not result.has_errors, [f.code for c in result.checks for f in c.findings]
    assert result.tags == frozenset({"mlp_hidden", "attn"})
    # recommend (it estimates step time: a GPU target, deviceless): the compiled pick
    if remat_kit.targets.cuda_plugin_module() is not None:
        rec = recommend(eqx_program, target="h100-sxm", policies=["save-nothing"])
        assert rec.pick is not None and rec.pick.policy == "save-nothing"
        assert rec.pick.peak_bytes and rec.tags == ("attn", "mlp_hidden")


# --- models without a policy hook ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    model, params, tokens = hf_style.arguments()
    return model, params, tokens


def test_inject_policy_traces_what_passing_the_policy_traces():
    """``inject_policy(make_loss(p))(q)`` is ``make_loss(q)``: the same jaxpr, the same
    residuals and the same equations in its gradient; for None the same residuals as the loss
    built without remat. (jax 0.12 orders a gradient's cotangent sums (add_any) differently
    for a re-evaluated jaxpr than for the Python function it was traced from, with no remat
    at all: the gradient's text is not compared, its equations are.)"""
    params = plain_jax.init(jax.random.key(0))
    tokens = jnp.zeros((2, 9), jnp.int32)
    fixed = plain_jax.make_loss(jax.checkpoint_policies.nothing_saveable)

    def equations(fn):
        closed = jax.make_jaxpr(jax.value_and_grad(fn))(params, tokens)
        return Counter((e.primitive.name, *(str(v.aval) for v in e.outvars))
                       for e in walk(closed.jaxpr))  # fmt: skip

    def kept(fn):
        return [(r.tag, r.source, r.shape, r.dtype) for r in saved_residuals(fn, params, tokens)]

    for policy in (jax.checkpoint_policies.dots_saveable,
                   jax.checkpoint_policies.save_only_these_names("mlp_hidden")):  # fmt: skip
        got, want = inject_policy(fixed)(policy), plain_jax.make_loss(policy)
        assert str(jax.make_jaxpr(got)(params, tokens)) == str(jax.make_jaxpr(want)(params, tokens))
        assert kept(got) == kept(want) and kept(got) != kept(fixed)
        assert equations(got) == equations(want)

    def shapes(fn):
        return sorted((r.shape, r.dtype) for r in saved_residuals(fn, params, tokens))

    assert shapes(inject_policy(fixed)(None)) == shapes(plain_jax.make_loss(None))
    assert shapes(fixed) != shapes(plain_jax.make_loss(None))
    with pytest.raises(ValueError, match="policy must be a jax.checkpoint policy"):
        inject_policy(fixed)("save-nothing")


def test_a_factory_that_does_not_pass_the_policy_is_said_once_everywhere(hf, capsys):
    model, params, tokens = hf
    loss = hf_style.loss_fn(model)
    ignoring = Program.from_loss(lambda policy: loss, params, tokens, name="hf-as-is")
    reach = remat_kit.reach.policy_reach(ignoring)
    assert (reach.segments, reach.reached) == (hf_style.Config.n_layer, 0)
    for run in (
        lambda: analyze_policies(ignoring, ["save-nothing", "save-dots"], "local"),
        lambda: recommend(ignoring, target="h100-sxm", policies=["save-nothing", "save-dots"]),
    ):
        with pytest.raises(ValueError, match="does not pass the policy it receives on") as err:
            run()
        assert "remat_kit.inject_policy(loss)" in str(err.value) and "\n" not in str(err.value)
    result = doctor.check_policies(ignoring, ["save-nothing", "save-dots"], "local")
    (check,) = result.checks  # one error: every policy compiles to the same program
    for check in result.checks:
        (only,) = check.findings
        assert only.code == "policy-not-passed" and only.severity == "error"
        assert "none of the 2 remat segment(s)" in only.what
        assert "inject_policy" in only.fix
    assert any("not a no-remat baseline" in n for n in result.notes)
    (only,) = doctor.check_function(lambda policy: loss, params, tokens, policy="save-nothing")
    assert only.code == "policy-not-passed" and "make_loss builds remat segments" in only.cause
    # the command line: exit code 2 and the same one line
    from remat_kit import cli

    ref = "tests/user_models/hf_style.py:program_as_is"
    assert cli.main(["analyze", "--model", ref, "--target", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "remat_kit.inject_policy(loss)" in err, err
    # the same model through inject_policy passes it on, and builds no remat for None
    fixed = remat_kit.reach.policy_reach(Program.from_loss(inject_policy(loss), params, tokens))
    assert (fixed.segments, fixed.reached, fixed.without_policy) == (2, 2, 0)


@needs_cuda_plugin
def test_hf_style_model_through_inject_policy(hf, capsys):
    model, params, tokens = hf
    loss = hf_style.loss_fn(model, apply=tag_linen(model.apply, HF_TAGS))
    program = Program.from_loss(inject_policy(loss), params, tokens, name="hf-style")
    reports = analyze_policies(program, ["no-remat", SAVE_MLP], "h100-sxm", compare_offload=False)
    no_remat, saving = reports
    assert no_remat.peak_bytes > saving.peak_bytes, (no_remat.peak_bytes, saving.peak_bytes)
    assert not any("not a no-remat baseline" in w for w in no_remat.warnings)
    # the saved name's residuals: one per layer in JAX's own list, the same bytes in ours
    pure = program.loss(remat_kit.get_policy_spec(SAVE_MLP))
    named = [a for a, src in _jax_residuals(pure.fn, *pure.args, capsys=capsys)
             if "named 'mlp_hidden'" in src]  # fmt: skip
    assert len(named) == hf_style.Config.n_layer
    saved = {r.tag: r.nbytes for r in saving.residuals}
    assert saved["mlp_hidden"] == sum(map(_nbytes, named))
    _same_residuals_as_jax(pure, capsys)
    result = doctor.check_policies(program, [SAVE_MLP], "h100-sxm")
    assert not result.has_errors, [f.code for c in result.checks for f in c.findings]
    rec = recommend(program, target="h100-sxm", budget=no_remat.peak_bytes - 1,
                    policies=["save-nothing"])  # fmt: skip
    assert rec.pick is not None and rec.pick.policy == "save-nothing"
    assert rec.pick.fits and rec.pick.peak_bytes < no_remat.peak_bytes


# --- bad input ----------------------------------------------------------------------------------


def _tiny_loss(policy):
    def loss(w, x):
        return jnp.tanh(checkpoint_name(x @ w, "h")).sum()

    return loss


class _Opaque:
    """A model class JAX cannot see into (not registered as a pytree)."""

    def __init__(self):
        self.w = jnp.ones((4, 4))


@pytest.mark.parametrize(
    "make, args, match",
    [
        (_tiny_loss, ({"lr": 0.1, "decay": True}, jnp.ones((2, 4))),
         r"argument 'w' \(argnums 0\) holds no arrays \(dict of 2 non-array leaves\): nothing "
         "to differentiate; pass the parameters"),
        (_tiny_loss, (_Opaque(), jnp.ones((2, 4))),
         "argument 'w' holds a _Opaque, which is not a JAX pytree: its 1 arrays would be "
         "compile-time constants"),
        (_tiny_loss, (nn.Dense(4), jnp.ones((2, 4))),
         r"argument 'w' is a flax.linen Module \(Dense\), which holds no arrays: pass its "
         "variables"),
        (_tiny_loss, (jnp.ones((4, 4)), jax.ShapeDtypeStruct((-2, 4), jnp.float32)),
         r"argument 'x' \(itself\) has shape \(-2, 4\): a dimension is negative"),
        (_tiny_loss, ({"w": jax.ShapeDtypeStruct((4, -4), jnp.float32)}, jnp.ones((2, 4))),
         r"argument 'w' \(\['w'\]\) has shape \(4, -4\): a dimension is negative"),
        (lambda policy: lambda w, x: x @ w, (jnp.ones((4, 4)), jnp.ones((2, 4))),
         r"the loss returns float32\[2, 4\], not a scalar: reduce it"),
        (lambda policy: lambda w, x: (x @ w).sum().astype(jnp.int32),
         (jnp.ones((4, 4)), jnp.ones((2, 4))),
         r"the loss returns int32\[\], which cannot be differentiated: return a float scalar"),
        (lambda policy: lambda w, x: ((x @ w).sum(), {"acc": 1.0}),
         (jnp.ones((4, 4)), jnp.ones((2, 4))),
         "the loss returns a tuple of 2 leaves, not a scalar: return the scalar loss alone"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_what_to_pass(make, args, match):
    with pytest.raises(ValueError, match=match) as err:
        Program.from_loss(make, *args)
    assert "\n" not in str(err.value)
    if isinstance(args[0], _Opaque):  # the same for a step's argument
        with pytest.raises(ValueError, match="not a JAX pytree"):
            Program.from_step(lambda p: lambda m, x: x, args[0], args[1]).step(
                remat_kit.get_policy_spec("no-remat")
            )


def _step_with_its_own_policy():
    """A user's step that builds its own loss under a fixed policy, beside a ``make_loss``
    that passes the policy on: what compiles ignores the policy, what is walked does not."""
    params, opt_state, token_ids = plain_jax.abstract_args()
    fixed = jax.checkpoint_policies.nothing_saveable
    return Program.from_step(
        lambda policy: plain_jax.make_step(fixed), params, opt_state, token_ids,
        make_loss=plain_jax.make_loss, loss_args=(params, token_ids), name="own-step",
    )  # fmt: skip


def test_a_step_ignoring_the_policy_is_caught_when_its_loss_passes_it(tmp_path):
    program = _step_with_its_own_policy()
    reach = remat_kit.reach.policy_reach(program)
    assert not reach.passes and reach.part == "make_step" and reach.segments == 1  # in a scan
    for run in (
        lambda: analyze_policies(program, ["save-nothing", "save-dots"], "local"),
        lambda: analyze_policies(program, None, "local"),
        lambda: recommend(program, target="h100-sxm", policies=["save-nothing"]),
        lambda: measured.run_program_sweep(program, tmp_path / "s.jsonl", progress=False),
    ):
        with pytest.raises(ValueError, match="make_step of program 'own-step' does not pass"):
            run()
    assert not (tmp_path / "s.jsonl").exists()  # nothing written
    result = doctor.check_policies(program, None, "local")
    ((only,),) = [c.findings for c in result.checks]  # one error, no note built on the probe
    assert only.code == "policy-not-passed" and "make_step of 'own-step'" in only.cause
    assert not any("no own-name policy" in n for n in result.notes)
    # the same program with a step that passes it: no judgement against it
    fine = Program.from_step(
        plain_jax.make_step, *plain_jax.abstract_args(), make_loss=plain_jax.make_loss,
        loss_args=(plain_jax.abstract_args()[0], plain_jax.abstract_args()[2]),
    )  # fmt: skip
    assert remat_kit.reach.policy_reach(fine).passes


class _DropLayer(eqx.Module):
    """A residual layer with a dropout (its ``p`` a float, ``inference`` a bool)."""

    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(8, 8, key=key)
        self.dropout = eqx.nn.Dropout(0.1, inference=True)

    def __call__(self, x):  # x: [8]
        return x + self.dropout(jnp.tanh(self.linear(x)))


def _drop_loss(policy):
    def loss(layers, x):  # layers stacked [3]; x: [batch, 8]
        dynamic, static = eqx.partition(layers, eqx.is_array)

        def layer(h, p):
            return jax.vmap(eqx.combine(p, static))(h)

        if policy is not None:
            layer = eqx.filter_checkpoint(layer, policy=policy)
        return (jax.lax.scan(lambda h, p: (layer(h, p), None), x, dynamic)[0] ** 2).mean()

    return loss


def test_a_modules_float_and_bool_leaves_stay_static_on_every_path():
    """check_function traced an equinox.Module's float and bool leaves as inputs, so the
    model's own eqx.partition took the dropout's p for an array and its scan failed. It takes
    the arguments as a Program does now (static leaves closed over); from_step and from_loss
    over the same module trace as well."""
    layers = eqx.filter_vmap(_DropLayer)(jax.random.split(jax.random.key(0), 3))
    x = jnp.ones((4, 8))
    findings = doctor.check_function(_drop_loss, layers, x, policy="save-nothing", target="cpu")
    assert not doctor.has_errors(findings), [f.line() for f in findings]
    tx = optax.sgd(0.1)

    def make_step(policy):
        @eqx.filter_jit
        def step(layers, opt_state, x):
            value, grads = eqx.filter_value_and_grad(_drop_loss(policy))(layers, x)
            updates, opt_state = tx.update(grads, opt_state, eqx.filter(layers, eqx.is_array))
            return eqx.apply_updates(layers, updates), opt_state, value

        return step

    opt_state = tx.init(eqx.filter(layers, eqx.is_array))
    stepped = Program.from_step(make_step, layers, opt_state, x, donate_argnums=(0, 1))
    for program in (stepped, Program.from_loss(_drop_loss, layers, x, optimizer=tx)):
        assert program.reach().passes
