"""``analyze`` on a user's own program (tests/user_models/plain_jax.py, tags attn_in, attn_out,
mlp_hidden): the default policy set acts on its own tags, policies that act the same compile
once and are reported as the same program, the offload comparison only where an emitted tag is
offloaded, residuals by its tags in the text output, XLA's remat said once, a short repr."""

import argparse
import contextlib
import dataclasses
import io
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import remat_kit
from remat_kit import Program, targets
from remat_kit.cli import analyze as cli_analyze
from remat_kit.cli import main as cli_main
from remat_kit.memory import runner
from remat_kit.memory.api import analyze_policies
from remat_kit.memory.hlo import DumpFiles
from remat_kit.memory.host_buffers import HostBuffers, host_buffers, host_line
from remat_kit.memory.policy_set import policy_set
from remat_kit.memory.reading import XLA_REMAT_LIMIT_NOTE
from remat_kit.memory.report import same_program_as
from remat_kit.memory.undone import cpu_undoes_remat_outside_scan, undone_cause
from remat_kit.policies import get_policy_spec, policy_label
from remat_kit.units import MIB, in_unit
from remat_kit.walker import RematPlacement, remat_placement
from tests.conftest import needs_cuda_plugin
from tests.user_models import plain_jax

REF = "tests/user_models/plain_jax.py:program"
SKIPPED = ("save-layer-inputs", "save-qkv-proj", "save-out-proj", "save-qkv-out-proj",
           "save-dots-except-mlp", "minimal", "offload-to-host", "offload-layer-inputs",
           "offload-qkv-proj")  # fmt: skip


@contextlib.contextmanager
def counting_compiles():
    """Yields the list of compiles the engine runs meanwhile (one per distinct program)."""
    seen = []
    real = runner.compile_with_dump

    def counting(lowered, platform, what, *args, **kwargs):
        seen.append(what)
        return real(lowered, platform, what, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "compile_with_dump", counting)
        yield seen


def test_default_set_acts_on_the_programs_own_tags():
    program = plain_jax.program()
    chosen = policy_set(program, "h100-sxm")
    assert chosen.tags == frozenset(plain_jax.TAGS)
    assert [policy_label(s) for s in chosen.specs] == [
        "no-remat", "save-nothing", "save-dots", "save-dots-no-batch",
        "custom: attn_in=save", "custom: attn_out=save", "custom: mlp_hidden=save",
        "custom: attn_in=save, attn_out=save, mlp_hidden=save",
        "custom: attn_in=offload, attn_out=offload, mlp_hidden=offload",
    ]  # fmt: skip
    skipped = [n for n in chosen.notes if n.startswith("not compiled on")]
    assert len(skipped) == 1 and all(name in skipped[0] for name in SKIPPED)
    # No host offload on the CPU: no offloading spec; two single-tag specs at most, for the
    # largest residuals (mlp_hidden [b, s, F] and attn_in [b, s, 3D], not attn_out [b, s, D]):
    # said.
    cpu = policy_set(program, "cpu", max_single=2)
    assert not any(s.offloads for s in cpu.specs)
    assert any("does not offload" in n for n in cpu.notes)
    assert [policy_label(s) for s in cpu.specs[4:6]] == ["custom: attn_in=save",
                                                        "custom: mlp_hidden=save"]  # fmt: skip
    assert any("2 with the largest residuals only" in n and "for attn_out" in n
               for n in cpu.notes)  # fmt: skip
    # Asked policies are kept as asked.
    assert policy_set(program, "cpu", ["minimal"]).specs == (get_policy_spec("minimal"),)


def test_a_cut_down_offload_dropped_on_the_cpu_is_not_said_compiled():
    """Where the target does not offload, a registered offload policy cut down to the program's
    tags is said not compiled, and never also "compiled as" (a user trial read both)."""

    def make_loss(policy):
        def layer(h, w):
            k = checkpoint_name(h @ w, "key_proj")
            return jnp.tanh(checkpoint_name(k @ w, "mlpwi")), None

        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return lambda w, x: jax.lax.scan(body, x, w)[0].sum()

    program = Program.from_loss(make_loss, jnp.ones((2, 16, 16)), jnp.ones((4, 16)), name="toy")
    for policies in (None, ["offload-to-host", "save-nothing"]):
        local = " ".join(policy_set(program, "local", policies, fit=True).notes)
        assert "offload-to-host names" not in local and "offload" in local
        gpu = " ".join(policy_set(program, "h100-sxm", policies, fit=True).notes)
        assert "offload-to-host names mlpwo" in gpu and "compiled as key_proj=offload" in gpu


def test_a_program_without_tags_gets_the_kind_based_policies_and_a_note():
    def make_loss(policy):
        body = (lambda w, x: jnp.tanh(x @ w)) if policy is None else jax.checkpoint(
            lambda w, x: jnp.tanh(x @ w), policy=policy)  # fmt: skip
        return lambda w, x: body(w, x).sum()

    program = Program.from_loss(make_loss, jnp.ones((4, 4)), jnp.ones((2, 4)), name="untagged")
    chosen = policy_set(program, "h100-sxm")
    assert [s.name for s in chosen.specs] == [
        "no-remat",
        "save-nothing",
        "save-dots",
        "save-dots-no-batch",
    ]
    assert any("emits no checkpoint_name tags" in n for n in chosen.notes)


