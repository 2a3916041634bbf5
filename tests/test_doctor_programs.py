"""The doctor on a user's own program: its own checkpoint names, the default policy set, one
finding per policy naming names it never emits, tags that are not residuals, partial CSE."""

import types

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit
from remat_kit import Program, cli, doctor
from remat_kit.doctor.compare import Residuals, _no_device_saving, _no_op
from remat_kit.doctor.promise import Promise
from remat_kit.doctor.tags import TagFacts, feeds, matmul_tags, unknown_tags
from tests.conftest import needs_cuda_plugin

GPU = "h100-sxm"
D, LAYERS = 32, 2
W = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
X = jax.ShapeDtypeStruct((2, 16, D), jnp.float32)


def _program(layer, name, outside=None):
    """A user's loss: ``layer(x, w)`` under jax.checkpoint in a lax.scan over LAYERS weights;
    ``outside(x)`` applied before the scan (outside every remat segment)."""

    def make_loss(policy):
        body = layer if policy is None else jax.checkpoint(layer, policy=policy)

        def loss(ws, x):
            if outside is not None:
                x = outside(x)
            x, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)
            return (x**2).mean()

        return loss

    return Program.from_loss(make_loss, W, X, name=name)


def _own_layer(x, w):  # names of its own choosing, as plain_jax.py
    h = jnp.tanh(checkpoint_name(x @ w, "attn_in"))
    return x + checkpoint_name(jnp.sin(h @ w.T), "mlp_hidden")


def own_tags_program():
    """The command line's factory: ``--model tests.test_doctor_programs:own_tags_program``."""
    return _program(_own_layer, "own-tags")


def _maxtext_layer(x, w):  # some of remat-kit's (MaxText) names, not all
    q = checkpoint_name(x @ w, "query_proj")
    return x + checkpoint_name(jnp.tanh(q) @ w.T, "mlpwi")


def _codes(findings):
    return [f.code for f in findings]


def test_default_set_on_own_tags_is_clean_with_one_note():
    result = doctor.check_policies(own_tags_program(), target="cpu")
    labels = [c.label for c in result.checks]
    assert labels[:4] == ["no-remat", "save-nothing", "save-dots", "save-dots-no-batch"]
    # then its own names that saving can keep: attn_in (x @ w, recomputed otherwise); not
    # mlp_hidden (sin's output: its derivative needs cos of the input), said in a note
    assert result.tags == {"attn_in", "mlp_hidden"} and labels[4:] == ["custom: attn_in=save"]
    assert any(n.startswith("no own-name policy for mlp_hidden") for n in result.notes)
    assert not result.has_errors, [f.line() for c in result.checks for f in c.findings]
    skipped = [n for n in result.notes if "save-qkv-proj" in n]
    assert len(skipped) == 1 and "offload-to-host" in skipped[0]
    assert "would run as save-nothing" in skipped[0]
    text = result.summary().splitlines()
    assert text[0] == f"doctor on 'own-tags': {len(labels)} policies; tags: attn_in, mlp_hidden"
    assert [line[:-1] for line in text if line.endswith(":")] == labels
    assert text[-len(result.notes) :] == [f"note: {n}" for n in result.notes]


def test_named_policies_cut_down_to_the_emitted_names_are_labelled():
    result = doctor.check_policies(_program(_maxtext_layer, "half-maxtext"), target="cpu")
    labels = [c.label for c in result.checks]
    assert "save-qkv-proj, save-qkv-out-proj, save-dots-except-mlp (cut)" in labels
    assert "minimal (cut)" in labels
    assert any(n.startswith("minimal names") and "mlpwi=save, query_proj=save" in n
               for n in result.notes)  # fmt: skip
    # Offload policies on a target without host offload: one note, not checked.
    (no_host,) = [n for n in result.notes if n.startswith("not compiled:")]
    assert "offload-to-host" in no_host and "offload-qkv-proj" in no_host
    assert not any(c.spec.offloads for c in result.checks)
    assert not result.has_errors, [f.line() for c in result.checks for f in c.findings]


@needs_cuda_plugin
def test_explicit_policy_naming_absent_tags_is_one_error_in_the_programs_terms():
    results = doctor.check_policies(
        own_tags_program(),
        ["save-qkv-proj", "offload-qkv-proj", {"mlp_hiden": "save", "attn_in": "save"}],
        GPU,
    )
    for findings in results:
        assert _codes(findings) == ["unknown-tag"], [f.line() for f in findings]
    qkv, offload, typo = (f[0] for f in results)
    assert "'key_proj', 'query_proj', 'value_proj'" in qkv.what
    assert "runs as save-nothing" in qkv.what and "emitted: attn_in, mlp_hidden" in qkv.what
    assert "SwiGLU" not in qkv.cause and "names of its own" in qkv.cause
    assert "'attn_in=save'" in qkv.fix and "offload-layer-inputs" not in offload.fix
    assert "=offload'" in offload.fix
    assert "'mlp_hiden' (closest: 'mlp_hidden')" in typo.what
    assert "runs as attn_in=save" in typo.what and typo.fix == "use 'mlp_hidden' for 'mlp_hiden'."


