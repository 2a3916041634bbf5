"""MaxText users: its policy names and config lines both ways (no MaxText needed), the one-line
error without it, and (with maxtext installed) a tiny MaxText config as a Program."""

import subprocess
import sys

import pytest

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