def test_specs_equal_on_the_emitted_tags_lower_to_one_program(fresh_compile_cache):
    """The ground for compiling them once: the same StableHLO text."""
    program = plain_jax.program()

    def text(name):
        pure = program.step(get_policy_spec(name))
        return jax.jit(pure.fn).lower(*pure.args).as_text()

    assert text("minimal") == text("save-nothing") == text("offload-to-host")


@pytest.fixture(scope="module")
def default_run():
    program = plain_jax.program()
    chosen = policy_set(program, "h100-sxm")
    with counting_compiles() as compiled:
        results = remat_kit.analyze_policies(program, target="h100-sxm", top_k=0)
    return program, chosen, results, compiled


@needs_cuda_plugin
def test_default_analyze_compiles_each_distinct_program_once(default_run):
    _, chosen, results, compiled = default_run
    assert [r.policy for r in results] == [policy_label(s) for s in chosen.specs]
    # 9 programs; the offloading one's on-device twin is the every-name=save one: no compile.
    assert len(compiled) == 9, compiled
    assert len({r.program_sha256 for r in results}) == len(results) == 9
    assert same_program_as(results) == [None] * 9
    offloaders = [r for r in results if r.peak_bytes_without_offload is not None]
    assert [r.host_bytes > 0 for r in offloaders] == [True]


@needs_cuda_plugin
def test_text_output_of_a_program_at_80_columns(default_run, monkeypatch, capsys):
    program, chosen, results, _ = default_run
    monkeypatch.setenv("COLUMNS", "80")
    args = argparse.Namespace(budget=None, buffers=0)
    cli_analyze.print_reports(program, targets.get_target("h100-sxm"), args, results, [],
                              chosen.specs, chosen)  # fmt: skip
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "same program" not in out and out.count("not compiled on") == 1
    assert "runs as save-nothing" not in out
    assert out.count("offloading lowers") + out.count("offloading does not") == 1
    # Residuals by the program's own tags, in the text: the mlp_hidden=save row keeps
    # mlp_hidden (float32 [batch, seq, d_ff] per layer) on device, the offload row on host.
    table = out[out.index("residuals by checkpoint name") :]
    assert "bytes in MiB" in table
    for header in (*plain_jax.TAGS, "untagged"):
        assert header in table
    own = results[6]
    kept = sum(t.nbytes for t in own.residuals if t.tag == "mlp_hidden")
    assert kept == plain_jax.L * 2 * 32 * plain_jax.F * 4
    row = next(line for line in table.splitlines() if "custom: mlp_hidden=save" in line)
    untagged = sum(t.nbytes for t in own.residuals if t.tag not in plain_jax.TAGS)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells == ["custom: mlp_hidden=save", "-", "-", in_unit(kept, MIB, 2),
                     in_unit(untagged, MIB, 2)]  # fmt: skip
    assert "host" in next(line for line in table.splitlines() if "every name=offload" in line)