def test_family_hint_only_where_the_program_emits_maxtext_names():
    swiglu = Promise("custom", save=frozenset({"mlpwi_0"}))
    (maxtext,) = unknown_tags(swiglu, TagFacts(frozenset({"mlpwi", "mlpwo"}), user=True))
    (own,) = unknown_tags(swiglu, TagFacts(frozenset({"ff_in", "ff_out"}), user=True))
    assert "SwiGLU" in maxtext.cause and "SwiGLU" not in own.cause
    assert maxtext.fix == "use 'mlpwi' for 'mlpwi_0'."


def _unneeded_layer(x, w):  # 'skip' only feeds the residual add: never a residual
    h = jnp.tanh(checkpoint_name(x @ w, "pre"))
    return checkpoint_name(h @ w.T, "skip") + x


def _outside(x):  # tagged before the scan: outside every remat segment
    return checkpoint_name(jnp.sin(x), "embed_out")


@needs_cuda_plugin
def test_emitted_tag_that_is_not_a_residual_gets_the_right_cause():
    unneeded = doctor.check_policies(
        _program(_unneeded_layer, "unneeded"), [{"skip": "save"}, {"skip": "offload"}], GPU
    )
    for findings in unneeded:
        assert _codes(findings) == ["acts-as-full-remat"], [f.line() for f in findings]
        assert "the backward pass does not need skip" in findings[0].cause
    (outside,) = doctor.check_policies(
        _program(_own_layer, "outside", _outside), [{"embed_out": "offload"}], GPU
    )
    assert _codes(outside) == ["acts-as-full-remat"], [f.line() for f in outside]
    assert outside[0].cause == (
        "embed_out is applied outside every remat segment: it is stored or not regardless of "
        "the policy."
    )
    # what to save instead: the names whose saving keeps them (attn_in = x @ w), not mlp_hidden
    # (sin's output, not a residual even when saved)
    assert "removes recompute (attn_in; matmul outputs first)" in outside[0].fix


def _unrolled(prevent_cse):
    """Layers in a Python loop, each under jax.checkpoint with its own prevent_cse."""

    def make_loss(policy):
        def layer(x, w):
            return jnp.tanh(x @ w) @ w.T + x

        def loss(ws, x):
            for i, keep in enumerate(prevent_cse):
                f = layer if policy is None else jax.checkpoint(layer, policy=policy,
                                                                prevent_cse=keep)  # fmt: skip
                x = f(x, ws[i])
            return (x**2).mean()

        return loss

    ws = jax.ShapeDtypeStruct((len(prevent_cse), 64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 32, 64), jnp.float32)
    return Program.from_loss(make_loss, ws, x, name="unrolled")


@needs_cuda_plugin
def test_partial_cse_is_a_warning_as_analyze_says():
    program = _unrolled((True, False, False))
    (report,) = remat_kit.analyze_policies(program, ["save-nothing"], GPU)
    assert any("merged part of the recomputation" in w for w in report.warnings)
    findings = doctor.check(program, policy="save-nothing", target=GPU)
    assert _codes(findings) == ["cse-undid-part-of-remat"], [f.line() for f in findings]
    assert findings[0].severity == "warning" and not doctor.has_errors(findings)


@needs_cuda_plugin
def test_recomputation_in_a_scan_is_not_reported_as_undone():
    # Measured (jax 0.10.2, h100-sxm deviceless): the recomputed dot of this scan body carries
    # no remat scope in its op_name; the compiled FLOPs over no-remat show it recomputes.
    (report,) = remat_kit.analyze_policies(_program(_unneeded_layer, "scan"), ["save-nothing"], GPU)
    assert report.recompute_ratio > 1.05
    assert not any("XLA's CSE merged" in w for w in report.warnings), report.warnings


@pytest.mark.parametrize(
    "extra, code, errors",
    [([], 0, 0), (["--policy", "save-qkv-proj", "--policy", "save-nothing"], 1, 1)],
)
def test_cli_on_own_tags(capsys, extra, code, errors):
    argv = ["doctor", "--model", "tests.test_doctor_programs:own_tags_program", *extra]
    assert cli.main([*argv, "--target", "cpu"]) == code
    out = capsys.readouterr().out
    assert out.count("error:") == errors, out
    assert "emits: attn_in, mlp_hidden" in out


def test_cli_json_on_own_tags_holds_findings_and_notes(capsys):
    argv = ["doctor", "--model", "tests.test_doctor_programs:own_tags_program", "--json"]
    assert cli.main([*argv, "--target", "cpu", "--policy", "attn_in=save"]) == 0
    out = __import__("json").loads(capsys.readouterr().out)
    assert out["policies"] == {"custom: attn_in=save": []}
    assert out["notes"] == ["program 'own-tags' emits: attn_in, mlp_hidden"]


