"""One program path (issue 26): a preset is a Program and gets what a program gets; one trace
of a program's loss per policy is what every tool walks and compiles; the judgements one tool
makes, every tool makes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from measured import (
    run_program_sweep,  # experiments/ on sys.path: tests/conftest.py
    summary,
)

import remat_kit
from remat_kit import doctor
from remat_kit.memory.api import analyze_policies
from remat_kit.program import Program
from remat_kit.recommend import recommend
from tests.conftest import needs_cuda_plugin

CPU_CAUSE = "XLA:CPU honours remat only inside lax.scan"
L, D = 4, 16


def _layer(x, w):
    return jnp.tanh(checkpoint_name(x @ w, "hidden"))


def _scanned(layer):
    def loss(ws, x):
        def body(h, w):
            return layer(h, w), None

        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h**2)

    return loss


def _args():
    ws = jax.random.normal(jax.random.key(0), (L, D, D)) / D**0.5
    return ws, jax.random.normal(jax.random.key(1), (8, D))


def test_a_preset_gets_the_cse_undone_warning_a_program_gets():
    """A preset whose layers are not scanned, under one remat segment, on XLA:CPU: it frees
    little, and the preset's row says so with the cause its remat regions' placement gives, as
    a user's program's row does (the preset path used not to know where they were): jax
    0.10.2's XLA:CPU undoes remat outside a scan; 0.12's keeps it, the one segment recomputed
    in one piece."""
    from remat_kit.memory.undone import LONE_SEGMENT_CAUSE, cpu_undoes_remat_outside_scan

    config = remat_kit.get_config("tiny-gpt", num_layers=2, scan_layers=False, remat_group_size=2)
    program = remat_kit.preset(config, 1, 16)
    none, nothing = analyze_policies(program, ["no-remat", "save-nothing"], "cpu", top_k=0)
    undone = cpu_undoes_remat_outside_scan("cpu")
    said = [w for w in nothing.warnings if (CPU_CAUSE if undone else LONE_SEGMENT_CAUSE) in w]
    assert said and (not undone or "outside any scan" in said[0]), nothing.warnings
    assert not any(CPU_CAUSE in w or LONE_SEGMENT_CAUSE in w for w in none.warnings)


def _tanh_residuals() -> set[str]:
    """The residual tags of tanh's gradient in the installed jax, as ``<primitive>``:
    ``{"<tanh>", "<sub>"}`` under jax 0.10.2, ``{"<one_minus_square>"}`` under jax 0.12."""
    jaxpr = jax.make_jaxpr(lambda x: jax.vjp(jnp.tanh, x))(jnp.ones(3)).jaxpr
    made = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    return {f"<{made[v]}>" for v in jaxpr.outvars[1:]}  # [0] is tanh's output


def test_walk_and_compile_one_trace_of_a_factory_that_changes_state():
    """A factory that swaps the layer in at module level (how remat is added to a model with
    no hook for it) and reads it when traced: each policy's compiled step, FLOPs and residual
    table come from the one trace of that policy's loss, whatever the factory was asked since;
    the factory is called once per policy however many tools ask."""
    swapped = {"layer": _layer}
    calls = []

    def make_loss(policy):
        calls.append(policy)
        swapped["layer"] = _layer if policy is None else jax.checkpoint(_layer, policy=policy)
        return _scanned(lambda h, w: swapped["layer"](h, w))

    program = Program.from_loss(make_loss, *_args(), optimizer="sgd", name="swapped")
    calls.clear()
    none, nothing = analyze_policies(program, ["no-remat", "save-nothing"], "cpu", top_k=0)
    # no-remat compiled without remat although save-nothing's factory call came last
    assert none.recompute_ratio == pytest.approx(1.0)
    assert nothing.recompute_ratio > 1.0
    assert none.activation_bytes > nothing.activation_bytes
    tanh_kept = _tanh_residuals()  # kept without remat, recomputed under save-nothing
    assert tanh_kept <= {r.tag for r in none.residuals if r.nbytes}
    assert not tanh_kept & {r.tag for r in nothing.residuals if r.nbytes}
    traced = len(calls)
    doctor.check_policies(program, ["save-nothing"], "cpu")
    assert all(c is None or c.__name__ == "probe" for c in calls[traced:]), calls[traced:]


def _always_remat(policy):
    """A factory that remats its layers even when given None: its no-remat is not one."""
    body = jax.checkpoint(_layer, policy=policy) if policy is not None else jax.checkpoint(_layer)
    return _scanned(body)


@needs_cuda_plugin
def test_a_rematerialised_baseline_is_said_and_no_ratio_is_reported_against_it(tmp_path):
    program = Program.from_loss(_always_remat, *_args(), optimizer="sgd", name="always")
    reports = analyze_policies(program, ["no-remat", "save-nothing"], "cpu", top_k=0)
    assert "not a no-remat baseline" in reports[0].warnings[0]
    assert all(r.recompute_ratio is None for r in reports), [r.recompute_ratio for r in reports]
    assert any("no recompute ratio" in w for w in reports[1].warnings)
    checked = doctor.check_policies(program, ["save-nothing"], "cpu")
    assert any("not a no-remat baseline" in n for n in checked.notes)
    rec = recommend(program, target="h100-sxm", policies=["no-remat", "save-nothing"])
    assert all(c.flops_no_remat is None for c in rec.candidates)
    run = run_program_sweep(
        program, tmp_path / "rows.jsonl", policies=["save-nothing"], warmup_steps=0,
        timed_steps=1, progress=False,
    )  # fmt: skip
    assert run.rows[0]["recompute_ratio"] is None


@needs_cuda_plugin
def test_a_policy_naming_absent_tags_is_judged_the_same_by_every_tool(tmp_path):
    """``save-qkv-proj`` on a program that emits none of its names: analyze's default set
    leaves it out with a note, the doctor (asked for it) says unknown-tag, recommend leaves it
    out with the same note, and the sweep's default set does not run it."""
    program = Program.from_loss(lambda p: _scanned(
        _layer if p is None else jax.checkpoint(_layer, policy=p)), *_args(), optimizer="sgd",
        name="own-names")  # fmt: skip
    chosen = remat_kit.memory.policy_set(program, "cpu")
    assert "save-qkv-proj" not in {s.name for s in chosen.specs}
    note = next(n for n in chosen.notes if "save-qkv-proj" in n)
    (findings,) = doctor.check_policies(program, ["save-qkv-proj"], "cpu")
    assert [f.code for f in findings] == ["unknown-tag"]
    rec = recommend(program, target="h100-sxm")
    assert "save-qkv-proj" not in {c.policy for c in rec.candidates}
    assert note in rec.notes
    run = run_program_sweep(
        program, tmp_path / "rows.jsonl", warmup_steps=0, timed_steps=1, progress=False
    )
    assert "save-qkv-proj" not in {r["policy"] for r in run.rows}


