"""Train a small language model on real text with a remat policy; orbax checkpoints, resume.

A thin command line over :func:`trainer.train` (``experiments/trainer/``). The corpus is the
Python standard library's own source (byte-level tokens) unless ``--data PATH`` names a text file
or folder.
Checkpoints go to ``WORKDIR/checkpoints/<updates done>`` every ``--ckpt-every`` updates (the last
``--keep`` kept); ``--resume`` continues from the latest complete one. The run's losses are
written to ``WORKDIR/result.json``.

Command (about 50 s on 2 CPU cores, jax 0.10.2)::

    python experiments/train.py --workdir /tmp/rk-train --policy save-nothing --steps 200 \\
        --set d_model=128 --set d_ff=512 --micro-batches 2

Expected: training loss falls from 5.6 nats/byte (ln 256: uniform bytes) to ~2.7 at step 200,
validation loss ~2.5; checkpoints 100, 150, 200 kept. Add ``--resume --steps 400`` to continue.

Several devices: the step runs on every device JAX sees, data parallel by default, or on the
mesh ``--mesh`` names (``fsdp=4``, ``dp=2,fsdp=2,tp=2``; on a CPU, ``JAX_NUM_CPU_DEVICES=4``
gives 4 devices). Several processes (hosts): start the same command once per process with
``--coordinator HOST:PORT --num-processes N --process-id I`` (or the variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; under SLURM's ``srun``
nothing: JAX reads SLURM's variables). ``--workdir`` must then be a folder every process sees;
process 0 prints and writes ``result.json``.

Fault injection (tests, soak): ``REMAT_KIT_KILL_AT=POINT@STEP`` in the environment makes the run
SIGKILL itself at ``compile``, ``micro-batch``, ``before-save``, ``mid-save`` or ``after-save``
of that step (:mod:`trainer.faults`); ``--resume`` then continues bitwise.

Exit codes: 0 done; 2 bad input (one line on stderr, e.g. an unknown policy or an incompatible
checkpoint); 3 a non-finite loss (the step is named; the last good checkpoint is kept).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import remat_kit  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# experiments/trainer, imported as `trainer`: this folder is sys.path[0] when run as a script, not
# when loaded by path (tests: importlib, runpy)
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console
from trainer import (
    NonFiniteLossError,
    TrainConfig,
    distributed,
    environment_info,
    train,
)

from remat_kit.training import OPTIMIZERS
from remat_kit.validation import SeqLenError

EXIT_BAD_INPUT = 2
EXIT_NON_FINITE = 3


#: The name before every error line, as the remat-kit CLI writes ``remat-kit: error: ...``.
PROG = "train.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's default prints the usage too)
        self.exit(EXIT_BAD_INPUT, f"{PROG}: error: {message}\n")


def _parse_set(items: list[str]) -> dict:
    """``["d_model=128", "norm=rmsnorm"]`` -> ``{"d_model": 128, "norm": "rmsnorm"}``."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE (a ModelConfig field), got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--workdir", required=True, help="checkpoints and result.json go here")
    _add_model_arguments(p, TrainConfig())
    _add_run_arguments(p, TrainConfig())
    distributed.add_arguments(p)
    return p


