"""Tests for the experiments' trainer (experiments/trainer/) and experiments/train.py: short versions of the three training
demonstrations (policies give the same losses; a killed run resumes bitwise; accumulation equals
one big batch at a fraction of the activation memory) and the faults (killed at a named moment:
first compile, between micro-batches, before / inside / after an orbax save; incompatible
resume; non-finite loss; bad CLI input).

Compiling a train step takes ~5 s on 2 CPU cores whatever the model size, so tests share one
reference run and every test that can reuses its compiled step (same model, optimizer and shapes:
the trainer caches compiled steps per process). The killed runs are
``experiments/train.py`` processes with ``REMAT_KIT_KILL_AT`` set, started before the reference
run compiles, so they overlap with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from trainer import (  # noqa: E402
    CHECKPOINT_DIR,
    NonFiniteLossError,
    TrainConfig,
    TrainResult,
    compare_updates,
    latest_checkpoint_step,
    load_checkpoint,
    train,
)

TINY = dict(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_seq_len=32)
BASE = TrainConfig(
    preset="tiny-gpt",
    overrides=TINY,
    batch_size=8,
    seq_len=32,
    steps=6,
    lr=3e-3,
    eval_every=2,
    eval_batches=2,
    ckpt_every=2,
    keep=2,
    max_bytes=64 * 1024,
)

MICRO = BASE.replace(micro_batches=2)  # for the kill between micro-batches

#: Kill points (experiments/trainer/faults.py) -> (config, checkpoints left on disk, resumed from).
KILLS = {
    "compile@0": (BASE, [], None),  # a fresh run, killed as it starts compiling
    "micro-batch@3": (MICRO, ["2"], 2),  # inside update 3, between micro-batches 0 and 1
    "before-save@4": (BASE, ["2"], 2),
    "mid-save@6": (BASE, ["2", "4", "6.orbax-checkpoint-tmp"], 4),  # items written, not renamed
    "after-save@4": (BASE, ["2", "4"], 4),
}


def _cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _flags(cfg: TrainConfig) -> list[str]:
    """experiments/train.py flags for ``cfg`` (a tiny-gpt config of this file)."""
    sets = [f for k, v in cfg.overrides.items() for f in ("--set", f"{k}={v}")]
    return [*sets, "--batch", str(cfg.batch_size), "--seq", str(cfg.seq_len),
            "--micro-batches", str(cfg.micro_batches), "--steps", str(cfg.steps),
            "--lr", str(cfg.lr), "--eval-every", str(cfg.eval_every),
            "--eval-batches", str(cfg.eval_batches), "--ckpt-every", str(cfg.ckpt_every),
            "--keep", str(cfg.keep), "--max-bytes", str(cfg.max_bytes)]  # fmt: skip


def _kill_point(item: pytest.Item) -> str | None:
    """The kill point a collected test of this file waits for, if any."""
    params = getattr(item, "callspec", None)
    if params is not None and "point" in params.params:
        return params.params["point"]
    return getattr(getattr(item, "function", None), "kill_point", None)


@pytest.fixture(scope="module")
def killed(request, tmp_path_factory):
    """{kill point: (process, workdir)}: experiments/train.py runs that SIGKILL themselves at
    the named point (REMAT_KIT_KILL_AT); started before the reference run compiles, so they
    overlap with it, and waited for by the tests. Only the points of the selected tests run."""
    wanted = {_kill_point(item) for item in request.session.items}
    procs = {}
    for point, (cfg, _, _) in KILLS.items():
        if point not in wanted:
            continue
        workdir = tmp_path_factory.mktemp("killed")
        cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--workdir",
               str(workdir), *_flags(cfg)]  # fmt: skip
        proc = subprocess.Popen(cmd, env=_cpu_env(REMAT_KIT_KILL_AT=point),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        procs[point] = (proc, workdir)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference(killed, tmp_path_factory) -> tuple[TrainResult, Path]:
    """The uninterrupted BASE run and its workdir."""
    workdir = tmp_path_factory.mktemp("reference")
    return train(BASE, workdir), workdir


def _assert_trees_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_reference_run(reference):
    result, workdir = reference
    assert len(result.losses) == BASE.steps
    assert all(np.isfinite(result.losses))
    assert result.losses[-1] < result.losses[0]  # it learns something
    assert [s for s, _ in result.val_losses] == [0, 2, 4, 6]
    assert result.checkpoints == [4, 6]  # keep=2
    assert latest_checkpoint_step(workdir) == 6
    state, meta = load_checkpoint(workdir)
    assert int(state.step) == 6 and meta["data"]["step"] == 6
    assert meta["losses"] == result.losses


@pytest.mark.parametrize("policy", ["save-nothing", "save-dots-no-batch", "offload-to-host"])
def test_policies_give_the_same_losses(reference, policy, tmp_path):
    """Demo 1, short: a remat policy does not change what the model learns."""
    result = train(BASE.replace(policy=policy, eval_every=0, ckpt_every=0), tmp_path)
    np.testing.assert_allclose(result.losses, reference[0].losses, rtol=0, atol=1e-5)


def test_killed_run_resumes_bitwise(reference, tmp_path):
    """Demo 2, short: killed after 3 updates, resumed from checkpoint 2: same losses, bitwise."""
    ref, ref_dir = reference

    class Killed(Exception):
        pass

    def kill_after_step_2(info):
        if info["step"] == 2:
            raise Killed

    with pytest.raises(Killed):
        train(BASE, tmp_path, on_step=kill_after_step_2)
    assert latest_checkpoint_step(tmp_path) == 2
    resumed = train(BASE, tmp_path, resume=True)
    assert resumed.resumed_from == 2
    assert resumed.losses == ref.losses  # float equality: bitwise
    assert resumed.val_losses == ref.val_losses
    _assert_trees_equal(load_checkpoint(tmp_path)[0], load_checkpoint(ref_dir)[0])


def _resume_after_kill(point: str, reference_run: TrainResult, reference_dir: Path, killed):
    """Wait for the run killed at ``point``, check what it left, resume it and compare with
    the uninterrupted ``reference_run``: losses, validation losses and final state bitwise."""
    cfg, left, resumed_from = KILLS[point]
    proc, workdir = killed[point]
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, output  # the hook fired: killed, not finished
    ckpt_dir = workdir / CHECKPOINT_DIR
    assert sorted(p.name for p in ckpt_dir.iterdir()) == left
    # Reading opens orbax read-only: it must not start deleting the unfinished save (that
    # deletion racing the resumed run's own was the flaky FileNotFoundError 'process_0').
    assert latest_checkpoint_step(workdir) == resumed_from
    assert sorted(p.name for p in ckpt_dir.iterdir()) == left
    resumed = train(cfg, workdir, resume=True)
    assert resumed.resumed_from == resumed_from
    assert resumed.losses == reference_run.losses  # float equality: bitwise
    assert resumed.val_losses == reference_run.val_losses
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["4", "6"]  # no tmp folder left
    _assert_trees_equal(load_checkpoint(workdir)[0], load_checkpoint(reference_dir)[0])


def test_kill_during_save_keeps_previous_checkpoints(reference, killed):
    """SIGKILLed inside orbax's save of step 6, after every item is written to
    6.orbax-checkpoint-tmp and before the rename: 2 and 4 survive (keep=2 deletes 2 only after
    6 is complete); --resume continues from 4 and ends bitwise where the reference ends."""
    _resume_after_kill("mid-save@6", *reference, killed)


test_kill_during_save_keeps_previous_checkpoints.kill_point = "mid-save@6"


@pytest.mark.parametrize("point", ["compile@0", "before-save@4", "after-save@4"])
def test_killed_at_any_moment_resumes_bitwise(reference, killed, point):
    _resume_after_kill(point, *reference, killed)


def test_killed_between_micro_batches_resumes_bitwise(killed, tmp_path):
    """Killed inside update 3 between its two micro-batches: nothing of update 3 is saved, the
    resume from checkpoint 2 matches an uninterrupted 2-micro-batch run bitwise."""
    uninterrupted = train(MICRO, tmp_path)
    _resume_after_kill("micro-batch@3", uninterrupted, tmp_path, killed)


test_killed_between_micro_batches_resumes_bitwise.kill_point = "micro-batch@3"


def test_bad_kill_point_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("REMAT_KIT_KILL_AT", "mid-sav@3")
    with pytest.raises(ValueError, match="unknown REMAT_KIT_KILL_AT point 'mid-sav'.*'mid-save'"):
        train(BASE, tmp_path)


def test_gradient_accumulation_matches_one_big_batch():
    """Demo 3, short: 4 micro-batches of 2 rows == one batch of 8 rows, at ~1/3 the temp
    memory (the float32 gradient accumulator and optimizer temporaries do not shrink)."""
    r = compare_updates(BASE, micro_batches=4, grads=False)  # the demo compares gradients too
    assert r["loss_abs_diff"] < 1e-5 and r["grad_norm_abs_diff"] < 1e-5
    assert r["params_max_abs_diff"] < 0.1 * BASE.lr  # Adam amplifies zero-gradient noise
    assert r["temp_ratio"] > 2.5, r


def test_resume_with_incompatible_config_names_the_mismatch(reference):
    _, workdir = reference
    other = BASE.replace(overrides={**TINY, "d_model": 64}, seed=1)
    with pytest.raises(ValueError, match="incompatible config") as info:
        train(other, workdir, resume=True)
    message = str(info.value)
    assert "d_model (checkpoint 32, now 64)" in message and "seed (checkpoint 0, now 1)" in message
    assert "\n" not in message


def test_resume_may_change_policy_and_micro_batches(reference, tmp_path):
    _, workdir = reference
    shutil.copytree(workdir, tmp_path, dirs_exist_ok=True)
    # The run is complete (6 of 6 steps), so this only loads it: nothing is compiled.
    done = train(BASE.replace(policy="save-nothing", micro_batches=2), tmp_path, resume=True)
    assert done.resumed_from == 6 and done.losses == reference[0].losses


def test_resume_with_fewer_steps_than_the_checkpoint_is_an_error(reference):
    _, workdir = reference  # 6 updates done
    with pytest.raises(ValueError, match=r"already 6 updates in; ask for more steps \(--steps > 6"):
        train(BASE.replace(steps=4), workdir, resume=True)


def test_existing_checkpoints_without_resume_is_an_error(reference):
    with pytest.raises(ValueError, match="--resume"):
        train(BASE, reference[1])


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = BASE.replace(lr=1e30, ckpt_every=1, eval_every=0)  # diverges at step 1
    with pytest.raises(NonFiniteLossError, match="at step 1;") as info:
        train(cfg, tmp_path)
    assert info.value.step == 1 and info.value.last_checkpoint == 1
    assert latest_checkpoint_step(tmp_path) == 1
    state, meta = load_checkpoint(tmp_path)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    assert len(meta["losses"]) == 1


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"policy": "save-nothng"}, "Did you mean 'save-nothing'"),
        ({"preset": "gpt3"}, "unknown preset"),
        ({"micro_batches": 3}, "not divisible by micro_batches=3"),
        ({"seq_len": 64}, "seq_len=64 exceeds max_seq_len=32"),
        ({"remat_group_size": 3}, "does not divide"),
        ({"overrides": {"d_modle": 8}}, "unknown ModelConfig field"),
        ({"overrides": {"remat_policy": "save-dots"}}, "set policy on TrainConfig"),
        ({"steps": 0}, "steps must be a positive integer"),
        ({"lr": float("nan")}, "lr must be a positive finite number"),
    ],
)
def test_bad_config_raises(changes, match):
    with pytest.raises(ValueError, match=match):
        BASE.replace(**changes)


def test_config_round_trips_through_json():
    assert TrainConfig.from_dict(json.loads(json.dumps(BASE.to_dict()))) == BASE


def test_a_sequence_over_max_seq_len_says_how_to_raise_it_in_the_config():
    """In TrainConfig's own terms (its overrides), as the CLI and the sweep say it in theirs."""
    with pytest.raises(ValueError) as err:
        TrainConfig(preset="tiny-gpt", seq_len=4096)
    fix = "use a shorter sequence or raise max_seq_len: overrides={'max_seq_len': 4096}"
    assert str(err.value).endswith(fix)