@needs_cuda_plugin
def test_recommend_compiles_the_set_analyze_compiles_on_a_program(tmp_path):
    """By default recommend considers what analyze compiles on a user's program, specs in its
    own tag names included (it compared the registered policies only: at a budget only
    ``attn_out=save`` met, it said nothing fits while analyze had compiled that spec fitting),
    under the labels analyze prints."""
    program = Program.from_loss(lambda p: _scanned(
        _half_maxtext if p is None else jax.checkpoint(_half_maxtext, policy=p)), *_args(),
        optimizer="sgd", name="half-maxtext")  # fmt: skip
    chosen = remat_kit.memory.policy_set(program, "h100-sxm")
    own = [label for label in chosen.labels() if label.startswith("custom: ")]
    assert "custom: mlpwi=save" in own, own  # query_proj is not kept: tanh' reads tanh's output
    rec = recommend(program, target="h100-sxm", structure=False)
    named = [c.label for c in rec.candidates if c.found_by in ("named", "per-tag")]
    assert sorted(named) == sorted(chosen.labels())
    given = recommend(program, target="h100-sxm", policies=[{"query_proj": "offload"}])
    assert [c.label for c in given.candidates] == ["custom: query_proj=offload"]
    local = remat_kit.memory.policy_set(program, "local")
    run = run_program_sweep(
        program, tmp_path / "rows.jsonl", warmup_steps=0, timed_steps=1, progress=False
    )
    assert [r["policy_label"] for r in run.rows] == local.labels()  # the sweep's rows too


def _half_maxtext(x, w):  # two of MaxText's names, not all a registered policy names
    q = checkpoint_name(x @ w, "query_proj")
    return jnp.tanh(checkpoint_name(jnp.tanh(q) @ w.T, "mlpwi"))