def _add_model_arguments(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    p.add_argument(
        "--preset",
        default=d.preset,
        help="model preset (remat_kit.preset_names()) (default: %(default)s)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a ModelConfig field, e.g. d_model=128 (repeatable)")  # fmt: skip
    p.add_argument(
        "--policy",
        default=d.policy,
        help="remat policy: a name (remat-kit policies) or a per-tag spec "
        "'query_proj=offload,out_proj=save' / its JSON form (default: %(default)s)",
    )
    p.add_argument("--remat-group-size", type=int, default=d.remat_group_size,
                   help="consecutive blocks per remat segment, divides the layers "
                   "(default: %(default)s)")  # fmt: skip


def _add_run_arguments(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    p.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        help="optimizer updates in the run (default: %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=d.batch_size,
        help="global batch (rows/update) (default: %(default)s)",
    )
    p.add_argument(
        "--seq", type=int, default=d.seq_len, help="tokens per row (default: %(default)s)"
    )
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="split each batch into this many scanned micro-batches "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--optimizer",
        default=d.optimizer,
        choices=OPTIMIZERS,
        help="optax optimizer (default: %(default)s)",
    )
    p.add_argument(
        "--lr", type=float, default=d.lr, help="constant learning rate (default: %(default)s)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="parameter init and batch order (default: %(default)s)",
    )
    p.add_argument("--data", default=None, help="text file or folder (None: Python's stdlib)")
    p.add_argument("--max-bytes", type=int, default=None, help="corpus cap in bytes")
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="updates; 0: never (default: %(default)s)",
    )
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="validation batches per evaluation (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=d.ckpt_every,
        help="updates; 0: never (default: %(default)s)",
    )
    p.add_argument(
        "--keep", type=int, default=d.keep, help="checkpoints kept (default: %(default)s)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument(
        "--log-every", type=int, default=10, help="print every N steps (default: %(default)s)"
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` for parsed arguments. Raises ValueError on bad values."""
    return TrainConfig(
        preset=args.preset,
        overrides=_parse_set(args.set),
        policy=args.policy,
        remat_group_size=args.remat_group_size,
        batch_size=args.batch,
        seq_len=args.seq,
        micro_batches=args.micro_batches,
        steps=args.steps,
        optimizer=args.optimizer,
        lr=args.lr,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        ckpt_every=args.ckpt_every,
        keep=args.keep,
        seed=args.seed,
        mesh=args.mesh,
        data=args.data,
        max_bytes=args.max_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # before anything starts JAX's backends
        distributed.initialize_from_args(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    primary = distributed.is_primary()
    console = Console(highlight=False, markup=False, soft_wrap=True, quiet=not primary)

    first_step: dict[str, int] = {}

    def on_step(m: dict) -> None:
        t = m["step"]
        extra = "".join(
            [f"  val {m['val_loss']:.4f}" if "val_loss" in m else "",
             f"  [saved {m['checkpoint']}]" if "checkpoint" in m else ""]
        )  # fmt: skip
        first = first_step.setdefault("step", t) == t
        if (t + 1) % args.log_every == 0 or extra or first:
            console.print(
                f"step {t + 1:>5}/{cfg.steps}  loss {m['loss']:.4f}  "
                f"grad_norm {m['grad_norm']:.3f}  {m['step_time_s'] * 1e3:.0f} ms{extra}"
            )

    try:
        cfg = config_from_args(args)
        console.print(
            f"{cfg.preset} {cfg.overrides or ''} policy={cfg.policy} "
            f"group={cfg.remat_group_size} batch={cfg.batch_size}x{cfg.seq_len} "
            f"micro_batches={cfg.micro_batches} mesh={cfg.mesh or 'dp over all devices'} "
            f"-> {args.workdir}"
        )
        result = train(cfg, args.workdir, resume=args.resume, on_step=on_step)
    except NonFiniteLossError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_NON_FINITE
    except ValueError as e:
        if isinstance(e, SeqLenError):  # said in this command line's terms
            e = e.with_how(f"--set max_seq_len={e.seq_len}")
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    out = Path(args.workdir) / "result.json"
    if primary:
        env = environment_info()
        out.write_text(json.dumps({**result.to_dict(), "environment": env}, indent=1))
    start = "fresh" if result.resumed_from is None else f"resumed from {result.resumed_from}"
    last = f"{result.losses[-1]:.4f}" if result.losses else "-"
    console.print(
        f"done ({start}): {len(result.losses)} steps, final loss {last}, "
        f"{result.step_time_s * 1e3:.0f} ms/step, compile {result.compile_time_s:.1f} s, "
        f"checkpoints {result.checkpoints}, mesh {result.mesh} on {result.num_processes} "
        f"process(es); wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
