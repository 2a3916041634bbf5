"""Tag a model that carries no ``checkpoint_name`` tags, without editing its source.

A name-based policy does nothing on a model whose tensors carry no names (it silently equals
``save-nothing``). These helpers name the outputs of chosen submodules: :func:`tag_linen` (a
``flax.linen.intercept_methods`` interceptor around ``model.apply``), :func:`tag_nnx` and
:func:`tag_eqx` (matching submodules given a subclass whose ``__call__`` tags its output;
parameters unchanged). Patterns are :mod:`fnmatch` globs on the ``/``-joined module path (linen:
``"Decoder_0/layers_3/MlpBlock_0/Dense_0"``; nnx: ``"blocks/3/mlp/linear1"``; equinox:
``"blocks/3/mlp"``); a pattern that matches no module is an error naming the model's paths.

Example::

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> class Mlp(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))
    >>> model = Mlp()
    >>> params = model.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> apply = tag_linen(model.apply, {"Dense_0": "mlpwi"})
    >>> policy = jax.checkpoint_policies.save_only_these_names("mlpwi")
    >>> loss = jax.checkpoint(lambda p, x: apply(p, x).sum(), policy=policy)
    >>> float(jax.grad(loss)(params, jnp.ones((2, 4)))["params"]["Dense_0"]["bias"].sum()) != 0
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from remat_kit.names import validate_name

__all__ = ["tag_eqx", "tag_linen", "tag_nnx"]


def _check_mapping(mapping: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(
            f"tags must be a non-empty mapping {{module path pattern: checkpoint name}}, got "
            f"{mapping!r}"
        )
    out = {}
    for pattern, tag in mapping.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"module path pattern must be a non-empty string, got {pattern!r}")
        out[pattern] = validate_name(tag)
    return out


def _tag_for(path: str, mapping: Mapping[str, str]) -> tuple[str, str] | None:
    """The first ``(pattern, tag)`` whose pattern matches ``path``."""
    for pattern, tag in mapping.items():
        if fnmatch.fnmatchcase(path, pattern):
            return pattern, tag
    return None


def _tag_tree(tree: Any, tag: str) -> Any:
    """``checkpoint_name`` on every array leaf of ``tree``."""
    return jax.tree.map(lambda x: checkpoint_name(x, tag) if hasattr(x, "dtype") else x, tree)


def _unmatched_error(pattern: str, paths: Iterable[str]) -> ValueError:
    """One line: the pattern, the closest module paths, and a sample of the model's paths."""
    paths = sorted(set(paths))
    if not paths:
        return ValueError(f"module path pattern {pattern!r} matches no module: the model has none")
    near = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.3)
    shown = paths if len(paths) <= 12 else [*paths[:12], "..."]
    hint = f" closest: {', '.join(near)};" if near else ""
    return ValueError(
        f"module path pattern {pattern!r} matches no module;{hint} the model's {len(paths)} "
        f"module paths: {', '.join(shown)}"
    )


def tag_linen(apply: Callable[..., Any], tags: Mapping[str, str]) -> Callable[..., Any]:
    """Wrap a linen ``model.apply`` so submodule outputs carry checkpoint names while it runs.

    Args:
      apply: a flax.linen ``Module.apply`` (bound method) or any function that calls linen
        modules.
      tags: ``{module path glob: checkpoint name}``; the output of ``__call__`` of every submodule
        whose ``/``-joined path matches is tagged (every array leaf of it). The first matching
        pattern wins.

    Returns:
      A function with ``apply``'s signature and results; under ``jax.checkpoint`` /
      ``nn.remat`` / ``nnx.remat`` a name policy can then save or offload those outputs.

    Raises:
      ValueError: an empty mapping, a bad pattern or tag; when called, a pattern that matched no
        submodule (the message lists the module paths seen in that call, closest first).
    """
    mapping = _check_mapping(tags)

    @functools.wraps(apply)
    def tagged(*args: Any, **kwargs: Any) -> Any:
        seen: set[str] = set()
        used: set[str] = set()

        def interceptor(next_fun, f_args, f_kwargs, context):
            out = next_fun(*f_args, **f_kwargs)
            if context.method_name != "__call__" or context.module.scope is None:
                return out
            path = "/".join(str(p) for p in context.module.scope.path)
            if not path:
                return out
            seen.add(path)
            hit = _tag_for(path, mapping)
            if hit is None:
                return out
            used.add(hit[0])
            return _tag_tree(out, hit[1])

        with nn.intercept_methods(interceptor):
            result = apply(*args, **kwargs)
        for pattern in mapping:
            if pattern not in used:
                raise _unmatched_error(pattern, seen)
        return result

    return tagged


@functools.cache
def _tagged_class(cls: type, tag: str) -> type:
    """A subclass of nnx module class ``cls`` whose ``__call__`` tags its output ``tag``
    (cached: one class per (class, tag), so graph definitions stay equal across calls)."""

    def __call__(self, *args, **kwargs):
        return _tag_tree(cls.__call__(self, *args, **kwargs), tag)

    attrs = {"__call__": __call__, "__module__": cls.__module__, "_remat_kit_tag": tag}
    return type(cls.__name__, (cls,), attrs)


