"""Loading a user's program from ``MODULE:FACTORY`` or ``FILE.py:FACTORY`` (the CLI's
``--model``)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from remat_kit.program import Program
from remat_kit.validation import unknown_value_error

_BUILDS = frozenset({"Program", "from_loss", "from_step", "preset"})


def _factories(module: Any) -> list[str]:
    """Names in ``module`` that could be a factory: its :class:`Program` objects and the
    functions defined there (not imported) callable with no arguments, those whose code names
    ``Program`` / ``from_loss`` / ``from_step`` / ``preset`` where any does (not a helper
    returning the abstract arguments, which the error listed as valid)."""
    programs, builders, others = [], [], []
    for n, obj in vars(module).items():
        if n.startswith("_"):
            continue
        if isinstance(obj, Program):
            programs.append(n)
        if not inspect.isfunction(obj) or obj.__module__ != module.__name__:
            continue
        try:
            inspect.signature(obj).bind()
        except TypeError:
            continue
        (builders if _BUILDS & set(obj.__code__.co_names) else others).append(n)
    return sorted(programs + (builders or others))


def require_program(obj: Any, error: Callable[[], str] | None = None) -> Program:
    """``obj`` if it is a :class:`Program` (the tools take nothing else).

    Args:
      error: the message for anything else, made only then (default: how to make a Program).

    Raises:
      ValueError: anything else (one line saying how to make a Program).
    """
    if not isinstance(obj, Program):
        raise ValueError(
            error()
            if error is not None
            else f"expected a remat_kit.Program (Program.from_loss / Program.from_step, or "
            f"remat_kit.preset(name, batch_size, seq_len) for a bundled model), got "
            f"{type(obj).__name__}"
        )
    return obj


def _on_path(folder: str) -> None:
    """Put ``folder`` on ``sys.path`` (first) where it is not yet."""
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _syntax_error(err: SyntaxError, ref: str) -> str:
    """One line for a program file Python cannot parse: file, line, column and its message
    (an error in the code it runs is the user's traceback to read, and is not caught)."""
    where = f"{err.filename}, line {err.lineno}" + (f", column {err.offset}" if err.offset else "")
    return f"cannot load {ref!r}: {type(err).__name__} in {where}: {err.msg}"


def load_program(ref: str) -> Program:
    """The :class:`Program` a reference names: ``"pkg.module:factory"`` or
    ``"path/to/file.py:factory"``, where ``factory()`` (no arguments) returns a Program.

    As Python runs a script, the file's folder (``FILE.py``) or the current folder
    (``MODULE``) is put on ``sys.path`` first, so the program's sibling modules import.

    This is how the command line takes a user's model (``remat-kit analyze --model
    my_models.gpt:program``) beside the bundled preset names.

    Raises:
      ValueError: ``ref`` without ``:`` (for ``FILE.py``, naming its factories), a module or
        file that cannot be found or imported, a file Python cannot parse (``SyntaxError``: file
        and line in one line), a missing factory, a factory that raises (its exception
        chained) or that does not return a Program (one line naming which).

    A program left with its default name (its loss or step function's, often ``make_loss``)
    is named ``FILE:FACTORY`` (``gpt:program``) in reports; a name given to ``from_loss`` /
    ``from_step`` other than that function's is kept.
    """
    module_ref, sep, attr = ref.rpartition(":")
    if not sep and ref.endswith(".py"):  # a file without its factory: name the ones it has
        found = ", ".join(_factories(_import_module(ref, ref)))
        has = f"valid factories in it: {found}" if found else (
            "it defines none (a function of no arguments returning a Program)")  # fmt: skip
        raise ValueError(f"{ref!r} names a file, not its factory: write FILE.py:FACTORY; {has}")
    if not sep or not module_ref or not attr:
        raise ValueError(
            f"cannot read {ref!r} as a program: write MODULE:FACTORY (my_pkg.models:program) or "
            "FILE.py:FACTORY (models/gpt.py:program), or give a preset name"
        )
    module = _import_module(ref, module_ref)
    obj, called = _from_factory(ref, module_ref, attr, module)

    def error() -> str:
        if called:
            return (
                f"{ref} returned {type(obj).__name__}, not a remat_kit.Program; return "
                "Program.from_loss(...) or Program.from_step(...)"
            )
        valid = ", ".join(_factories(module)) or "(none)"
        return (
            f"{module_ref}: {attr!r} is a {type(obj).__name__}, not a factory (a function "
            f"returning a remat_kit.Program) or a Program; valid: {valid}."
        )

    program = require_program(obj, error)
    defaulted = {getattr(f, "__name__", None) for f in (program.make_loss, program.make_step)}
    if program.name in defaulted | {"program"}:  # named after a function (from_loss's default,
        # often ``make_loss``): the reports name it as the user named it instead
        stem = os.path.splitext(os.path.basename(module_ref))[0]
        program = dataclasses.replace(program, name=f"{stem}:{attr}")
    return program


def _import_module(ref: str, module_ref: str) -> Any:
    """The module ``module_ref`` of program reference ``ref`` (a ``.py`` file or a module
    name), imported with its folder on ``sys.path``."""
    if module_ref.endswith(".py"):
        path = os.path.abspath(module_ref)
        if not os.path.isfile(path):
            raise ValueError(f"program file {module_ref!r} does not exist (from {ref!r})")
        name = f"_remat_kit_user_{os.path.splitext(os.path.basename(path))[0]}"
        _on_path(os.path.dirname(path))  # its sibling modules import, as `python FILE.py` has
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except SyntaxError as err:  # the file cannot run at all: where, in one line
            raise ValueError(_syntax_error(err, ref)) from None
        return module
    _on_path(os.getcwd())  # as `python -m` has it: modules of the folder it runs from
    try:
        module = importlib.import_module(module_ref)
    except SyntaxError as err:
        raise ValueError(_syntax_error(err, ref)) from None
    except ModuleNotFoundError as err:
        if err.name and module_ref.startswith(err.name):
            raise ValueError(
                f"cannot import module {module_ref!r} (from {ref!r}): not on the Python path; "
                "run from its folder, set PYTHONPATH, or give a FILE.py:FACTORY path"
            ) from None
        raise
    return module


def _from_factory(ref: str, module_ref: str, attr: str, module: Any) -> tuple[Any, bool]:
    """What the factory ``attr`` of ``module`` returns (called with no arguments), or what the
    name holds when it is not callable (a Program constant); and whether it was called."""
    factory = getattr(module, attr, None)
    if factory is None:
        found = _factories(module)
        bad = unknown_value_error("factory", attr, found or ["(none)"])
        raise ValueError(f"{module_ref}: {bad}")
    if not callable(factory):  # a Program constant, or a module or value: nothing to call
        return factory, False
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ValueError(
            f"{ref}: the factory must take no arguments (remat-kit calls {attr}()); wrap it, "
            "e.g. def program(): return Program.from_loss(...)"
        ) from None
    except ValueError:  # no signature (a builtin): just call it
        pass
    try:
        return factory(), True
    except Exception as err:  # the user's code: one line naming it (the cause chained)
        first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
        raise ValueError(
            f"{ref}: the factory raised {type(err).__name__}" + (f": {first}" if first else "")
        ) from err