def test_a_cut_down_policy_has_one_label_in_every_tool(tmp_path):
    """By default every tool compiles ``minimal`` cut down to the names a program emits when
    it emits only some of them; analyze, the doctor, recommend and the sweep's table all call
    that row ``minimal (cut)`` (recommend called it ``custom: save mlpwi,query_proj``, the
    sweep ``mlpwi=save,query_proj=save``, which stays the row's key)."""
    program = Program.from_loss(lambda p: _scanned(
        _half_maxtext if p is None else jax.checkpoint(_half_maxtext, policy=p)), *_args(),
        optimizer="sgd", name="half-maxtext")  # fmt: skip
    analyzed = remat_kit.memory.policy_set(program, "cpu").labels()
    checked = [c.label for c in doctor.check_policies(program, target="cpu").checks]
    rec = recommend(program, target="cpu", budget="1GiB")
    recommended = [c.label for c in rec.candidates]
    for labels in (analyzed, checked, recommended):
        assert "minimal (cut)" in labels, labels
        assert not any(label.startswith("custom: save") for label in labels), labels
    (cut,) = [c for c in rec.candidates if c.label == "minimal (cut)"]
    assert cut.actions == {"mlpwi": "save", "query_proj": "save"} and cut.found_by == "named"
    run = run_program_sweep(
        program, tmp_path / "rows.jsonl", policies=["save-nothing", "minimal"], warmup_steps=0,
        timed_steps=1, progress=False,
    )  # fmt: skip
    (row,) = [r for r in run.rows if r["policy_label"] == "minimal (cut)"]
    assert row["policy"] == "mlpwi=save,query_proj=save"
    (table,) = summary.summary_lines(run.rows)
    assert [line[0] for line in table[2]] == ["save-nothing", "minimal (cut)"]


def test_a_raw_jax_policy_is_read_the_same_way_by_every_tool():
    """A ``jax.checkpoint_policies`` policy built from name sets is data: analyze and the doctor
    take it on a program as the function path does; one that cannot be read is one line
    naming what to give instead (the function path judges it by what it does)."""
    program = Program.from_loss(lambda p: _scanned(
        _layer if p is None else jax.checkpoint(_layer, policy=p)), *_args(), optimizer="sgd",
        name="raw")  # fmt: skip
    names = jax.checkpoint_policies.save_only_these_names("hidden")
    spec = remat_kit.get_policy_spec(names)
    assert (spec.name, spec.save) == ("save_only_these_names(hidden)", frozenset({"hidden"}))
    # named with its names (s19 Equinox trial: two name sets were both 'save_only_these_names')
    both = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["b", "a"], names_which_can_be_offloaded=["c"],
        offload_src="device", offload_dst="pinned_host",
    )  # fmt: skip
    assert remat_kit.get_policy_spec(both).name == (
        "save_and_offload_only_these_names(save: a, b; offload: c)"
    )
    assert remat_kit.get_policy_spec(jax.checkpoint_policies.dots_saveable).base == "dots"
    none, saved, custom = analyze_policies(
        program, ["no-remat", names, {"hidden": "save"}], "cpu", top_k=0
    )
    assert saved.program_sha256 == custom.program_sha256
    assert saved.activation_bytes == custom.activation_bytes
    findings, as_mapping = doctor.check_policies(program, [names, {"hidden": "save"}], "cpu")
    assert [(f.code, f.severity) for f in findings] == [(f.code, f.severity) for f in as_mapping]
    # saving hidden frees tanh's residuals: two arrays under jax 0.10.2 (tanh and 1 - tanh),
    # one under jax 0.12 (one_minus_square), as many bytes as hidden: then it is a no-op
    errors = [f.code for f in findings if f.severity == "error"]
    frees = saved.activation_bytes < none.activation_bytes
    assert errors == ([] if frees else ["no-op-policy"]), [f.line() for f in findings]
    composed = jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, names
    )
    for run in (
        lambda: analyze_policies(program, [composed], "cpu"),
        lambda: doctor.check_policies(program, [composed], "cpu"),
    ):
        with pytest.raises(ValueError, match="cannot read as data") as err:
            run()
        assert "\n" not in str(err.value)


def _two_names_layer(x, w):
    h = checkpoint_name(x @ w, "hidden")
    return checkpoint_name(jnp.tanh(h) @ w.T, "proj")


