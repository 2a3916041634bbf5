"""MaxText users: its policy names and config lines both ways (no MaxText needed), the one-line
error without it, and (with maxtext installed) a tiny MaxText config as a Program."""

import subprocess
import sys

import pytest

import remat_kit
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
    with pytest.raises(ValueError, match="names hidden, which MaxText's remat_policy=custom has no setting"):
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
