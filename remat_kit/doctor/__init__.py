"""``remat-kit doctor``: catch the rematerialization failures that raise nothing today.

A remat policy that does not do what it promises fails silently: memory simply does not go down.
:func:`check` compares the promise (tags to save, to offload, the rest recomputed) with what
happens: the tags present in the traced program (every nested jaxpr walked by
:mod:`remat_kit.walker`), the saved residuals by tag and memory kind (from the jaxpr), and the
compiled memory and FLOPs of the step against the same step compiled with ``no-remat`` (or
against ``save-everything`` when the factory builds remat even for None). Each :class:`Finding`
is one line: what is wrong, the likely cause, the fix. The finding codes, their severities and
causes are listed in docs/doctor.md ("Finding codes").

Sources: JAX doc "Gradient checkpointing with jax.checkpoint"; ``jax/_src/ad_checkpoint.py``
(remat3); flax.linen.remat docstring.
"""

from remat_kit.doctor.checks import PolicyCheck as PolicyCheck
from remat_kit.doctor.checks import ProgramCheck as ProgramCheck
from remat_kit.doctor.checks import check as check
from remat_kit.doctor.checks import check_function as check_function
from remat_kit.doctor.checks import check_policies as check_policies
from remat_kit.doctor.checks import recomputed_ops as recomputed_ops
from remat_kit.doctor.compare import MIN_EFFECT as MIN_EFFECT
from remat_kit.doctor.compare import PolicyEvidence as PolicyEvidence
from remat_kit.doctor.compare import Residuals as Residuals
from remat_kit.doctor.compare import check_remat_static_argnums as check_remat_static_argnums
from remat_kit.doctor.compare import compare as compare
from remat_kit.doctor.findings import SAME as SAME
from remat_kit.doctor.findings import Finding as Finding
from remat_kit.doctor.findings import has_errors as has_errors
from remat_kit.doctor.promise import Promise as Promise
from remat_kit.doctor.promise import describe_callable as describe_callable
from remat_kit.doctor.promise import remat3_honours as remat3_honours
from remat_kit.doctor.promise import resolve_policy as resolve_policy
from remat_kit.doctor.tags import TagFacts as TagFacts
from remat_kit.walker import emitted_tags as emitted_tags