def _forgetful(layer):
    """A factory that never applies the policy it receives (no jax.checkpoint at all)."""

    def make_loss(policy):
        def loss(ws, x):
            x, _ = jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)
            return (x**2).mean()

        return loss

    return make_loss


def test_factory_ignoring_the_policy_is_one_error_for_every_policy_and_nothing_else():
    program = Program.from_loss(_forgetful(_own_layer), W, X, name="forgot")
    for given in (["save-nothing", {"attn_in": "save"}], None):  # given, or the default set
        result = doctor.check_policies(program, given, GPU)
        (check,) = result.checks  # said once: every policy compiles to the same program
        (only,) = check.findings
        assert check.label == "every policy" and result.has_errors
        assert only.code == "no-remat-segment" and only.severity == "error"
        assert only.what.startswith("no policy is applied: the step contains no remat segment")
        assert "make_loss of 'forgot' does not use the policy it receives" in only.cause
        assert "jax.checkpoint(layer, policy=policy)" in only.fix
        assert "save-nothing" not in only.fix  # never the policy being checked
    # check_function: the same fault, the same single finding
    (only,) = doctor.check_function(_forgetful(_own_layer), W, X, policy="save-nothing")
    assert only.code == "no-remat-segment" and "make_loss does not use" in only.cause
    # a factory that applies it has no such finding
    assert "no-remat-segment" not in _codes(
        doctor.check_function(_program(_own_layer, "ok").make_loss, W, X, policy="save-nothing")
    )


def test_no_op_fix_never_advises_the_policy_being_checked():
    kept = Residuals(0, 0, frozenset(), False)
    for name in ("save-nothing", "save-dots-no-batch", "save-dots"):
        finding = _no_op(Promise.of(remat_kit.get_policy_spec(name)), kept)
        advised = finding.fix.rstrip(".").rpartition(" use ")[2].split(" / ")
        assert finding.code == "no-op-policy" and name not in advised, finding.fix
    nothing = _no_op(Promise.of(remat_kit.get_policy_spec("save-nothing")), kept)
    assert "inside the checkpointed function" in nothing.fix


@pytest.mark.parametrize(
    ("peak", "says"),
    [(30 << 20, "a lower peak (20.00 MiB vs 30.00 MiB with the offload)"),
     (20 << 20, "the same peak, 20.00 MiB vs 20.00 MiB with the offload")],
)  # fmt: skip
def test_offload_no_device_saving_fix_follows_the_measured_peaks(peak, says):
    report = types.SimpleNamespace(peak_bytes=peak, host_bytes=1 << 20)
    finding = _no_device_saving(Promise("custom", offload=frozenset({"a"})), report, 20 << 20)
    assert finding.code == "offload-no-device-saving" and says in finding.fix, finding.fix
    assert ("same peak" in finding.fix) == (peak == 20 << 20)


def _two_savers_layer(x, w):  # 'act' (tanh's output) and 'attn_in' (a matmul's) both kept;
    # saving 'act' alone still recomputes x @ w (JAX's backward of tanh here recomputes tanh
    # from its input: the traced FLOPs are save-nothing's), so only attn_in removes recompute
    h = checkpoint_name(x @ w, "attn_in")
    return x + checkpoint_name(jnp.tanh(h), "act") @ w.T


@needs_cuda_plugin
def test_tag_outside_remat_offload_says_nothing_is_offloadable_and_fix_lists_savers():
    program = _program(_two_savers_layer, "outside2", _outside)
    offload, save = doctor.check_policies(
        program, [{"embed_out": "offload", "act": "save"}, {"embed_out": "save"}], GPU
    )
    (nothing,) = [f for f in offload if f.code == "offload-no-host-bytes"]
    assert "offloads nothing: 0 B to host in the jaxpr, and none in the compiled step" in (
        nothing.what
    )
    assert " but " not in nothing.what
    assert nothing.cause == (
        "embed_out is applied outside every remat segment: it is stored or not regardless of "
        "the policy, so no policy can offload it."
    )
    (full,) = [f for f in save if f.code == "acts-as-full-remat"]
    assert "does not keep it" in full.what
    assert "removes recompute (attn_in; matmul outputs first)" in full.fix


def _kept_but_recomputed_layer(x, w):  # gelu's derivative needs its input: 'act' saves no matmul
    h = checkpoint_name(x @ w, "attn_in")
    return x + checkpoint_name(jax.nn.gelu(h), "act") @ w.T


