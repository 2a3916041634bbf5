"""MaxText users: its policy names and config lines both ways (no MaxText needed), the one-line
error without it, and (with maxtext installed) a tiny MaxText config as a Program."""

import subprocess
import sys

import pytest

from remat_kit import trace
from remat_kit.policies import (
    MAXTEXT_POLICIES,
    custom_spec,
    get_policy_spec,
    maxtext_config_lines,
    maxtext_spec,
    parse_maxtext_lines,
    policy_names,
)


@pytest.mark.parametrize("name", ["minimal", *MAXTEXT_POLICIES])
def test_a_maxtext_name_gives_its_own_config_line_and_back(name):
    assert maxtext_config_lines(name) == [f"remat_policy={name}"]
    assert parse_maxtext_lines(f"remat_policy={name}") == get_policy_spec(name)


def test_registered_policies_are_said_in_maxtext_names_where_it_has_them():
    assert maxtext_config_lines("save-nothing") == ["remat_policy=full"]
    assert maxtext_config_lines("save-qkv-out-proj") == ["remat_policy=save_dot_except_mlp"]
    assert maxtext_config_lines("offload-to-host") == ["remat_policy=minimal_offloaded"]
    # a name-based policy MaxText has no name for: its custom lines
    assert maxtext_config_lines("offload-layer-inputs") == [
        "remat_policy=custom", "decoder_layer_input=offload",
    ]  # fmt: skip


def test_a_per_tag_pick_is_custom_lines_that_read_back_to_it():
    spec = custom_spec({"query_proj": "offload", "out_proj": "save", "mlpwo": "recompute"})
    lines = maxtext_config_lines(spec)
    assert lines == [
        "remat_policy=custom", "decoder_layer_input=remat", "out_proj=device",
        "query_proj=offload",
    ]  # fmt: skip
    back = parse_maxtext_lines(lines)
    assert (back.save, back.offload) == (spec.save, spec.offload)
    assert parse_maxtext_lines(" ".join(lines)) == back  # one string, as MaxText's argv
    # MaxText's default keeps the layer input on device
    assert parse_maxtext_lines("remat_policy=custom out_proj=device").save == {
        "decoder_layer_input", "out_proj",
    }  # fmt: skip
    assert get_policy_spec("remat_policy=custom,out_proj=device") == maxtext_spec(
        "custom", {"out_proj": "device"}
    )


def test_policies_maxtext_cannot_say_and_bad_lines_are_one_line_errors():
    for kind in ("save-dots", "save-dots-no-batch", "no-remat"):
        with pytest.raises(ValueError, match="selects by kind.*MaxText's remat_policy has no"):
            maxtext_config_lines(kind)
    with pytest.raises(
        ValueError, match="names hidden, which MaxText's remat_policy=custom has no setting"
    ):
        maxtext_config_lines({"hidden": "save"})
    with pytest.raises(ValueError, match="set no remat_policy"):
        parse_maxtext_lines("query_proj=device")
    with pytest.raises(ValueError, match="unknown MaxText remat_policy 'minmal'.*'minimal'"):
        parse_maxtext_lines("remat_policy=minmal")
    with pytest.raises(ValueError, match="apply to MaxText's remat_policy=custom, not 'full'"):
        parse_maxtext_lines("remat_policy=full query_proj=device")
    with pytest.raises(ValueError, match="unknown MaxText custom-policy tensor 'query_prj'"):
        parse_maxtext_lines("remat_policy=custom query_prj=device")
    with pytest.raises(ValueError, match="'keep'"):
        parse_maxtext_lines("remat_policy=custom query_proj=keep")
    assert "full" not in policy_names()  # accepted, not registered: the registry stays one list


def test_the_cli_reads_maxtext_policy_names_and_lines():
    from remat_kit.cli.args import policy_arg

    full = policy_arg("full")
    assert full.name == "full" and full.to_jax() is get_policy_spec("save-nothing").to_jax()
    assert policy_arg("remat_policy=custom query_proj=device").save == {
        "decoder_layer_input", "query_proj",
    }  # fmt: skip


def _has_maxtext() -> bool:
    import importlib.util

    return importlib.util.find_spec("maxtext") is not None