def test_save_any_names_but_these_is_read_against_the_program_by_every_tool():
    """The doctor's function path judged ``save_any_names_but_these`` as the name set it
    amounts to; the program path (analyze, recommend, the sweep, the doctor on a Program)
    refused it as "a callable remat-kit cannot read". On a program it is now that name set for
    every tool; with no program to read names from it is one line saying what to give."""
    from remat_kit.policies import policies_for_tags

    cp = jax.checkpoint_policies
    program = Program.from_loss(lambda p: _scanned(
        _two_names_layer if p is None else jax.checkpoint(_two_names_layer, policy=p)),
        *_args(), optimizer="sgd", name="two-names")  # fmt: skip
    tags = remat_kit.program_tags(program)
    assert tags == {"hidden", "proj"}
    but_hidden = cp.save_any_names_but_these("hidden")
    spec = remat_kit.get_policy_spec(but_hidden, tags)
    assert (spec.name, spec.save) == ("save_any_names_but_these(hidden)", frozenset({"proj"}))
    assert policies_for_tags([but_hidden], tags).specs == (spec,)  # recommend's and the sweep's
    by_exclusion, as_names = analyze_policies(program, [but_hidden, {"proj": "save"}], "cpu")
    assert by_exclusion.program_sha256 == as_names.program_sha256
    assert by_exclusion.policy == "save_any_names_but_these(hidden)"
    # the doctor on the program: the typo the function path reports, and no refusal
    (typo,) = doctor.check_policies(program, [cp.save_any_names_but_these("hiden")], "cpu")
    (found,) = [f for f in typo if "leaves out 'hiden' (closest: 'hidden')" in f.what]
    assert found.fix == "use 'hidden' for 'hiden' in save_any_names_but_these(...)."
    with pytest.raises(ValueError, match="give it with a program") as err:
        remat_kit.get_policy_spec(but_hidden)
    assert "\n" not in str(err.value)
    # the program itself where its names are asked for (s20 user trial: a bare TypeError)
    with pytest.raises(ValueError, match=r"remat_kit.program_tags\(program\)\), got Program"):
        remat_kit.get_policy_spec(but_hidden, program)
    assert remat_kit.get_policy_spec(but_hidden, remat_kit.program_tags(program)) == spec


def test_a_program_file_imports_its_sibling_modules(tmp_path, monkeypatch):
    """``FILE.py:FACTORY`` whose file imports a module beside it, and ``MODULE:FACTORY`` run
    from the module's folder, load as Python runs them (no traceback)."""
    import sys

    (tmp_path / "sibling_model.py").write_text(
        "from remat_kit.examples.plain_jax import program as make\n\n\ndef program():\n"
        "    return make()\n"
    )
    (tmp_path / "entry.py").write_text("from sibling_model import program  # noqa: F401\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "sibling_model", raising=False)
    assert remat_kit.load_program(f"{tmp_path / 'entry.py'}:program").name
    monkeypatch.chdir(tmp_path)
    assert remat_kit.load_program("sibling_model:program").name


def _unrolled(policy, prevent_cse=True):
    """_layer four times in a Python loop, each a jax.checkpoint (with ``prevent_cse``) when
    given a policy."""
    layer = _layer if policy is None else jax.checkpoint(_layer, policy=policy,
                                                         prevent_cse=prevent_cse)  # fmt: skip

    def loss(ws, x):
        h = x
        for i in range(ws.shape[0]):
            h = layer(h, ws[i])
        return jnp.mean(h**2)

    return loss


def test_the_cpu_cse_fix_never_asks_for_the_prevent_cse_the_program_has():
    """On jax 0.10.2's XLA:CPU remat outside a scan is undone whatever prevent_cse is: the
    doctor's fix says to scan (it said 'keep prevent_cse=True' to a model that had it, as an
    outside trial's ViT did). jax 0.12's XLA:CPU keeps it with prevent_cse=True (no finding
    asks for it) and undoes it with prevent_cse=False (the fix asks for prevent_cse=True)."""
    from remat_kit.memory.undone import cpu_undoes_remat_outside_scan

    def cse_findings(prevent_cse):
        program = Program.from_loss(lambda p: _unrolled(p, prevent_cse), *_args(),
                                    optimizer="sgd", name="unrolled")  # fmt: skip
        (check,) = doctor.check_policies(program, ["save-nothing"], "cpu").checks
        return check.findings, [f for f in check.findings if f.code == "cse-undid-remat"]

    kept, undone = cse_findings(prevent_cse=True)
    if cpu_undoes_remat_outside_scan("cpu"):
        (finding,) = undone
        assert "prevent_cse=True" not in finding.fix.replace("whatever prevent_cse is", "")
        assert "lax.scan" in finding.fix
    else:
        assert not undone and not any("prevent_cse=True" in f.fix for f in kept), kept
    _, (finding,) = cse_findings(prevent_cse=False)  # undone on either XLA:CPU
    assert "lax.scan" in finding.fix
    if not cpu_undoes_remat_outside_scan("cpu"):
        assert "keep prevent_cse=True" in finding.fix