@needs_cuda_plugin
def test_a_tag_kept_but_still_recomputed_is_not_offered_as_a_saver():
    """Saving a name applied after an activation whose derivative needs the activation's input
    keeps it, yet the matmul under it is recomputed all the same: the doctor's fix does not
    list it among the tags whose saving removes recompute (it did, beside the solver's
    per-tag FLOPs, which give it none; outside trial: an NNX block tagging mlpwi after gelu)."""
    program = _program(_kept_but_recomputed_layer, "gelu-after", _outside)
    (save,) = doctor.check_policies(program, [{"embed_out": "save"}], GPU)
    (full,) = [f for f in save if f.code == "acts-as-full-remat"]
    assert "removes recompute (attn_in; matmul outputs first)" in full.fix, full.fix


def test_matmul_tags_look_through_a_bias_add_and_a_transpose():
    """A constant added first (``1.0 + x @ w``: a literal operand, not hashable) is looked past:
    it raised TypeError from the doctor, in matmul_tags and in fed_by alike."""

    def layer(x, w, b):
        y = checkpoint_name(x @ w + b, "biased")  # a Dense layer's output
        z = checkpoint_name(jnp.einsum("ij,jk->ki", x, w), "transposed")  # einsum, transposed
        c = checkpoint_name(1.0 + x @ w, "shifted")  # a literal operand before the matmul's
        a = checkpoint_name(2.0 + jnp.tanh(c), "after")
        return (jnp.tanh(checkpoint_name(y * 2, "scaled")) + z.T + a).sum()

    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.checkpoint(layer))(x, w, w.update(shape=(8,))).jaxpr
    assert matmul_tags(jaxpr) == {"biased", "transposed", "shifted"}
    assert feeds(jaxpr).fed["after"] == {"shifted"} and feeds(jaxpr).fed["scaled"] == {"biased"}


def _after_activation_layer(x, w):  # one name before its activation, one after
    pre = checkpoint_name(x @ w, "mlp_pre")
    act = checkpoint_name(jax.nn.gelu(pre), "mlp_act")
    return x + act @ w.T


@pytest.mark.parametrize(
    ("policy", "flagged"),
    [
        ({"mlp_act": "save"}, ["mlp_act"]),  # gelu's derivative needs x @ w: recomputed anyway
        ({"mlp_pre": "save"}, []),  # keeps x @ w: the backward pass does not recompute it
        ({"mlp_pre": "save", "mlp_act": "save"}, ["mlp_act"]),
    ],
)
def test_a_saved_tag_that_removes_no_recompute_is_said(policy, flagged):
    """The doctor said ``ok`` for a policy keeping a name applied after an activation: memory
    spent, no matmul spared. Judged by the step's traced FLOPs, as the solver and the doctor's
    own fixes judge; an ``info`` (sparing a softmax's elementwise work can be worth it), not a
    warning."""
    program = _program(_after_activation_layer, "after-activation")
    (check,) = doctor.check_policies(program, [policy], target="cpu").checks
    found = [f for f in check.findings if f.code == "save-removes-no-recompute"]
    if not flagged:
        assert not found, found
        return
    (finding,) = found
    assert finding.severity == "info"
    assert f"keeps {', '.join(flagged)} (" in finding.what
    assert "removes no matmul recompute" in finding.what
    if "mlp_pre" not in policy:  # the tag that does remove recompute is offered instead
        assert "(mlp_pre)" in finding.fix and "this policy keeps" not in finding.cause
    else:  # the matmul output is kept: only the activation's elementwise work is spared
        assert "this policy keeps mlp_pre" in finding.cause
        assert "spares only the elementwise work" in finding.cause


def _tagged_matmul_elsewhere(x, w):  # the saved matmul output does not feed the name after gelu
    qkv = checkpoint_name(x @ w, "qkv")
    act = checkpoint_name(jax.nn.gelu(qkv @ w), "ffn_act")  # an untagged matmul before gelu
    return x + act @ w.T


def test_what_a_name_is_computed_from_is_read_through_elementwise_work_only():
    """``feeds``: the names a name is computed from with no matmul between (through gelu's
    jitted call), which the doctor's cause names; an untagged matmul between cuts it."""
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    fed, bare = feeds(jax.make_jaxpr(jax.checkpoint(_after_activation_layer))(x, w).jaxpr)
    assert fed == {"mlp_pre": frozenset(), "mlp_act": frozenset({"mlp_pre"})} and not bare
    fed, bare = feeds(jax.make_jaxpr(jax.checkpoint(_tagged_matmul_elsewhere))(x, w).jaxpr)
    assert fed == {"qkv": frozenset(), "ffn_act": frozenset()} and not bare


def test_the_cause_names_a_kept_output_only_where_the_idle_name_is_computed_from_it():
    """The outside trial's decoder: saving qkv (a matmul output) and ffn_act (after gelu of
    another, untagged matmul) said "this policy keeps qkv: where one is that output, saving it
    spares only the elementwise work", of an output ffn_act is not computed from."""
    program = _program(_tagged_matmul_elsewhere, "tagged-elsewhere")
    (check,) = doctor.check_policies(program, [{"qkv": "save", "ffn_act": "save"}], "cpu").checks
    (finding,) = [f for f in check.findings if f.code == "save-removes-no-recompute"]
    assert "keeps ffn_act (" in finding.what and "this policy keeps" not in finding.cause


