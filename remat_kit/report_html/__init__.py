"""One page to look at: a self-contained, offline, interactive HTML report of policies.

``write_report(path, groups)`` writes one HTML file (no CDN, no server: open it by double-click)
holding, per group of compared policies: the policy table (sortable: peak, host bytes,
estimated and measured step time, FLOPs ratio, fits; unknown figures show as ``—``, never 0);
the memory-vs-time trade-off (hover, click to select; the x axis is any of estimated step time,
measured step time and the FLOPs ratio that some entry has); for the selected policy its
live-bytes timeline stacked by category (hover lists the buffers live at that point: name,
checkpoint tag, dtype, shape, bytes, op), the buffers at the peak, the residuals by tag, the
doctor's findings and the notes; and two policies side by side
(:func:`remat_kit.memory.diff.diff_reports` and both timelines). The header names the targets
the groups were compiled for, the machine, the backend, the jax version and the command that made
it. Step times are in ms everywhere on the page; every plot has a legend, and its title sits under
plotly's toolbar.

Made by ``remat-kit analyze ... --html report.html``, ``remat-kit recommend ... --html``, and
the sweep (``report.html`` beside its rows).

Plotting library: plotly (plotly.py builds the figures; plotly.js is inlined once). Chosen for
its stacked-area traces with a unified hover, and its ``plotly_click`` / ``plotly_hover``
events, which the page's small script uses to select a policy and to list the buffers live at
the pointer; figures built in Python are swapped by ``Plotly.newPlot`` without a server. The
cost is size: plotly.js (plotly 7.1) is 4.8 MB, so a page is about 5 MB plus its data
(bokeh's core bundle is 1.3 MB, but needs its widgets and tables bundles and CustomJS
callbacks for the same page). Measured: the README's example (llama3-8b b=1 s=8192 on
h100-sxm, 13 policies) is given with its size in ``docs/report.md``.

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