def tag_nnx(model: nnx.Module, tags: Mapping[str, str]) -> nnx.Module:
    """Tag the outputs of submodules of an NNX model, in place.

    Args:
      model: a ``flax.nnx.Module``.
      tags: ``{module path glob: checkpoint name}`` on the ``/``-joined paths of
        ``model.iter_modules()`` (e.g. ``"blocks/*/mlp/linear1"``); the first matching pattern
        wins. A submodule is tagged once (tagging again with another name raises).

    Returns:
      ``model`` (the same object), for chaining.

    Raises:
      ValueError: a pattern that matches no submodule (the message lists the model's module
        paths), a bad pattern or tag, a submodule already tagged with another name.
    """
    mapping = _check_mapping(tags)
    if not isinstance(model, nnx.Module):
        raise ValueError(f"tag_nnx takes a flax.nnx.Module, got {type(model).__name__}")
    modules = {"/".join(str(p) for p in path): m for path, m in _iter_modules(model) if path}
    for pattern in mapping:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in modules):
            raise _unmatched_error(pattern, modules)
    for path, module in modules.items():
        hit = _tag_for(path, mapping)
        if hit is None:
            continue
        tagged_as = getattr(type(module), "_remat_kit_tag", None)
        if tagged_as is not None:
            if tagged_as != hit[1]:
                raise ValueError(
                    f"module {path!r} is already tagged {tagged_as!r}; cannot tag it {hit[1]!r}"
                )
            continue
        module.__class__ = _tagged_class(type(module), hit[1])
    return model


def _iter_modules(model: nnx.Module):
    """``(path, module)`` pairs of every submodule (flax renamed iter_modules over versions)."""
    it = getattr(nnx, "iter_modules", None)
    if it is not None:
        return it(model)
    return model.iter_modules()


def tag_eqx(model: Any, tags: Mapping[str, str]) -> Any:
    """An equinox model whose matching submodules tag their outputs.

    The result is a new model with the same arrays (``model`` is unchanged): each matching
    submodule is an instance of a subclass of its class whose ``__call__`` applies
    ``checkpoint_name`` to its output. The class is part of the static pytree structure, so a layer
    stack rebuilt with ``eqx.combine`` inside ``lax.scan`` is tagged too.

    Args:
      model: an ``equinox.Module``.
      tags: ``{module path glob: checkpoint name}`` on ``/``-joined attribute names and list /
        tuple indices / dict keys (``"blocks/*/attention/query_proj"``); the first match wins.

    Returns:
      The tagged model.

    Raises:
      ValueError: ``model`` is not an equinox.Module; a pattern that matches no submodule (the
        message lists the model's module paths); a bad pattern or tag; a submodule already
        tagged with another name.
    """
    import equinox as eqx  # optional dependency: remat-kit[eqx]

    mapping = _check_mapping(tags)
    if not isinstance(model, eqx.Module):
        raise ValueError(f"tag_eqx takes an equinox.Module, got {type(model).__name__}")
    modules = {"/".join(map(str, path)): path for path, _ in _eqx_modules(model, eqx.Module, ())}
    modules.pop("", None)
    for pattern in mapping:
        if not any(fnmatch.fnmatchcase(p, pattern) for p in modules):
            raise _unmatched_error(pattern, modules)
    hits = [(path, _tag_for(name, mapping)) for name, path in modules.items()]
    hits = sorted(((p, h[1]) for p, h in hits if h is not None), key=lambda x: -len(x[0]))
    for path, tag in hits:  # deepest first: a parent is re-read with its tagged children
        module = _get_path(model, path)
        tagged_as = getattr(type(module), "_remat_kit_tag", None)
        if tagged_as is not None:
            if tagged_as != tag:
                raise ValueError(
                    f"module {'/'.join(map(str, path))!r} is already tagged {tagged_as!r}; "
                    f"cannot tag it {tag!r}"
                )
            continue
        tagged = object.__new__(_tagged_class(type(module), tag))
        for key, value in vars(module).items():
            object.__setattr__(tagged, key, value)
        model = eqx.tree_at(lambda m, path=path: _get_path(m, path), model, tagged)
    return model


def _eqx_modules(node: Any, module_type: type, path: tuple):
    """``(path, module)`` of every equinox module in ``node`` (pre-order), through module
    fields, lists, tuples and dicts."""
    if isinstance(node, module_type):
        yield path, node
        children = [(f.name, getattr(node, f.name, None)) for f in dataclasses.fields(node)]
    elif isinstance(node, (list, tuple)):
        children = list(enumerate(node))
    elif isinstance(node, dict):
        children = list(node.items())
    else:
        return
    for key, child in children:
        yield from _eqx_modules(child, module_type, (*path, key))


def _get_path(node: Any, path: tuple) -> Any:
    for key in path:
        node = node[key] if isinstance(node, (list, tuple, dict)) else getattr(node, key)
    return node