def test_cli_program_with_asked_policies_json(capsys):
    argv = ["analyze", "--model", REF, "--policy", "save-nothing", "--policy", "minimal",
            "--target", "cpu", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    nothing, minimal = out["reports"]
    assert out["checkpoint_names"] == sorted(plain_jax.TAGS) and out["notes"] == []
    assert minimal["program_sha256"] == nothing["program_sha256"] is not None
    assert minimal["policy"] == "minimal" and out["labels"] == ["save-nothing", "minimal"]


def _small_h100(memory: int) -> targets.Target:
    """The H100 model with ``memory`` bytes; one name for every size, so a size compiled by one
    test is read from the run's compile cache by the next (the name is in the cache's key)."""
    return dataclasses.replace(
        targets.get_target("h100-sxm"), name="h100-small", memory_bytes=memory
    )


@needs_cuda_plugin
def test_xla_remat_said_once():
    """A 3 MB H100: XLA's own remat pass fires; one sentence says what it recomputed (with the
    policy's own figures), not two."""
    small = _small_h100(3_000_000)
    r, again = (
        remat_kit.analyze_policies(plain_jax.program(), ["no-remat"], target=small, top_k=0)[0]
        for _ in range(2)
    )
    assert r.policy_only is not None
    said = [w for w in r.warnings if "instruction" in w and "recomputed" in w]
    assert len(said) == 1 and said[0].startswith("XLA's remat pass recomputed"), r.warnings
    # The repeat reads the compile and XLA's log lines from the cache.
    assert again.compile_cached and again == dataclasses.replace(r, compile_cached=True)
    assert any("Can't reduce memory use" in w for w in again.warnings), again.warnings


@needs_cuda_plugin
def test_xla_remat_limit_is_said_not_to_be_the_device_memory():
    """XLA's "Can't reduce memory use below X" comes with the note that X is XLA's own target,
    about 76% of the device's memory (80% x the 95% slop factor), not the memory itself: one
    MB more device memory moves X by 760,000 bytes."""
    limits = []
    for memory in (3_000_000, 4_000_000):  # 3 MB: test_xla_remat_said_once's compile
        small = _small_h100(memory)
        (r,) = remat_kit.analyze_policies(plain_jax.program(), ["no-remat"], target=small, top_k=0)
        (said,) = [w for w in r.warnings if "Can't reduce memory use below" in w]
        assert said.endswith(XLA_REMAT_LIMIT_NOTE)
        limits.append(int(re.search(r"below \S+ \((\d+) bytes\)", said).group(1)))
    assert abs((limits[1] - limits[0]) - 760_000) <= 100, limits


def test_program_repr_is_short():
    text = repr(plain_jax.program())
    assert len(text) < 200, text
    assert text.startswith("Program('plain-jax'") and "tokens: int32[2, 33]" in text
    assert "params: (6 arrays float32" in text and "donate_argnums=(0, 1)" in text
    assert "loss=yes" in text and "ShapeDtypeStruct" not in text


@needs_cuda_plugin
def test_residual_table_splits_many_tags_to_fit_80_columns(default_run):
    """Seven tags and untagged: two tables of four columns, each within 80 columns."""
    from rich.console import Console

    from remat_kit.walker import TagResiduals

    tags = frozenset(f"tag_number_{i}" for i in range(7))
    rows = tuple(TagResiduals(t, 1, (4, 1024), "float32", "device", (i + 1) * 2**20)
                 for i, t in enumerate(sorted(tags)))  # fmt: skip
    report = dataclasses.replace(default_run[2][0], residuals=rows)
    tables = cli_analyze.residual_tag_tables([report], ["mine"], tags)
    assert [len(t.columns) for t in tables] == [5, 5]  # policy + 4 columns each
    console = Console(width=80, record=True, file=io.StringIO())
    for t in tables:
        console.print(t)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "tag_number_6" in text and "7.00" in text and "(2/2)" in text


def _user_loop(scan: bool, prevent_cse: bool = True):
    """plain_jax's layers under jax.checkpoint in a Python loop, or in lax.scan; concrete
    parameters (the user's own arrays)."""

    make_loss = plain_jax.loop_loss(scan, prevent_cse)
    params = plain_jax.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, plain_jax.V)
    return Program.from_loss(make_loss, params, tokens, name=f"loop-scan-{scan}")


CPU_CAUSE = "XLA:CPU honours remat only inside lax.scan"


def test_remat_undone_on_the_cpu_outside_a_scan_is_said_with_its_cause():
    """A remat in an unrolled loop on XLA:CPU: every policy keeps the no-remat memory; each
    policy's warning names the CPU (not prevent_cse, which is True here) and the policy by its
    label; the same layers under lax.scan get no such warning."""
    policies = ["no-remat", "save-nothing", {"attn_in": "save"}]
    loop = analyze_policies(_user_loop(scan=False), policies, "local")
    if not cpu_undoes_remat_outside_scan("cpu"):
        # jax 0.12's XLA:CPU keeps remat outside a scan (prevent_cse=True): nothing undone
        assert loop[1].temp_bytes < 0.8 * loop[0].temp_bytes
        for r in loop:
            assert not any(CPU_CAUSE in w or "merged" in w for w in r.warnings), r.warnings
        return
    assert loop[1].temp_bytes >= 0.95 * loop[0].temp_bytes  # the remat was undone
    for r in loop[1:]:
        said = [w for w in r.warnings if CPU_CAUSE in w]
        assert said and "outside any scan" in said[0], r.warnings
        assert not any("prevent_cse=False" in w for w in r.warnings), r.warnings
    assert any("'custom: attn_in=save'" in w for w in loop[2].warnings), loop[2].warnings
    assert not any("'custom'" in w for w in loop[2].warnings)
    # the command line says the cause the two policies' warnings share once, after them
    lines = cli_analyze._warning_lines(loop, ["no-remat", "save-nothing", "custom: attn_in"])
    assert sum(CPU_CAUSE in line for line in lines) == 1, lines
    assert lines[-1].startswith("cause 1: ") and CPU_CAUSE in lines[-1]
    assert sum(line.count("[cause 1]") for line in lines[:-1]) == 2
    scanned = analyze_policies(_user_loop(scan=True), policies, "local")
    assert scanned[1].temp_bytes < 0.8 * scanned[0].temp_bytes  # honoured inside the scan
    for r in scanned:
        assert not any("undid" in w or "merged" in w for w in r.warnings), r.warnings


