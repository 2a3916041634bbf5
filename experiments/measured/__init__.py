"""The measuring harness: sweep points run and timed on the local device.

Not part of the ``remat_kit`` library (experiment machinery, like ``trainer``): imported as
``measured`` with ``experiments/`` on ``sys.path`` (a script in ``experiments/`` has its own
folder there; tests insert it). The library's sweep analyses
(:func:`remat_kit.sweep.run_sweep`); this package gives it a measurer and sweeps a user's
program:

- :class:`TextMeasurer`: a preset grid's measured points, trained on real text
  (``run_sweep(config, out, measurer=TextMeasurer(data))``);
- :func:`run_program_sweep`: a user's :class:`~remat_kit.program.Program` under each policy;
- :mod:`measured.steps`: the executable, its arguments placed, its steps timed.

How a step is timed: docs/sweep.md ("Timing").
"""

from .program import run_program_sweep as run_program_sweep
from .text import TextMeasurer as TextMeasurer

__all__ = ["TextMeasurer", "run_program_sweep"]