def test_a_registered_policy_in_other_names_is_rewritten_with_the_programs_closest_word():
    """save-qkv-proj on a program tagging qkv / ctx / ffn_act: the example fix says 'qkv=save'
    (the word the policy's name shares), not the program's first name in sorted order ('ctx')."""
    facts = TagFacts(frozenset({"qkv", "ctx", "ffn_act"}), user=True)
    (finding,) = unknown_tags(Promise.of(remat_kit.get_policy_spec("save-qkv-proj")), facts)
    assert "'qkv=save'" in finding.fix, finding.fix
    (plain,) = unknown_tags(Promise.of(remat_kit.get_policy_spec("save-out-proj")), facts)
    assert "'ctx=save'" in plain.fix  # no shared word: the first name, as before


def _norm_first_layer(x, w):  # a pre-norm block: the layer's input, its norm, then the MLP
    x = checkpoint_name(x, "layer_in")
    normed = checkpoint_name(x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6), "normed")
    up = checkpoint_name(normed @ w, "up")
    return x + checkpoint_name(jax.nn.gelu(up), "act") @ w.T


def test_a_name_computed_from_the_layers_input_alone_is_not_said_to_recompute_a_matmul():
    """Saving a norm of the layer's input removes no recompute, as saving a name after an
    activation does, but for another reason: no matmul is computed before it at all. The
    cause said "recomputes the matmul that produces it" of a norm (outside trial, session 15);
    each kind gets its own cause."""
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    fed, bare = feeds(jax.make_jaxpr(jax.checkpoint(_norm_first_layer))(x, w).jaxpr)
    assert bare == {"layer_in", "normed"} and fed["normed"] == {"layer_in"}
    fed, bare = feeds(jax.make_jaxpr(_norm_first_layer)(x, w).jaxpr)  # no remat segment
    assert not bare
    program = _program(_norm_first_layer, "norm-first")
    checks = doctor.check_policies(program, [{"normed": "save"}, {"act": "save"}], "cpu").checks
    (norm,) = [f for f in checks[0].findings if f.code == "save-removes-no-recompute"]
    assert "keeps normed (" in norm.what
    assert "computed from the remat segment's input with no matmul between" in norm.cause
    assert "recomputes the matmul" not in norm.cause
    (act,) = [f for f in checks[1].findings if f.code == "save-removes-no-recompute"]
    assert "keeps act (" in act.what and "recomputes the matmul that it is" in act.cause


def test_saving_the_layers_input_is_said_to_change_nothing():
    """A name on the remat segment's input (MaxText's decoder_layer_input on a one-layer
    segment) is kept by save-nothing as well: the doctor told the user its saving "removes no
    matmul recompute" and to leave it out, as if it cost memory (outside trial, session 16);
    the policy saving it alone compiles to save-nothing's program."""
    program = _program(_norm_first_layer, "norm-first")
    alone, more = doctor.check_policies(
        program, [{"layer_in": "save"}, {"layer_in": "save", "up": "save"}], "cpu"
    ).checks
    (same,) = [f for f in alone.findings if f.code == "saved-anyway"]
    assert same.severity == "warning" and "compiles to save-nothing's program" in same.what
    assert "the input of a remat segment" in same.cause
    assert not [f for f in alone.findings if f.code == "save-removes-no-recompute"]
    (part,) = [f for f in more.findings if f.code == "saved-anyway"]
    assert part.severity == "info" and "saves layer_in," in part.what
    assert "compiles to save-nothing" not in part.what


# -- Placement of the remat: around a whole scan, or for None as well (public reports: jax#27748
# and jax#3186, a jax.checkpoint around the whole lax.scan; maxtext#3924, policy=None mixed up) --

L6, B6, S6, D6, F6 = 4, 2, 32, 32, 128


def _layer6(x, w):
    h = checkpoint_name(jnp.tanh(x @ w["w1"]), "hidden")
    return x + h @ w["w2"]


_W6 = {
    "w1": jax.ShapeDtypeStruct((L6, D6, F6), jnp.float32),
    "w2": jax.ShapeDtypeStruct((L6, F6, D6), jnp.float32),
}
_X6 = jax.ShapeDtypeStruct((B6, S6, D6), jnp.float32)


def _scan(body):
    return lambda ws, x: jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)[0]


def _whole_scan_program():
    """jax.checkpoint around the whole lax.scan (its body has no remat of its own)."""

    def make_loss(policy):
        run = _scan(_layer6)
        run = run if policy is None else jax.checkpoint(run, policy=policy)
        return lambda ws, x: (run(ws, x) ** 2).mean()

    return Program.from_loss(make_loss, _W6, _X6, optimizer="sgd", name="whole-scan")