def test_the_peak_is_said_to_be_set_by_the_buffers_live_at_it():
    """A policy that recomputes yet frees no memory on a GPU target: the warning said "the peak
    is set outside the rematerialised layers (the optimizer update, the logits, the
    parameters)" of a program with none of these (SGD, no head; jax#19822, s19 bug trial),
    whose peak was forward matmul outputs. It now names the largest group of buffers live at
    the peak, by kind and phase."""
    from types import SimpleNamespace as NS

    from remat_kit.memory.report import PeakBuffer
    from remat_kit.memory.undone import peak_set_by

    def buf(value, nbytes, kind, phase, memory="device"):
        return PeakBuffer(value, nbytes, "f32[8,128,128]", kind, phase, "jvp()/dot_general", memory)

    mib = 2**20
    forward = [buf(f"gemm_fusion_dot.{i}", mib // 2, "other", "forward") for i in range(6)]
    args = [buf("p", mib, "params", "argument"), buf("h", 9 * mib, "other", "forward", "host")]
    line = peak_set_by(NS(peak_buffers=tuple(forward + args)))
    assert line.startswith("the peak is set by untagged values of the forward pass: 6 of the 7")
    assert "(3.00 MiB; gemm_fusion_dot.0 f32[8,128,128], jvp()/dot_general)" in line
    assert "outside" not in line  # a host buffer is not what the device peak holds
    opt = [buf("adam_mu", 4 * mib, "opt_state", "argument"), *forward[:2]]
    line = peak_set_by(NS(peak_buffers=tuple(opt)))
    assert line.startswith("the peak is set by the optimizer state, outside the rematerialised")
    assert "query_proj of the backward pass" in peak_set_by(
        NS(peak_buffers=(buf("f", mib, "query_proj", "backward"),))
    )


def test_memory_not_freed_says_how_far_the_temp_memory_dropped():
    """The warning for a policy whose compiled temp memory drops by under a tenth of the
    residual bytes its jaxpr frees says by how much it dropped: it never says the memory did
    not go down when it did (a user read 6.22 MiB against 6.95 MiB as a contradiction)."""
    from types import SimpleNamespace as NS

    from remat_kit.memory.undone import memory_not_freed

    job = NS(label="minimal", policy="minimal", target=NS(platform="cpu"), remat=None)
    base = NS(activation_bytes=20 * 2**20, temp_bytes=int(6.95 * 2**20), host_bytes=0)
    fell = NS(activation_bytes=2**20, temp_bytes=int(6.22 * 2**20), host_bytes=0)
    line = memory_not_freed(job, fell, base)
    assert "19.00 MiB fewer" in line and "drops by 747.52 KiB" in line and "undid most of" in line
    rose = NS(activation_bytes=2**20, temp_bytes=7 * 2**20, host_bytes=0)
    line = memory_not_freed(job, rose, base)
    assert "rises by 51.20 KiB (6.95 MiB -> 7.00 MiB)" in line and "undid the remat" in line
    same = NS(activation_bytes=2**20, temp_bytes=int(6.95 * 2**20), host_bytes=0)
    assert "does not drop (6.95 MiB against 6.95 MiB)" in memory_not_freed(job, same, base)
    kept = NS(activation_bytes=2**20, temp_bytes=2**20, host_bytes=0)  # freed as promised
    assert memory_not_freed(job, kept, base) is None
    # It recomputes (1.21x the FLOPs): the remat stands, the peak is elsewhere (the doctor's
    # remat-not-lowering-peak); "XLA undid the remat" contradicted the recompute column.
    # The ratio is the policy's own: on a small device XLA's own remat inflates no-remat's
    # compiled FLOPs too (x1.39 against x1.70: "1.22x" was printed beside a 1.23x column).
    flops = NS(**{**vars(base), "flops": 139.0, "recompute_ratio": 1.0})
    gpu = NS(**{**vars(job), "target": NS(platform="cuda")})
    line = memory_not_freed(
        gpu, NS(**{**vars(rose), "flops": 170.0, "recompute_ratio": 1.23}), flops
    )
    assert "though it recomputes (1.23x the matmul FLOPs)" in line and "undid" not in line
    assert "the peak is probably set outside the rematerialised layers" in line  # not read
    same_flops = NS(**{**vars(rose), "flops": 139.0, "recompute_ratio": 1.0})
    assert "XLA undid the remat" in memory_not_freed(gpu, same_flops, flops)
    # On the CPU a step that recomputes (1.31x) without freeing memory did not undo the remat:
    # it pays both (the outside Gemma trial, s18: 99 -> 131 matmuls, temp unchanged); where
    # XLA:CPU keeps remat outside a scan (jax 0.12's) it is said as on a GPU
    line = memory_not_freed(job, NS(**{**vars(rose), "flops": 182.0, "recompute_ratio": 1.31}),
                            flops)  # fmt: skip
    assert "undid" not in line and "though it recomputes (1.31x the matmul FLOPs)" in line
    if cpu_undoes_remat_outside_scan("cpu"):
        assert "XLA keeps the forward values" in line and "Cause: " in line
    else:
        assert line == memory_not_freed(
            gpu, NS(**{**vars(rose), "flops": 182.0, "recompute_ratio": 1.31}), flops
        )
    # On a TPU the memory beside the arguments is the peak less them (XLA:TPU's temp figure
    # is not: 17.23 MiB of temp was quoted beside a 6.59 MiB peak on v5e-8).
    tpu = NS(**{**vars(job), "target": NS(platform="tpu")})
    mib = 2**20
    base_tpu = NS(activation_bytes=20 * mib, temp_bytes=17 * mib, peak_bytes=6 * mib,
                  argument_bytes=3 * mib, host_bytes=0)  # fmt: skip
    same = NS(activation_bytes=mib, temp_bytes=18 * mib, peak_bytes=6 * mib + mib // 8,
              argument_bytes=3 * mib, host_bytes=0)  # fmt: skip
    line = memory_not_freed(tpu, same, base_tpu)
    assert "peak less its arguments rises by 128.00 KiB (3.00 MiB -> 3.12 MiB)" in line
    freed = NS(**{**vars(same), "peak_bytes": 4 * mib})  # 2 MiB less beside the arguments
    assert memory_not_freed(tpu, freed, base_tpu) is None


def test_remat_placement_and_cause_from_what_is_known():
    program = _user_loop(scan=False, prevent_cse=False)
    pure = program.step(get_policy_spec("save-nothing"))
    loop = remat_placement(jax.make_jaxpr(pure.fn)(*pure.args).jaxpr)
    assert loop == RematPlacement(in_loop=0, outside=plain_jax.L, no_cse_outside=plain_jax.L)
    pure = _user_loop(scan=True).step(get_policy_spec("save-nothing"))
    scanned = remat_placement(jax.make_jaxpr(pure.fn)(*pure.args).jaxpr)
    assert scanned.outside == 0 and scanned.in_loop >= 1
    assert "3 remat region(s) outside a scan have prevent_cse=False" in undone_cause("cuda", loop)
    kept = RematPlacement(in_loop=0, outside=3)
    assert undone_cause("cuda", kept).startswith("not identified: the 3 remat region(s) outside")
    if cpu_undoes_remat_outside_scan("cpu"):  # jax 0.10.2's XLA:CPU: a cause of its own
        assert CPU_CAUSE in undone_cause("cpu", loop)
        assert "not known to remat-kit" in undone_cause("cpu", scanned)
    else:  # jax 0.12's XLA:CPU keeps remat outside a scan: the causes a GPU's are
        assert undone_cause("cpu", loop) == undone_cause("cuda", loop)
        assert undone_cause("cpu", scanned) == undone_cause("cuda", scanned)


#: XLA's buffer assignment as measured on the H100 target (one host allocation, two of the six
#: offloaded buffers of an unrolled 3-layer NNX GPT shown), cut down.
_ASSIGNMENT = """allocation 0: size 262144, parameter 9, shape |f32[128,512]| at ShapeIndex {}:
 value: <4625 p.1 @0> (size=262144,offset=0): f32[128,512]{1,0}
allocation 554: size 1310720, color 5, preallocated-temp:
 value: <4730 copy-start.12{0} @5> (size=262144,offset=1048576): f32[4,128,128]{2,1,0:S(5)}
 value: <4733 copy-start.1.0{0} @5> (size=1048576,offset=0): f32[4,128,512]{2,1,0:S(5)}
 value: <4736 copy-start.2.0{0} @5> (size=262144,offset=1048576): f32[4,128,128]{2,1,0:S(5)}
 value: <4739 copy-start.3.0{0} @5> (size=1048576,offset=0): f32[4,128,512]{2,1,0:S(5)}
allocation 555: size 19176336, preallocated-temp:
 value: <4591 f.5{0} @0> (size=2048,offset=786432): f32[4,128]{1,0}
"""


def test_host_bytes_against_the_jaxprs_offloaded_bytes_in_one_line():
    found = host_buffers(DumpFiles(None, None, _ASSIGNMENT, None))
    assert found == HostBuffers(
        allocated=1310720, count=4, buffer_bytes=2621440, value_bytes=2621440
    )
    line = host_line(1310720, 3 * 1310720, found)
    assert "1.25 MiB on the host at its peak" in line and "offloads 3.75 MiB" in line
    assert "reuses host space: its 4 host buffers (2.50 MiB) share 1.25 MiB" in line
    assert "kept the rest on the device" in line  # 2.5 of the 3.75 MiB placed on the host
    assert host_line(1310720, 1310720, found) is None  # the same figure: nothing to say
    # a TPU's tiled layout: a 65-long axis rounded to 128 doubles each q / k / v stack, so the
    # host holds more than is offloaded; reuse, which only lowers it, was given as the reason
    # (outside trial's ViT on v5e-8, session 16)
    tiled = _ASSIGNMENT.replace("f32[4,128,128]{2,1,0:S(5)}", "f32[4,65,128]{2,1,0:T(8,128)S(5)}")
    padded = host_buffers(DumpFiles(None, None, tiled, None))
    assert padded.value_bytes == 2 * (4 * 65 * 128 * 4) + 2 * 1048576
    line = host_line(1310720, 1048576, padded)
    assert "the layout pads the host buffers" in line and "reuses host space" not in line
    before = _ASSIGNMENT.split("allocation 554")[0]
    assert host_buffers(DumpFiles(None, None, before, None)) is None
    assert host_buffers(DumpFiles(None, None, None, None)) is None


def test_values_aliasing_one_host_buffer_are_counted_once():
    """A scan's stacked offloaded residual on a v5e target: XLA lists the loop's parameter,
    tuple element, in-place update and result as five values of one 128 KiB buffer; they were
    summed as five buffers (values 320 KiB, tiled 640 KiB, said beside 128 KiB; s19 MaxText-
    style trial). Values whose live ranges chain are one buffer; a later value reusing the place
    after the first is dead is another."""
    shape = "f32[2,2,64,64]{2,3,1,0:T(8,128)S(5)}"
    names = ["custom-call.12", "wide.arg_tuple.13{2}", "wide.arg_tuple.1{2}",
             "dynamic_update_slice.57", "while.7{2}"]  # fmt: skip
    spans = [(101, 105), (105, 109), (109, 126), (126, 173), (173, 350)]
    values = "".join(
        f" value: <{40 + i} {n} @5> (size=131072,offset=0): {shape}\n" for i, n in enumerate(names)
    )
    assignment = f"allocation 116: size 131072, color 5, preallocated-temp:\n{values}"

    def live_range(spans):
        lines = [f"  {n.split('{')[0]}{'{' + n.split('{')[1] if '{' in n else '{}'}:{a}-{b}"
                 for n, (a, b) in zip(names, spans, strict=True)]  # fmt: skip
        return "BufferLiveRange:\n" + "\n".join(lines) + "\nLive ranges at 1:\n"

    found = host_buffers(DumpFiles(None, live_range(spans), assignment, None))
    assert found == HostBuffers(allocated=131072, count=1, buffer_bytes=131072, value_bytes=65536)
    line = host_line(131072, 65536, found)
    assert "their values take 64.00 KiB, their tiled layout 128.00 KiB" in line
    apart = [(101, 105), (106, 109), (110, 126), (127, 173), (174, 350)]  # each dead first
    assert host_buffers(DumpFiles(None, live_range(apart), assignment, None)).count == 5
    assert host_buffers(DumpFiles(None, None, assignment, None)).count == 5  # no ranges: as read


@needs_cuda_plugin
def test_offloaded_layers_of_an_unrolled_loop_share_host_space_on_gpu():
    """Measured on the H100 target: the offloaded tensors of unrolled layers are copied back
    right away, so they share host space: the compiled host bytes are below the jaxpr's."""
    (r,) = analyze_policies(
        _user_loop(scan=False), [{"attn_in": "offload"}], "h100-sxm", compare_offload=False,
        no_remat_baseline=False,  # the host figures are the policy's own compile's
    )  # fmt: skip
    assert 0 < r.host_bytes < r.offloaded_bytes
    line = [w for w in r.warnings if w.startswith("host memory:")]
    assert len(line) == 1 and "reuses host space" in line[0], r.warnings


def test_what_a_target_without_offload_keeps_is_counted_on_the_device():
    """On a target that does not offload (the CPU) an offloaded tag's residuals are device
    memory: its row says device and the residual bytes count it, for a user's program and a
    bundled one alike (the by-tag table said 'host 1.00' beside 'host 0.00', outside trial)."""
    offload, save = {"attn_in": "offload"}, {"attn_in": "save"}
    # no unseen no-remat compiles: what is checked is where each policy's residuals are kept
    kw = dict(no_remat_baseline=False)
    off, kept = analyze_policies(plain_jax.program(), [offload, save], "local", **kw)
    assert [(r.tag, r.memory) for r in off.residuals] == [(r.tag, r.memory) for r in kept.residuals]
    assert all(r.memory == "device" for r in off.residuals)
    assert off.activation_bytes == kept.activation_bytes and not off.offloaded_bytes
    assert any("does not offload" in w for w in off.warnings)
    from remat_kit import preset

    (bundled,) = analyze_policies(preset("tiny-gpt", 2, 32), ["offload-to-host"], "local", **kw)
    assert bundled.residuals and all(r.memory == "device" for r in bundled.residuals)
    assert bundled.activation_bytes and not bundled.offloaded_bytes


@needs_cuda_plugin
def test_what_an_offloading_target_offloads_stays_on_the_host():
    (r,) = analyze_policies(
        plain_jax.program(), [{"attn_in": "offload"}], "h100-sxm", compare_offload=False,
        no_remat_baseline=False,  # where the residuals are kept: the policy's own compile
    )  # fmt: skip
    assert [row.memory for row in r.residuals if row.tag == "attn_in"] == ["host"]
    assert r.offloaded_bytes == sum(row.nbytes for row in r.residuals if row.memory == "host") > 0


def _odd_attention(policy):
    """Attention over 65 tokens (a ViT's 64 patches and a class token), then ``ctx @ w``."""
    b, n, h, d = 8, 65, 4, 16

    def loss(w, x):
        q = x.reshape(b, n, h, d)
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, q), -1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", p, q).reshape(b, n, h * d)
        return jnp.mean((ctx @ w) ** 2)

    return loss if policy is None else jax.checkpoint(loss, policy=policy)


@needs_cuda_plugin
def test_a_matmul_xla_cannot_tile_without_a_gpu_is_compiled_with_cublas_and_said():
    """XLA's deviceless GPU compile finds no Triton GEMM tiling for the [520, 64] matmul of a
    65-token attention ("Couldn't find output tile sizes", an outside trial's ViT: every policy
    failed to compile); the analysis compiles it with Triton GEMMs off and says so, where a
    plain compile of the same step fails."""
    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((8, 65, 64))
    program = Program.from_loss(_odd_attention, w, x, optimizer="sgd", name="odd-attention")
    (r,) = analyze_policies(program, ["no-remat"], "h100-sxm", top_k=0)
    sharding = targets.abstract_sharding("h100-sxm")
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in (w, x)]
    try:
        jax.jit(jax.grad(_odd_attention(None))).lower(*args).compile()
        plain = None
    except Exception as err:
        plain = str(err)
    said = [m for m in r.warnings if "xla_gpu_enable_triton_gemm=false" in m]
    assert r.peak_bytes > 0
    if plain is None:  # an XLA that tiles it: nothing to fall back from
        assert not said, r.warnings
    else:
        assert "Couldn't find output tile sizes" in plain
        assert said == [
            "compiled with xla_gpu_enable_triton_gemm=false (every matmul a cuBLAS call): XLA "
            "found no Triton GEMM tiling for a f32[520,64] matmul without a GPU to autotune on"
        ]


