"""``remat-kit doctor``: catch the rematerialization failures that raise nothing today.

A remat policy that does not do what it promises fails silently: memory simply does not go down.
:func:`check` compares the promise (tags to save, to offload, the rest recomputed) with what
happens: the tags present in the traced program (every nested jaxpr walked by
:mod:`remat_kit.walker`), the saved residuals by tag and memory kind (from the jaxpr), and the
<<<<<<< HEAD
compiled memory and FLOPs of the step against the same step compiled with ``no-remat``. Each
:class:`Finding` is one line: what is wrong, the likely cause, the fix.

Finding codes (severity):

- ``unknown-tag`` (error): the policy names checkpoint names the program never emits; it saves
  or offloads nothing for them (one finding per policy: each name with the closest emitted one,
  and what the policy runs as). Without a policy list, a user's program is checked only with the
  policies that act on its names (:func:`check_policies`); the others are one note.
- ``tag-not-emitted`` (info): a registered policy names checkpoint names the program does not
  emit beside names it does (``minimal`` names ``value_proj``; a model fusing its key and value
  projections tags ``key_proj`` alone): it acts on those it emits, as analyze's note says. A
  name in the user's own spec that the program never emits stays an ``unknown-tag`` error, and
  so does a registered policy none of whose names the program emits.
- ``no-remat-segment`` (error): the step traced under the policy holds no remat segment (no
  ``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat``): the user's factory does not apply the
  policy it receives. The only finding for that policy (nothing else follows from a policy
  never applied); such a policy is not compiled.
- ``policy-not-passed`` (error): the step holds remat segments but none takes the policy the
  factory receives (a model calling ``nn.remat`` / ``jax.checkpoint`` itself without
  ``policy=``, as Hugging Face's Flax models do): every policy is the same program. The fix
  names :func:`remat_kit.inject_policy`. Judged once per program
  (:func:`remat_kit.reach.policy_reach`), as ``analyze`` and ``recommend`` judge it.
- ``no-remat-remats`` (error): the ``no-remat`` row still rematerializes: the factory builds
  remat segments when given None (``jax.checkpoint(layer, policy=None)`` saves nothing, as
  MaxText's scanned ``remat_policy='none'`` builds it), so the row is no step without remat
  (``analyze`` warns under the same row).
- ``no-op-policy`` (error; a warning for a policy of the default set, which the user did not
  ask for): the compiled step needs as much memory as without remat (its fix never names the
  policy being checked).
- ``remat-around-loop`` (error): the policy frees little or adds memory because a remat segment
  wraps a whole ``lax.scan`` / ``while`` loop rather than its body: the backward pass re-runs the
  loop and stacks every iteration's residuals again (jax#27748, jax#3186); the fix checkpoints
  the body. ``analyze`` gives the same cause in its warning.
- ``name-kept-nowhere`` (warning): a user's policy keeps some of its names but not these (the
  backward pass does not need them even without remat, e.g. a scan's carry, jax#23869; or they
  are applied outside every remat segment): that part of the policy does nothing.
- ``cse-undid-remat`` (error): the jaxpr recomputes, but the compiled program does not (no
  operation of it recomputes, or no FLOPs over no-remat): XLA merged the recomputation back into
  the forward pass (CSE).
- ``cse-undid-part-of-remat`` (warning): XLA's CSE merged part of the recomputation back (the
  analyzer's warning, :func:`remat_kit.memory.runner.cse_undone`).
- ``acts-as-full-remat`` (error): the policy promises to keep tensors it names (and the program
  emits) but keeps none; the cause says whether they are applied outside every remat segment
  (stored or not regardless of the policy) or not needed by the backward pass at all; the fix
  lists the names whose saving removes recompute (matmul outputs first).
- ``save-removes-no-recompute`` (info): the policy keeps on device a name whose saving
  does not lower the step's traced matmul FLOPs, alone or beside the names the policy keeps
  with it (a name applied after an activation: the activation's derivative needs the matmul
  output before it, recomputed all the same; K and V cut from one einsum spare it only
  together, and are not flagged together): memory spent to spare elementwise work only (a fair
  trade where that work is costly, such as a softmax; not where memory is what is short).
  Judged as the solver's per-tag costs and the fixes above are
  (:func:`remat_kit.doctor.tags.recompute_savers`), then within the policy.
- ``saved-anyway`` (warning when it is all the policy does, else info): the policy saves a
  name that save-nothing keeps as much of (the input of a remat segment, a scan's carry, or a
  name applied outside every segment): naming it changes nothing, and a policy doing only that
  compiles to save-nothing's program.
- ``remat3-full-remat`` (error): ``jax_remat3`` is on and runs the policy as full remat (it
  honours name-set policies ``save_only_these_names`` / ``save_any_names_but_these``,
  ``everything_saveable`` and the dots policies; offload policies put nothing on host in jax
  0.10.2). For a remat-kit policy this is the verdict of a traced probe
  (:func:`remat_kit.policies.policy_effect`), with its cause and fix.
- ``runs-as-other`` (error): the remat implementation in use runs a remat-kit policy as
  something other than full remat and other than its name (the probe's verdict).
- ``saves-everything`` (error): ``save_anything_except_these_names`` (a JAX regression: it saves
  every value).
- ``composed-policy`` (warning; error under ``jax_remat3``): a policy built from callables.
- ``offload-no-host-bytes`` (error): an offload policy on a target with host memory puts nothing
  in host memory.
- ``offload-no-device-saving`` (warning): bytes move to host memory but the device peak does not
  go down (compared with the same policy keeping those tensors on device); the fix says
  whether keeping them on device gives a lower or the same peak, with both figures.
- ``offload-ignored`` (info): the backend ignores host offload (XLA:CPU).
- ``static-argnums-self`` (error): ``nn.remat(..., static_argnums=...)`` on a linen module
  counts ``self`` as argument 0; an index pointing at ``self``, an array or past the arguments
  is off by one.

A factory that builds remat even when given None (``jax.checkpoint(layer, policy=policy)`` with
no ``if policy is None``) has no step without remat: each policy is then judged against
``save-everything`` (``everything_saveable``), which keeps what no remat keeps, and the notes
say so; its ``no-remat`` row gets the ``no-remat-remats`` error.
=======
compiled memory and FLOPs of the step against the same step compiled with ``no-remat`` (or
against ``save-everything`` when the factory builds remat even for None). Each :class:`Finding`
is one line: what is wrong, the likely cause, the fix. The finding codes, their severities and
causes are listed in docs/doctor.md ("Finding codes").
>>>>>>> docs

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
