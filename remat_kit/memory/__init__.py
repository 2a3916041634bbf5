"""Compile a step for a target and report its memory: ``analyze`` -> ``MemoryReport``.

Modules: :mod:`~remat_kit.memory.api` (the entry points), :mod:`~remat_kit.memory.policy_set` (the
policies each tool compiles), :mod:`~remat_kit.memory.report` (the
report), :mod:`~remat_kit.memory.runner` (lowering and compiling many steps, concurrently, GPU
kernels shared), :mod:`~remat_kit.memory.xla_compile` (one compile, XLA's dumps and log captured),
:mod:`~remat_kit.memory.reading` (turning them into report pieces), :mod:`~remat_kit.memory.hlo`
(parsing XLA's text dumps) (the jaxpr FLOPs are :mod:`remat_kit.walker`'s),
:mod:`~remat_kit.memory.timeline` (live bytes over XLA's schedule, by category),
:mod:`~remat_kit.memory.policy_only` (the policy's own figures, XLA's own remat told apart),
:mod:`~remat_kit.memory.diff` (two policies side by side),
:mod:`~remat_kit.memory.compile_cache` (compiles and reports kept on disk: a repeat is free).
"""

from remat_kit.memory.api import analyze as analyze
from remat_kit.memory.api import analyze_model as analyze_model
from remat_kit.memory.api import analyze_policies as analyze_policies
from remat_kit.memory.diff import PolicyDiff as PolicyDiff
from remat_kit.memory.diff import diff_reports as diff_reports
from remat_kit.memory.policy_set import PolicySet as PolicySet
from remat_kit.memory.policy_set import policy_set as policy_set
from remat_kit.memory.policy_set import program_tags as program_tags
from remat_kit.memory.report import LogitsLine as LogitsLine
from remat_kit.memory.report import MemoryReport as MemoryReport
from remat_kit.memory.report import PeakBuffer as PeakBuffer
from remat_kit.memory.report import PolicyOnly as PolicyOnly
from remat_kit.memory.timeline import Timeline as Timeline
from remat_kit.memory.timeline import TimelineBuffer as TimelineBuffer
from remat_kit.memory.xla_compile import CompileError as CompileError

#: Names that moved to the zoo (:mod:`remat_kit.zoo.textbook`: the bundled models' formula),
#: still read from here for one release.
_MOVED = frozenset({"LayerActivations", "korthikanti_bytes", "per_layer_activations", "textbook"})


def __getattr__(name: str):
    """Moved names, from their new home (PEP 562)."""
    if name in _MOVED:
        from remat_kit.zoo import textbook

        return textbook if name == "textbook" else getattr(textbook, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
