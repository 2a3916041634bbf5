"""``recommend``: the fastest remat configuration that fits a memory budget, verified by compiling.

Every configuration considered is compiled for the target (deviceless for GPU models, see
:mod:`remat_kit.targets`) by :func:`remat_kit.memory.analyze_policies`; its peak is XLA's own
figure and its FLOPs the compiled program's. Nothing is recommended that was not compiled and
found to fit. The pick is the fitting candidate with the least estimated step time (seconds,
``MemoryReport.step_time_s``: the roofline of :mod:`remat_kit.memory.roofline`, docs/time-model.md);
ties go to no host traffic, then less device memory; with ``batch_size="auto"``, the most tokens
per second. ``solve`` predicts choices it has not compiled on the same scale: the compiled
save-nothing's estimate less the recomputation a choice keeps (:func:`choice_time`).

The search's stages (named policies, group sizes, largest batch, per-tag solve, structure,
advice when nothing fits) and which module holds each: docs/recommend.md ("How the search
runs"). The command line is :mod:`remat_kit.cli.recommend`; this package never imports the CLI.

Example::

    from remat_kit.recommend import recommend

    rec = recommend("llama3-8b", seq_len=8192, target="h200", solve=True)
    print(rec.line())   # nn.remat(Block, policy=remat_kit.custom_policy({...}))  # batch 1, ...
"""

from remat_kit.recommend.api import DEFAULT_MARGIN as DEFAULT_MARGIN
from remat_kit.recommend.api import parse_budget as parse_budget
from remat_kit.recommend.api import recommend as recommend
from remat_kit.recommend.api import recommend_program as recommend_program
from remat_kit.recommend.search import BATCH_PROBES as BATCH_PROBES
from remat_kit.recommend.search import DEVICE_COUNTS as DEVICE_COUNTS
from remat_kit.recommend.search import SECANT_PROBES as SECANT_PROBES
from remat_kit.recommend.search import SEQ_HALVINGS as SEQ_HALVINGS
from remat_kit.recommend.search import SOLVE_ROUNDS as SOLVE_ROUNDS
from remat_kit.recommend.search import SOLVE_VERIFY as SOLVE_VERIFY
from remat_kit.recommend.search import STRUCTURE_PROBES as STRUCTURE_PROBES
from remat_kit.recommend.search import BatchBracket as BatchBracket
from remat_kit.recommend.search import BudgetTooSmall as BudgetTooSmall
from remat_kit.recommend.search import choice_time as choice_time
from remat_kit.recommend.search import partial_probes as partial_probes
from remat_kit.recommend.search import solve_tags as solve_tags
from remat_kit.recommend.search import structure_compiles as structure_compiles
from remat_kit.recommend.search import tag_costs as tag_costs
from remat_kit.recommend.session import Candidate as Candidate
from remat_kit.recommend.session import CompileCache as CompileCache
from remat_kit.recommend.session import FoundBy as FoundBy
from remat_kit.recommend.session import Recommendation as Recommendation
from remat_kit.recommend.session import SolveSummary as SolveSummary
from remat_kit.recommend.session import TagCost as TagCost
from remat_kit.targets import host_link_source as host_link_source

__all__ = [
    "BATCH_PROBES",
    "BatchBracket",
    "BudgetTooSmall",
    "Candidate",
    "CompileCache",
    "DEFAULT_MARGIN",
    "DEVICE_COUNTS",
    "FoundBy",
    "Recommendation",
    "SECANT_PROBES",
    "SEQ_HALVINGS",
    "SOLVE_ROUNDS",
    "SOLVE_VERIFY",
    "STRUCTURE_PROBES",
    "SolveSummary",
    "TagCost",
    "choice_time",
    "host_link_source",
    "parse_budget",
    "partial_probes",
    "recommend",
    "solve_tags",
    "structure_compiles",
    "tag_costs",
]