def _unrolled_gelu():
    """Four unrolled blocks whose residuals are gelu outputs [4, 32, 256] f32: XLA fuses them
    away, so the jaxpr's residuals (3.6 MiB without remat) exceed the compiled peak (jax#12792)."""

    def block(x, w1, w2):
        return x + checkpoint_name(jax.nn.gelu(x @ w1), "mlp_hidden") @ w2

    def make_loss(policy):
        def loss(p, x):
            for i in range(4):
                f = block if policy is None else jax.checkpoint(block, policy=policy)
                x = f(x, p["w1"][i], p["w2"][i])
            return (x**2).mean()

        return loss

    w = {"w1": jax.ShapeDtypeStruct((4, 64, 256), jnp.float32),
         "w2": jax.ShapeDtypeStruct((4, 256, 64), jnp.float32)}  # fmt: skip
    x = jax.ShapeDtypeStruct((4, 32, 64), jnp.float32)
    return Program.from_loss(make_loss, w, x, optimizer="sgd", name="unrolled-gelu")


def test_residuals_above_the_compiled_peak_are_said_to_be_the_jaxprs():
    labels = ["no-remat", "save-nothing"]
    reports = analyze_policies(_unrolled_gelu(), labels, "local")
    assert reports[0].activation_bytes > reports[0].peak_bytes  # the case the note is for
    note = cli_analyze._residuals_over_peak(reports, labels)
    assert note is not None and "print_saved_residuals" in note
    assert f"no-remat {cli_analyze._size(reports[0].activation_bytes)} against" in note
    assert "save-nothing" not in note  # its residuals are below its peak
    below = analyze_policies(_user_loop(scan=True), ["save-nothing"], "local")
    assert below[0].activation_bytes < below[0].peak_bytes
    assert cli_analyze._residuals_over_peak(below, ["save-nothing"]) is None


