"""``recommend``: the fastest remat configuration that fits a memory budget, verified by compiling.

Every configuration considered is compiled for the target (deviceless for GPU models, see
:mod:`remat_kit.targets`) by :func:`remat_kit.memory.analyze_policies`; its peak is XLA's own
figure and its FLOPs the compiled program's. Nothing is recommended that was not compiled and
found to fit.

**Estimated step time** (seconds), per candidate: the compiled report's roofline estimate
(``MemoryReport.step_time_s``, :mod:`remat_kit.memory.roofline`): over every kernel the compiled
step runs (loop bodies times their trip counts), ``max(matmul FLOPs / peak for their dtype,
bytes / memory bandwidth, elementwise work / vector rate) + launch``, plus host transfers and
collectives the schedule cannot hide; device figures from the target's datasheet, or
calibrated on the local device (:func:`remat_kit.memory.roofline.device_figures`). ``solve``
predicts choices it has not compiled on the same scale: the compiled save-nothing's estimate
less the recomputation a choice keeps (:func:`choice_time`). Host-link figures:
:func:`host_link_source`.

FLOPs basis across ``attention`` choices: the compiled FLOPs (:mod:`remat_kit.memory.hlo`) count
the matmul work each program executes. XLA attention (einsum) computes the full [seq, seq]
scores, masked or not; cuDNN's fused attention call is counted by the same matmul formula,
halved under a causal mask and times 2.5 backward (FlashAttention-2, arXiv:2307.08691). The
roofline also prices the softmax and the HBM traffic of XLA's materialised scores, which the
fused kernel avoids.

**Search** (:func:`recommend`, stages in :mod:`remat_kit.recommend.api`):

1. The named policies (:func:`remat_kit.policy_names`) at the config's ``remat_group_size``,
   compiled together (programs the analyzer finds identical compile once).
2. Other group sizes k, bounded: grouping k blocks into one remat segment drops the saved inputs of
   the inner blocks and recomputes at least as much, so a policy is compiled at k only if it does
   not fit at the base group size, is faster there than the best fit so far, and
   ``peak - (1 - k0/k) * (segment-input bytes)`` would fit.
3. ``batch_size="auto"``: the largest batch that fits, per policy (peak is close to affine in the
   batch: extrapolate, compile, bracket, bisect), and the tokens per second each would give.
4. ``solve=True``: a per-tag choice (recompute, save, offload), found by enumerating every
   combination (3^9 = 19,683 for a SwiGLU block) under an additive model, then verified by
   compiling, predicted-fastest first, those that could still beat the pick at the model's
   error observed on the compiles so far (see :func:`solve_tags`).
5. ``structure`` (fixed batch; on by default when ``policies`` is not given): when nothing fits,
   cuDNN flash attention (where the target has it), then chunked cross-entropy, then both,
   then nested remat (sqrt(L) checkpointed groups of layers), alone and with the others, on
   the candidates closest to fitting; when a full-remat policy fits with room, the least number
   of layers under it (the first k of L, the rest not rematerialised) that still fits, by
   secant and bisection over k until k fits and k - 1 does not
   (:mod:`remat_kit.recommend.search`). The pick's options are
   in the line to paste (``get_config(..., attention="cudnn", remat_layers=24, ...)``) and
   ``Recommendation.made_fit`` says what they did, against the same policy compiled without.
6. Nothing fits: a shorter sequence (compiled), a smaller batch (compiled) and more devices
   (estimated) that would.

The pick is the fitting candidate with the least estimated step time (ties, as when offload
transfers hide completely: no host traffic first, then less device memory); with ``"auto"``, the
one with the most tokens per second.

Where each part lives:

=====================  ==========================================================================
``types``              :class:`Candidate`, :class:`TagCost`, :class:`SolveSummary`,
                       :class:`Recommendation`, the ranking (least estimated time)
``budget``             :func:`parse_budget`, the default budget and :data:`DEFAULT_MARGIN`
``session``            the compile session and :class:`CompileCache`
``search``             stage 2 (group sizes) and stage 3 (:class:`BatchBracket`, largest batch)
``solver``             stage 4 (:func:`tag_costs`, :func:`solve_tags`, :func:`choice_time`)
``structure``          stage 5 (attention, chunked loss, nested and partial-layer remat)
``advice``             stage 6 (nothing fits)
``api``                :func:`recommend_program` on any :class:`~remat_kit.Program` (the
                       searches that vary the model where it varies: a preset), a short
                       sequence of named stages; :func:`recommend` reads a preset name into one
=====================  ==========================================================================

The command line (``remat-kit recommend``: arguments and rendering) is
:mod:`remat_kit.cli.recommend`; this package never imports the CLI.

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