@pytest.mark.parametrize("name", ["train", "TrainConfig", "load_checkpoint", "distributed"])
def test_the_library_says_where_the_trainer_went(name):
    """remat_kit.training keeps the step; asking it for a trainer name is one line naming the new
    home, not a bare "cannot import name"."""
    import remat_kit.training

    with pytest.raises(ImportError) as err:
        exec(f"from remat_kit.training import {name}", {})
    message = str(err.value)
    assert "\n" not in message and "experiments/trainer" in message
    assert f"from trainer import {name}" in message
    assert name not in remat_kit.training.__all__
    with pytest.raises(AttributeError):
        remat_kit.training.no_such_name  # noqa: B018


def _cli():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "experiments" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _base_flags(workdir) -> list[str]:
    sets = [f for k, v in TINY.items() for f in ("--set", f"{k}={v}")]
    return ["--workdir", str(workdir), *sets, "--batch", "8", "--seq", "32", "--lr", "0.003",
            "--max-bytes", str(64 * 1024)]  # fmt: skip


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--micro-batches", "3"], "not divisible"),
        (["--set", "d_model"], "--set takes KEY=VALUE"),
        (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(flags, match, tmp_path, capsys):
    assert _cli().main([*_base_flags(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_argparse_error_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _cli().main([*_base_flags(tmp_path), "--steps", "many"])
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_trains_and_writes_result(reference, tmp_path, capsys):
    # Same model, optimizer and shapes as the reference: the compiled step is reused.
    flags = [*_base_flags(tmp_path), "--steps", "2", "--eval-every", "2", "--ckpt-every", "1"]
    assert _cli().main(flags) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["losses"] == reference[0].losses[:2]
    assert result["checkpoints"] == [1, 2] and result["environment"]["backend"] == "cpu"
    assert "done (fresh)" in capsys.readouterr().out


def test_train_config_takes_a_per_tag_policy():
    config = BASE.replace(policy="query_proj=offload,out_proj=save")
    spec = config.model_config().policy_spec
    assert spec.offload == {"query_proj"} and spec.save == {"out_proj"}
    with pytest.raises(ValueError, match="tag 'out_proj': unknown action 'keep'"):
        BASE.replace(policy="out_proj=keep")