def _always_remat_program():
    """A factory with no ``if policy is None``: jax.checkpoint(policy=None) saves nothing."""

    def make_loss(policy):
        run = _scan(jax.checkpoint(_layer6, policy=policy))
        return lambda ws, x: (run(ws, x) ** 2).mean()

    return Program.from_loss(make_loss, _W6, _X6, optimizer="sgd", name="always-remat")


def test_remat_around_a_whole_scan_is_said_with_its_fix_by_analyze_and_the_doctor():
    program = _whole_scan_program()
    assert program.reach().around_loop == 1
    findings = doctor.check(program, policy="save-nothing", target="cpu")
    (f,) = [f for f in findings if f.code == "remat-around-loop"]
    assert f.severity == "error" and "wrap a whole lax.scan" in f.cause
    assert "lax.scan(jax.checkpoint(body" in f.fix
    # no other cause is offered beside it (the peak "outside the layers", CSE)
    assert not {"remat-not-lowering-peak", "no-op-policy", "cse-undid-remat"} & {
        g.code for g in findings
    }
    (r,) = remat_kit.analyze_policies(program, ["save-nothing"], target="cpu")
    assert any(
        "wrap a whole lax.scan" in w and "checkpoint the loop's body" in w for w in r.warnings
    )
    assert not any("XLA undid" in w for w in r.warnings)


def test_remat_inside_the_scan_body_is_not_around_a_loop():
    assert _program(_layer6_d, "in-body").reach().around_loop == 0


def _layer6_d(x, w):  # _program's weights: [LAYERS, D, D]
    return x + jnp.tanh(x @ w)


def test_a_factory_remating_for_none_is_judged_against_save_everything_and_said_in_recommend():
    program = _always_remat_program()
    assert program.reach().without_policy == 1
    checked = doctor.check_policies(program, ["save-nothing", "no-remat"], target="cpu")
    assert any("judged against save-everything" in n for n in checked.notes)
    (sn,) = [c for c in checked.checks if c.label == "save-nothing"]
    # against its own (rematerialised) "no-remat" it read "nothing is recomputed"
    assert "no-op-policy" not in {f.code for f in sn.findings}
    # the no-remat row itself: analyze warns under it, the doctor said nothing (MaxText's
    # scanned remat_policy='none'); a factory building none for None gets no such error
    # (test_default_set_on_own_tags_is_clean_with_one_note)
    (nr,) = [c for c in checked.checks if c.label == "no-remat"]
    (err,) = [f for f in nr.findings if f.code == "no-remat-remats"]
    assert err.severity == "error" and "builds 1 remat segment(s) when given" in err.what
    assert "make_loss passes None on" in err.cause and "inject_policy" in err.fix
    assert "no-remat-remats" not in {f.code for f in sn.findings}
    rec = remat_kit.recommend(program, target="cpu", budget="1GiB", policies=["no-remat"])
    assert rec.remats_for_none == 1 and rec.pick.policy == "no-remat"
    assert "still builds 1 remat segment(s) for None" in rec.line()
    assert "no remat: your factory builds the step without" not in rec.line()
    assert any("not a no-remat baseline" in n for n in rec.notes)


def _tagged_carry_program():
    """Each layer's output (the scan carry) named ``residual``: only additions and the next
    layer read it, so no backward pass keeps it (jax#23869's offloaded carry)."""

    def layer(x, w):
        return checkpoint_name(_layer6(x, w), "residual")

    def make_loss(policy):
        run = _scan(jax.checkpoint(layer, policy=policy) if policy is not None else layer)
        return lambda ws, x: (run(ws, x) ** 2).mean()

    return Program.from_loss(make_loss, _W6, _X6, optimizer="sgd", name="tagged-carry")


def test_a_name_a_policy_keeps_nowhere_beside_one_it_keeps_is_said():
    program = _tagged_carry_program()
    both = doctor.check(program, policy={"hidden": "save", "residual": "save"}, target="cpu")
    (f,) = [f for f in both if f.code == "name-kept-nowhere"]
    assert "names residual but does not keep it" in f.what
    assert "backward pass does not need residual" in f.cause and "leave residual out" in f.fix
    alone = doctor.check(program, policy={"hidden": "save"}, target="cpu")
    assert "name-kept-nowhere" not in {g.code for g in alone}


def test_an_opaque_callable_keeping_everything_is_not_blamed_on_the_layers_placement():
    """save_anything_except_these_names (jax#37888): the layers are inside jax.checkpoint; a
    no-op finding may say the callable keeps everything, never that they are outside it."""
    cp = jax.checkpoint_policies

    def make_loss(policy):
        run = _scan(jax.checkpoint(_layer6, policy=policy))
        return lambda ws, x: (run(ws, x) ** 2).mean()

    found = remat_kit.check_function(
        make_loss, _W6, _X6, policy=cp.save_anything_except_these_names("hidden"), target="cpu"
    )
    assert found and all("outside every jax.checkpoint" not in f.cause for f in found)