@pytest.mark.skipif(_has_maxtext(), reason="checks the error where MaxText is not installed")
def test_without_maxtext_the_cli_says_what_to_install_in_one_line():
    code = "from remat_kit.cli import main; raise SystemExit(main(['analyze', '--maxtext', 'model_name=llama2-7b']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and 'pip install "remat-kit[maxtext]"' in lines[0], out.stderr
    assert "Python >= 3.12" in lines[0]


def test_maxtext_and_model_are_one_or_the_other():
    from remat_kit.cli import main

    assert main(["analyze", "--model", "tiny-gpt", "--maxtext", "model_name=llama2-7b"]) == 2
    assert main(["analyze", "--batch", "1"]) == 2
    assert main(["analyze", "--maxtext", "model_name=llama2-7b", "--batch", "2"]) == 2


#: A 2-layer llama2 at 128 tokens: MaxText's model, compiled in seconds.
TINY = (
    "model_name=llama2-7b override_model_config=true base_num_decoder_layers=2 base_emb_dim=256 "
    "base_mlp_dim=512 base_num_query_heads=4 base_num_kv_heads=4 head_dim=64 vocab_size=1024 "
    "per_device_batch_size=1 max_target_length=128 enable_checkpointing=false"
)


def test_a_maxtext_config_is_a_program_every_tool_takes():
    pytest.importorskip("maxtext")
    from remat_kit.maxtext import maxtext_program
    from remat_kit.memory import analyze_policies

    prog = maxtext_program(TINY, "local")
    reports = analyze_policies(prog, ["full", "save-nothing", "minimal", "no-remat"])
    full, nothing, minimal, plain = reports
    assert full.policy == "full" and full.peak_bytes == nothing.peak_bytes  # MaxText's name
    assert minimal.peak_bytes != full.peak_bytes
    assert plain.peak_bytes > full.peak_bytes  # no-remat: injected, every residual kept


def test_maxtext_candidates_are_what_maxtext_can_set():
    from remat_kit.maxtext import maxtext_candidates
    from remat_kit.policies import maxtext_config_lines

    tags = {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj",
            "mlpwi_0", "mlpwi_1", "mlpwo", "attention_out"}  # fmt: skip
    specs = maxtext_candidates(frozenset(tags))
    names = [s.name for s in specs]
    assert {"full", "minimal", "save_qkv_proj", "save_dot_except_mlp"} <= set(names)
    assert "save_dot_with_context_except_mlp" not in names  # names context, not emitted
    lines = [maxtext_config_lines(s) for s in specs]  # every one a MaxText config line
    assert ["remat_policy=custom", "decoder_layer_input=device", "out_proj=device"] in lines
    assert len(specs) == len(set(specs))
    with pytest.raises(ValueError, match="emits none of MaxText's checkpoint names"):
        maxtext_candidates(frozenset({"hidden"}))


@pytest.fixture(scope="module")
def unscanned():
    """The tiny config with its layers unscanned: JAX then names each residual it keeps."""
    pytest.importorskip("maxtext")
    from remat_kit.maxtext import maxtext_program

    return maxtext_program(f"{TINY} scan_layers=false", "local")


def _jax_bytes_by_name(fn, *args):
    """Bytes JAX's own ``print_saved_residuals`` lists per checkpoint name (arguments left
    out), and in all."""
    import contextlib
    import io
    import re

    import numpy as np
    from jax.ad_checkpoint import print_saved_residuals

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    named, total = {}, 0
    for line in out.getvalue().splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
        if m is None or "from the argument" in m.group(3):
            continue
        dtype, dims, what = m.groups()
        size = np.dtype({"bf16": "bfloat16", "f32": "float32", "i32": "int32"}.get(dtype, dtype))
        n = int(np.prod([int(d) for d in dims.split(",") if d])) * size.itemsize
        total += n
        name = re.search(r"named '([^']+)'", what)
        if name:
            named[name.group(1)] = named.get(name.group(1), 0) + n
    return named, total


@pytest.mark.parametrize("name", ["full", "minimal", "save-qkv-proj"])
def test_maxtext_loss_residuals_equal_jax_by_checkpoint_name(unscanned, name):
    # full, minimal: MaxText's own remat_policy; save-qkv-proj: injected into its loss_fn
    from remat_kit.cli.args import policy_arg

    spec = policy_arg(name)
    rows = trace.residuals(unscanned, spec, None)
    ours = {}
    for row in rows:
        if not row.tag.startswith("<"):
            ours[row.tag] = ours.get(row.tag, 0) + row.nbytes
    loss = unscanned.loss(spec)
    named, total = _jax_bytes_by_name(loss.fn, *loss.args)
    assert ours == named
    assert sum(r.nbytes for r in rows) == total
    if name != "full":
        assert ours  # the policy keeps named values