def test_capped_save_alone_specs_keep_the_tags_with_the_largest_residuals():
    """With more tags than save-alone specs, the ones kept are those whose residuals are
    largest (the choice that trades most memory), not the first names in the alphabet."""

    def layer(x, w):
        h = checkpoint_name(x @ w["w1"], "z_wide")  # [B, S, 4D]
        g = checkpoint_name(jnp.tanh(h) @ w["w2"], "a_narrow")  # [B, S, D]
        return x + jnp.sin(g)

    def make_loss(policy):
        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return lambda ws, x: (jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)[0] ** 2).mean()

    w = {"w1": jax.ShapeDtypeStruct((2, 16, 64), jnp.float32),
         "w2": jax.ShapeDtypeStruct((2, 64, 16), jnp.float32)}  # fmt: skip
    program = Program.from_loss(make_loss, w, jax.ShapeDtypeStruct((2, 8, 16), jnp.float32))
    chosen = policy_set(program, "cpu", max_single=1)
    labels = [policy_label(s) for s in chosen.specs]
    assert "custom: z_wide=save" in labels and "custom: a_narrow=save" not in labels
    (note,) = [n for n in chosen.notes if "save-alone" in n]
    assert "with the largest residuals" in note and "NAME=save for a_narrow" in note


def _meshed_loss(mesh):
    """A scanned loss constraining its activations to ``mesh`` (as a model built on a mesh
    does, MaxText's among them)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def make_loss(policy):
        def layer(h, w):
            h = jax.lax.with_sharding_constraint(h, sharding)
            return jnp.tanh(checkpoint_name(h @ w, "mlp_hidden")), None

        body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        return lambda w, x: jax.lax.scan(body, x, w)[0].sum()

    return make_loss


@needs_cuda_plugin
def test_a_step_that_cannot_be_lowered_for_the_target_is_reported_per_policy():
    """A model built on a mesh of the CPU's devices, analysed for a GPU: JAX refuses to lower
    it ("incompatible devices"). Each policy gets its CompileError (raise_errors=False), which
    says how to fix it; with raise_errors one CompileError, not JAX's ValueError; the fix it
    names (the mesh on compile_devices(target)) lowers."""
    w, x = jax.ShapeDtypeStruct((2, 8, 8), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32)
    cpu = jax.sharding.Mesh(jax.devices("cpu")[:1], ("x",))
    program = Program.from_loss(_meshed_loss(cpu), w, x, optimizer="sgd", name="cpu-mesh")
    policies = ["no-remat", "save-nothing"]
    got = analyze_policies(program, policies, "h100-sxm", raise_errors=False)
    assert [type(r).__name__ for r in got] == ["CompileError", "CompileError"]
    fix = "build the model's mesh on remat_kit.targets.compile_devices('h100-sxm')"
    for policy, err in zip(policies, got, strict=True):
        assert err.policy == policy and err.stage == "lower"
        assert str(err).startswith(f"policy {policy!r} of 'cpu-mesh' on target 'h100-sxm' failed")
        assert "incompatible devices" in str(err) and fix in str(err) and "\n" not in str(err)
    with pytest.raises(remat_kit.CompileError, match="failed to lower: Received incompatible"):
        analyze_policies(program, ["save-nothing"], "h100-sxm")
    gpu = jax.sharding.Mesh(targets.compile_devices("h100-sxm"), ("x",))
    fixed = Program.from_loss(_meshed_loss(gpu), w, x, optimizer="sgd")
    spec = get_policy_spec("save-nothing")
    traced = remat_kit.trace.trace_step(fixed, spec, fixed.place(targets.get_target("h100-sxm")))
    assert "sharding" in traced[1].lower().as_text()  # lowers: the compile can go on


def _own_remat_loss(w, x):
    """Layers under the model's own jax.checkpoint (no policy), scanned; unbatched matmuls only."""
    body = jax.checkpoint(lambda h, w: (jnp.tanh(checkpoint_name(h @ w, "mlp_hidden")), None))
    return jax.lax.scan(body, x, w)[0].sum()