def test_save_any_names_but_these_is_judged_as_the_name_set_it_amounts_to():
    """save_any_names_but_these("hidden") on a step whose other name (the carry, ``residual``)
    is never a residual saves nothing: the error the mapping {"residual": "save"} gets; a name
    it leaves out that the program never emits is a typo; the rest it saves is not judged name
    by name."""
    cp = jax.checkpoint_policies
    program = _tagged_carry_program()
    args = (_W6, _X6)

    def codes(policy):
        found = remat_kit.check_function(program.make_loss, *args, policy=policy, target="cpu")
        return {f.code: f for f in found}

    as_dict = doctor.check(program, policy={"residual": "save"}, target="cpu")
    assert "acts-as-full-remat" in _codes(as_dict)
    raw = codes(cp.save_any_names_but_these("hidden"))
    assert "acts-as-full-remat" in raw and "promises to keep residual" in raw[
        "acts-as-full-remat"].what  # fmt: skip
    typo = codes(cp.save_any_names_but_these("hiden"))
    assert "leaves out 'hiden' (closest: 'hidden')" in typo["unknown-tag"].what
    assert "name-kept-nowhere" not in typo and "acts-as-full-remat" not in typo
    assert "acts-as-full-remat" not in codes(cp.save_any_names_but_these("residual"))


def _two_activations_layer(x, w):  # two names, each after its activation: neither spares a matmul
    a = checkpoint_name(jax.nn.gelu(x @ w), "act_a")
    b = checkpoint_name(jax.nn.gelu(x @ w.T), "act_b")
    return x + a * b


@pytest.mark.parametrize(
    ("policy", "flagged"),
    [
        ({"mlp_act": "offload"}, ["mlp_act"]),  # host traffic, and x @ w recomputed anyway
        ({"mlp_pre": "offload"}, []),  # keeps x @ w (on host): its recompute is spared
    ],
)
def test_an_offloaded_tag_that_removes_no_recompute_is_said(policy, flagged):
    """A user trial: recommend picked ``offload-to-host (cut)``, which offloads a name whose
    keeping spares no matmul, and the doctor said nothing of it (it judged saved names only)."""
    program = _program(_after_activation_layer, "after-activation")
    # judged on the jaxpr: the same on a target that ignores offload (no CUDA plugin needed)
    (check,) = doctor.check_policies(program, [policy], target="cpu").checks
    found = [f for f in check.findings if f.code == "offload-removes-no-recompute"]
    assert [f.severity for f in found] == ["info"] * len(flagged), [f.line() for f in found]
    for f in found:
        assert "offloads mlp_act" in f.what and "to host memory" in f.what, f.line()


def _pre_and_act_layer(x, w):  # a matmul's output and the activation after it
    h = checkpoint_name(x @ w, "pre")
    return x + checkpoint_name(jax.nn.gelu(h), "act") @ w.T


def test_an_idle_name_beside_others_is_not_said_to_be_saved_alone():
    """Judged within the policy (session 18), the cause still said "saved alone" of a name the
    policy saves beside others (s19 newcomer, on own-model.md's every-name policy)."""
    program = _program(_pre_and_act_layer, "pre-act")
    (check,) = doctor.check_policies(program, [{"pre": "save", "act": "save"}], "cpu").checks
    (f,) = [f for f in check.findings if f.code == "save-removes-no-recompute"]
    assert "act" in f.what and "saved alone or beside the other names this policy saves" in (
        f.cause
    ), f.line()


def test_names_saving_no_recompute_are_said_in_plain_english_and_by_what_the_policy_named():
    """Two idle names read "they spare", "they are computed from" (not "them"); under
    save_any_names_but_these the fix says to leave them out by adding them to its list, and a
    name it saves without naming it is not "named"."""
    program = _program(_two_activations_layer, "two-activations")
    (check,) = doctor.check_policies(
        program, [{"act_a": "save", "act_b": "save"}], target="cpu"
    ).checks
    (f,) = [f for f in check.findings if f.code == "save-removes-no-recompute"]
    assert "saved alone, they spare no matmul" in f.cause
    assert "the matmul that they are computed from" in f.cause and "them are" not in f.cause
    found = remat_kit.check_function(
        _program(_after_activation_layer, "after").make_loss, W, X,
        policy=jax.checkpoint_policies.save_any_names_but_these("mlp_pre"), target="cpu",
    )  # fmt: skip
    (g,) = [f for f in found if f.code == "save-removes-no-recompute"]
    assert "keeps mlp_act" in g.what
    assert "add it to the names save_any_names_but_these leaves out" in g.fix
    assert not [f for f in found if f.code in ("saved-anyway", "name-kept-nowhere")]


def _fused_kv_layer(x, w):  # K and V out of one matmul, as Gemma's kv einsum
    kv = x @ jnp.concatenate([w, w.T], axis=1)  # [b, s, 2D]
    k = checkpoint_name(kv[..., :D], "k_part")
    v = checkpoint_name(kv[..., D:], "v_part")
    scores = jax.nn.softmax(x @ k.swapaxes(-1, -2), axis=-1)
    return x + scores @ v