def test_maxtext_residuals_are_per_chip_on_a_tpu_slice():
    pytest.importorskip("maxtext")
    pytest.importorskip("libtpu")
    from remat_kit.maxtext import maxtext_program
    from remat_kit.policies import get_policy_spec

    spec = get_policy_spec("minimal")
    one = {r.tag: r.nbytes for r in trace.residuals(maxtext_program(TINY, "local"), spec, None)}
    slice_ = maxtext_program(TINY, "v5p-8")  # FSDP over 4 chips, global batch 4
    assert slice_.known.saved.keywords["batch_split"] == (4, 128, 4)  # its per-chip rule
    four = {r.tag: r.nbytes for r in trace.residuals(slice_, spec, None)}
    for tag in ("query_proj", "mlpwi_0", "out_proj"):  # one sequence per chip, as on one
        assert four[tag] == one[tag]


def test_maxtext_program_traces_for_a_gpu_target():
    pytest.importorskip("maxtext")
    pytest.importorskip("jax_cuda12_plugin")
    from remat_kit.maxtext import maxtext_program
    from remat_kit.memory.policy_set import program_tags

    prog = maxtext_program(TINY, "h100-sxm")  # MaxText's GPU attention: a tokamax kernel
    assert {"query_proj", "mlpwo", "decoder_layer_input"} <= program_tags(prog)


def test_recommend_maxtext_prints_the_config_line(capsys):
    from types import SimpleNamespace

    from remat_kit.cli.recommend import _maxtext_lines, print_maxtext_lines

    pick = SimpleNamespace(policy="custom", actions={"query_proj": "save"}, peak_bytes=2**20)
    rec = SimpleNamespace(pick=pick, target="v5p-8", budget_bytes=2**21)
    print_maxtext_lines(rec)
    out = capsys.readouterr().out.splitlines()
    assert "v5p-8: peak 1.00 MiB of the 2.00 MiB budget" in out[0]
    assert out[1] == "remat_policy=custom decoder_layer_input=remat query_proj=device"
    named = SimpleNamespace(policy="save_dot_except_mlp", actions=None, peak_bytes=1)
    assert _maxtext_lines(named) == ["remat_policy=save_dot_except_mlp"]
    kind = SimpleNamespace(policy="save-dots", actions=None, peak_bytes=1)
    assert _maxtext_lines(kind) is None  # MaxText cannot say it
    print_maxtext_lines(SimpleNamespace(pick=kind, target="local", budget_bytes=1))
    assert capsys.readouterr().out.startswith("# not a MaxText setting: ")


def test_a_config_maxtext_refuses_is_one_line_naming_the_value():
    pytest.importorskip("maxtext")
    from remat_kit.maxtext import maxtext_program

    with pytest.raises(
        ValueError, match=r"^MaxText refused the config: model_name: .*llama9-7b"
    ) as e:
        maxtext_program("model_name=llama9-7b", "local")
    assert "\n" not in str(e.value)


def test_maxtext_with_its_checkpointing_on_builds_outside_pytest_too():
    # MaxText's config starts JAX's distributed system unless run under pytest, with
    # checkpointing on and no compile_topology: the program must skip it (one process)
    pytest.importorskip("maxtext")
    tiny = TINY.replace(" enable_checkpointing=false", "")
    code = (
        "import jax; jax.devices()\n"
        "from remat_kit.maxtext import maxtext_program\n"
        f"print(maxtext_program({tiny!r}, 'local').name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("maxtext llama2-7b")


def test_maxtext_parameters_are_named_by_their_shape_per_chip():
    pytest.importorskip("maxtext")
    pytest.importorskip("libtpu")
    from remat_kit.maxtext import maxtext_program

    prog = maxtext_program(TINY, "v5p-8")
    params = trace.buffer_names(prog, (), None).params
    # wi_0 / wi_1 [emb, layers, mlp]: emb split over the 4 chips (fsdp), as the HLO holds them
    assert ("float32", (64, 2, 512)) in params
    assert ("float32", (256, 2, 512)) not in params