def test_policies_compiled_to_one_program_are_said_on_the_reports():
    """inject_policy wrapped around a whole step, after its gradient: the policy reaches the
    remat segments only once they are differentiated, so every policy compiled to one program
    and analyze_policies returned identical reports with no word (only program_sha256 showed
    it). Each report says so now, with the fix; a policy compiled to another's program beside
    policies that differ says which, and policies one by construction say nothing more."""
    w, x = jnp.ones((2, 16, 16)) * 0.1, jnp.ones((4, 16))

    def step(w, x):
        value, grad = jax.value_and_grad(_own_remat_loss)(w, x)
        return w - 0.1 * grad, value

    around = Program.from_step(remat_kit.inject_policy(step), w, x, donate_argnums=0)
    kw = {"top_k": 0, "no_remat_baseline": False}  # the compiles compared, no more
    both = analyze_policies(around, ["save-nothing", "save-dots"], "cpu", **kw)
    assert both[0].program_sha256 == both[1].program_sha256
    reach = around.reach()  # the cause, from the trace: each segment took it differentiated
    assert reach.passes and reach.differentiated == reach.reached > 0
    for r in both:
        (line,) = [m for m in r.warnings if m.startswith("every policy (save-nothing, save-dots)")]
        assert "changes nothing here: the make_step's remat segments take the policy" in line
        assert "after the step's gradient is taken" in line and "inject_policy(loss)" in line
    # the loss given to inject_policy instead: save-dots and save-dots-no-batch (no batched
    # matmul here) one program, save-nothing another; save-qkv-proj is save-nothing by its names
    loss = Program.from_loss(remat_kit.inject_policy(_own_remat_loss), w, x, optimizer="sgd")
    policies = ["save-nothing", "save-dots", "save-dots-no-batch", "save-qkv-proj"]
    reports = analyze_policies(loss, policies, "cpu", **kw)
    said = [[m for m in r.warnings if "same program" in m] for r in reports]
    assert said[:3] == [[], [], [
        "the same program as policy 'save-dots' (equal program_sha256): on this program it "
        "keeps and recomputes what 'save-dots' does"
    ]]  # fmt: skip
    assert reports[3].program_sha256 == reports[0].program_sha256 and said[3] == []
    assert not any("every policy" in m for r in reports for m in r.warnings)