def test_names_that_spare_a_matmul_only_together_are_not_said_to_spare_none():
    """Saving K alone or V alone spares nothing (the matmul is recomputed for the other half);
    saving both spares it: judged within the policy, no save-removes-no-recompute for the pair,
    as in analyze's FLOPs (the outside Gemma trial, s18)."""
    program = _program(_fused_kv_layer, "fused-kv")
    pair, alone = doctor.check_policies(
        program, [{"k_part": "save", "v_part": "save"}, {"k_part": "save"}], target="cpu"
    )
    assert "save-removes-no-recompute" not in _codes(pair), [f.line() for f in pair]
    assert "save-removes-no-recompute" in _codes(alone)
    found = remat_kit.check_function(
        program.make_loss, W, X,
        policy=jax.checkpoint_policies.save_only_these_names("k_part", "v_part"), target="cpu",
    )  # fmt: skip
    assert "save-removes-no-recompute" not in _codes(found), [f.line() for f in found]
    # the FLOPs the judgement reads: the pair lowers them, either alone does not
    flops = {
        k: remat_kit.analyze_policies(program, [p], "cpu")[0].flops
        for k, p in {"none": "save-nothing", "k": {"k_part": "save"},
                     "kv": {"k_part": "save", "v_part": "save"}}.items()
    }  # fmt: skip
    assert flops["kv"] < flops["k"] == flops["none"]


def _fused_kv_attention(x, w):  # Gemma in flax's examples: one k/v projection, tagged key_proj
    q = checkpoint_name(x @ w, "query_proj")
    k, v = jnp.split(checkpoint_name(x @ jnp.concatenate([w, w.T], -1), "key_proj"), 2, -1)
    return x + checkpoint_name((jnp.tanh(q * k) * v) @ w.T, "out_proj")


def fused_kv_program():
    """``--model tests.test_doctor_programs:fused_kv_program``: emits key_proj, no value_proj."""
    return _program(_fused_kv_attention, "fused-kv")


def test_a_registered_policy_naming_a_tag_the_model_fuses_away_is_a_note(capsys):
    """The doctor exited 1 with unknown-tag for the registered minimal on a model that fuses k
    and v (it names value_proj); that is a note now, as analyze's. A user's own spec naming
    value_proj stays an error, and so does a registered policy naming none of its tags."""
    argv = ["doctor", "--model", "tests.test_doctor_programs:fused_kv_program", "--json"]
    assert cli.main([*argv, "--target", "cpu", "--policy", "minimal"]) == 0
    (note,) = __import__("json").loads(capsys.readouterr().out)["policies"]["minimal"]
    assert (note["severity"], note["code"]) == ("info", "tag-not-emitted")
    assert "mlpwo, value_proj, which the program does not emit" in note["what"]
    assert "runs as key_proj=save, out_proj=save, query_proj=save" in note["what"]
    own = Promise("custom", save=frozenset({"key_proj", "value_proj"}))
    registered = Promise("save-nothing-here", save=frozenset({"mlpwo"}), registered=True)
    facts = TagFacts(frozenset({"key_proj", "out_proj", "query_proj"}), user=True)
    for promise in (own, registered):
        (err,) = unknown_tags(promise, facts)
        assert (err.code, err.severity) == ("unknown-tag", "error")


def test_a_default_set_policy_that_keeps_everything_warns_and_never_fails_the_check():
    """A user's correct scanned MLP failed the doctor (exit 1): the default set's own spec
    saving every name it emits keeps everything no-remat keeps, a no-op-policy *error* on a
    policy the user never asked for. In the default set it warns; asked for, it is an error."""
    import jax.numpy as jnp
    import optax
    from jax.ad_checkpoint import checkpoint_name

    from remat_kit.doctor import check_policies

    def make_loss(policy):
        def layer(x, w):
            h = checkpoint_name(jax.nn.relu(checkpoint_name(x @ w[0], "hidden")), "act")
            return x + h @ w[1], None

        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

        def loss(params, x):
            return jax.lax.scan(layer, x, (params["w1"], params["w2"]))[0].sum()

        return loss

    params = {"w1": jnp.ones((3, 16, 32)) * 0.1, "w2": jnp.ones((3, 32, 16)) * 0.1}
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    program = remat_kit.Program.from_loss(make_loss, params, x, optimizer=optax.sgd(0.1))
    every = "act=save,hidden=save"
    default = check_policies(program)
    noop = [f for c in default.checks for f in c.findings if f.code == "no-op-policy"]
    assert noop and all(f.severity == "warning" for f in noop), noop
    assert "not one you asked for" in noop[0].fix and not default.has_errors
    asked = check_policies(program, [every])
    assert [f.severity for c in asked.checks for f in c.findings if f.code == "no-op-policy"] == [
        "error"
    ]
