"""The measurer of a preset grid's measured points (:class:`TextMeasurer`): each point's
training step run on the local device from its initial state on batches of real text."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainer.data import Corpus, load_corpus

from remat_kit.memory.runner import CompileEngine
from remat_kit.policies import parse_policy_arg
from remat_kit.program import Program
from remat_kit.sweep.config import Point

from .steps import PresetRun, StepRun, host_state, lower_mesh_step, run_and_time


class TextMeasurer:
    """Runs and times measured preset points (a :class:`remat_kit.sweep.run.Measurer`): the
    point's initial state (:func:`~measured.steps.host_state`, once per model in each process),
    batch ``i`` from the corpus (:meth:`trainer.data.Corpus.batcher`), the state donated and fed
    back; the step that runs is the analyzer's executable.

    Args:
      data: text file or folder; None: the Python standard library's source
        (:func:`trainer.data.load_corpus`).
      max_data_bytes: cap on the corpus size in bytes (None: the loader's default).

    Pickled to each process that runs tasks without its caches (corpus, initial states): each
    process loads its own.
    """

    def __init__(
        self, data: str | os.PathLike[str] | None = None, max_data_bytes: int | None = None
    ):
        self.data = None if data is None else str(data)
        self.max_data_bytes = max_data_bytes
        self._corpus: Corpus | None = None
        self._states: dict = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data, "max_data_bytes": self.max_data_bytes}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.__init__(state["data"], state["max_data_bytes"])

    def corpus(self) -> Corpus:
        """The corpus (loaded at the first call in this process).

        Raises:
          ValueError: a missing, empty or binary data path.
        """
        if self._corpus is None:
            self._corpus = load_corpus(self.data, max_bytes=self.max_data_bytes)
        return self._corpus

    def fields(self) -> dict[str, Any]:
        """The corpus's description, in every row (:meth:`trainer.data.Corpus.info`)."""
        return self.corpus().info()

    def measure(
        self,
        points: Sequence[Point],
        program: Program,
        reports: Mapping[str, Any],
        engine: CompileEngine,
        advance: Callable,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Compile and time ``points`` (one group's, analysed in ``reports``) by key."""
        by_key = {p.key: p for p in points}
        corpus = self.corpus()

        def make_run(key: str, program: Program, compiled: Any) -> StepRun:
            point = by_key[key]
            return PresetRun(point, compiled, corpus, host_state(point, self._states))

        lower = None
        if points[0].mesh is not None:
            lower = lambda key: lower_mesh_step(by_key[key], self._states)  # noqa: E731
        specs = {p.key: parse_policy_arg(p.policy) for p in points}
        what = points[0].label.rsplit(" ", 2)[0]
        return run_and_time(program, specs, reports, engine, make_run, advance, what, lower)
