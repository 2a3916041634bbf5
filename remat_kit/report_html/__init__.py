"""One page to look at: a self-contained, offline, interactive HTML report of policies.

``write_report(path, groups)`` writes one HTML file (no CDN, no server) holding, per group of
compared policies: the sortable policy table (peak, host bytes, estimated and measured step
time, FLOPs ratio, fits; unknown figures show as ``—``, never 0), the memory-vs-time trade-off,
the selected policy's live-bytes timeline by category with the buffers under the pointer, its
buffers at the peak, residuals by tag, the doctor's findings and notes, and two policies side by
side (:func:`remat_kit.memory.diff.diff_reports`). The header names the targets, the machine,
the backend, the jax version and the command. Step times are in ms. Made by ``remat-kit analyze
... --html``, ``remat-kit recommend ... --html`` and the sweep (``report.html``). Plotting:
plotly, inlined once (why, and the page's size: docs/report.md).

Modules: :mod:`~remat_kit.report_html.entries` (what is shown: :class:`Entry`, :class:`Group`,
built from reports, sweep rows or a recommendation), :mod:`~remat_kit.report_html.page` (the
figures and the file), ``page.js`` / ``page.css`` (the page's script and style).
"""

from remat_kit.report_html.entries import Entry as Entry
from remat_kit.report_html.entries import Group as Group
from remat_kit.report_html.entries import entry_of_report as entry_of_report
from remat_kit.report_html.entries import group_of_recommendation as group_of_recommendation
from remat_kit.report_html.entries import group_of_reports as group_of_reports
from remat_kit.report_html.entries import groups_of_rows as groups_of_rows
from remat_kit.report_html.page import render as render
from remat_kit.report_html.page import write_report as write_report
