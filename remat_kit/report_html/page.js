// remat-kit report: fills the page from the JSON in #report-data; the figures are plotly's.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const app = document.getElementById("app");
  const CONFIG = { displaylogo: false, responsive: true };
  const st = { g: 0, sel: null, sortCol: null, sortDir: 1, x: null, a: null, b: null };

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const k of kids.flat()) {
      if (k === null || k === undefined) continue;
      e.append(k instanceof Node ? k : document.createTextNode(String(k)));
    }
    return e;
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "—";
    const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [u, s] of units) if (Math.abs(n) >= s) return (n / s).toFixed(2) + " " + u;
    return n + " B";
  }

  function shortOp(op) {
    if (!op) return "—";
    const parts = op.split("/");
    return parts.slice(-2).join("/");
  }

  function table(head, rows, cls) {
    return el("table", { class: cls || "plain" },
      el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows.map((r) => el("tr", {}, r.map((c) => el("td", {}, c))))));
  }

  function group() { return DATA.groups[st.g]; }

  // A figure as written (page.py: the shared template and a timeline's x written once), whole.
  function whole(fig, extra) {
    const data = fig.x ? fig.data.map((t) => (t.x === undefined ? Object.assign({ x: fig.x }, t) : t)) : fig.data;
    const layout = Object.assign({}, fig.layout, extra || {});
    if (DATA.template && !layout.template) layout.template = DATA.template;
    return [data, layout];
  }

  function firstSelected(g) { // the lowest peak (with a report, where any has one)
    const anyReport = g.rows.some((r) => r.has_report);
    let best = -1;
    g.rows.forEach((r, i) => {
      if ((anyReport && !r.has_report) || r.error || r.cells[0][0] === null) return;
      if (best < 0 || r.cells[0][0] < g.rows[best].cells[0][0]) best = i;
    });
    return best < 0 ? 0 : best;
  }

  // -- The policy table (sortable; a click selects) -------------------------------------------
  function policyTable() {
    const g = group();
    const order = g.rows.map((_, i) => i);
    if (st.sortCol !== null) {
      const c = st.sortCol;
      const key = (i) => (c === 0 ? g.rows[i].label : g.rows[i].cells[c - 1][0]);
      order.sort((i, j) => {
        const a = key(i), b = key(j);
        if (a === null && b === null) return 0;
        if (a === null) return 1; // unknown last, whichever the direction
        if (b === null) return -1;
        return (a < b ? -1 : a > b ? 1 : 0) * st.sortDir;
      });
    }
    const head = el("tr", {}, g.columns.map((c, k) => el("th", {
      class: "sortable" + (st.sortCol === k ? (st.sortDir > 0 ? " asc" : " desc") : ""),
      onclick: () => {
        st.sortDir = st.sortCol === k ? -st.sortDir : 1;
        st.sortCol = k;
        document.getElementById("policy-table").replaceWith(policyTable());
      },
    }, c)));
    const body = el("tbody", {}, order.map((i) => {
      const r = g.rows[i];
      const cells = r.error
        ? [el("td", { class: "error", colspan: String(g.columns.length - 1) }, r.error)]
        : r.cells.map((c, k) => el("td", {
          class: "num" + (k === 5 && c[0] !== null ? (c[0] ? " yes" : " no") : ""),
        }, c[1]));
      return el("tr", {
        "data-index": String(i),
        class: (i === st.sel ? "selected" : "") + (r.has_report ? " clickable" : ""),
        onclick: () => select(i),
      }, el("td", { class: "label" }, r.label), cells);
    }));
    return el("table", { id: "policy-table", class: "policies" }, el("thead", {}, head), body);
  }

  // -- The trade-off scatter -------------------------------------------------------------------
  function drawScatter() {
    const g = group();
    const div = document.getElementById("scatter");
    if (!st.x) { div.textContent = "no figure to plot against the peak"; return; }
    const [data, layout] = whole(g.scatter[st.x]);
    Plotly.newPlot(div, data, layout, CONFIG).then(() => {
      highlight();
      div.on("plotly_click", (ev) => {
        const p = ev.points.find((q) => q.customdata !== undefined);
        if (p) select(p.customdata);
      });
    });
  }

  function highlight() {
    const div = document.getElementById("scatter");
    if (!div || !div.data) return;
    const ks = div.data.map((t, k) => (t.customdata ? k : -1)).filter((k) => k >= 0);
    if (!ks.length) return;
    const widths = ks.map((k) => div.data[k].customdata.map((i) => (i === st.sel ? 3 : 0)));
    const sizes = ks.map((k) => div.data[k].customdata.map((i) => (i === st.sel ? 16 : 11)));
    Plotly.restyle(div, { "marker.line.width": widths, "marker.size": sizes }, ks);
  }

  // -- The selected policy ---------------------------------------------------------------------
  function liveAt(d, pos) {
    if (!d.spans.length) {
      document.getElementById("live").replaceChildren(el("p", { class: "muted" },
        "this report keeps no buffer live ranges (written before they were kept): the stacked " +
        "areas only"));
      return;
    }
    const live = d.spans.filter((s) => s[0] <= pos && pos <= s[1]);
    const listed = live.slice(0, group().listed);
    const box = document.getElementById("live");
    box.replaceChildren(
      el("h3", {}, `live at schedule position ${pos}: ${live.length} of the ${d.spans.length} largest buffers` +
        (live.length > listed.length ? ` (largest ${listed.length} shown)` : "")),
      el("table", { class: "plain live" },
        el("thead", {}, el("tr", {}, ["bytes", "buffer", "category / tag", "dtype", "shape", "op (end)"]
          .map((h) => el("th", {}, h)))),
        el("tbody", {}, listed.map((s) => el("tr", { title: `${s[4]}: ${s[8] || "no op_name"}` },
          [fmtBytes(s[2]), s[3], s[5] || (s[4].startsWith("residual:") ? "—" : s[4]), s[6], s[7],
            shortOp(s[8])].map((c) => el("td", {}, c)))))));
  }

  function detail() {
    const g = group();
    const i = st.sel;
    const r = g.rows[i];
    const d = g.details[i];
    const box = document.getElementById("detail");
    const kids = [el("h2", { id: "detail-title" }, "selected: " + r.label)];
    if (d.error) kids.push(el("p", { class: "error" }, d.error));
    if (d.timeline) {
      kids.push(el("div", { class: "row" },
        el("div", { id: "timeline", class: "plot wide" }),
        el("div", { id: "live", class: "side" })));
    } else if (r.has_report) {
      kids.push(el("p", {}, "no timeline in this report (XLA wrote no live-range dump, or the report was written before timelines were kept)"));
    } else {
      kids.push(el("p", {}, "figures only: no compiled report kept for this entry"));
    }
    if (d.facts) kids.push(el("h3", {}, "figures"), table(["", ""], d.facts, "plain facts"));
    if (d.peak_buffers && d.peak_buffers.length)
      kids.push(el("h3", {}, "largest buffers live at the peak"),
        table(["buffer", "category / tag", "bytes", "dtype", "shape", "op"], d.peak_buffers));
    if (d.residuals && d.residuals.length)
      kids.push(el("h3", {}, "saved residuals by checkpoint tag (all layers, from the jaxpr)"),
        table(["tag", "count", "shape of one", "dtype", "memory", "bytes"], d.residuals));
    kids.push(el("h3", {}, "doctor findings"));
    if (d.findings === null) {
      kids.push(el("p", { class: "muted" }, "not checked (remat-kit analyze ... --html --doctor " +
        "runs the doctor's checks)"));
    } else if (!d.findings.length) {
      kids.push(el("p", { id: "no-findings" }, "the doctor found nothing wrong with this policy"));
    } else {
      kids.push(el("ul", { class: "findings" }, d.findings.map((f) => el("li", { class: f[0] },
        el("b", {}, `${f[0]} [${f[1]}] `), f[2], el("br"), "cause: ", f[3], el("br"), "fix: ", f[4]))));
    }
    if (d.notes.length) kids.push(el("h3", {}, "notes"), el("ul", {}, d.notes.map((n) => el("li", {}, n))));
    box.replaceChildren(...kids);
    if (d.timeline) {
      const div = document.getElementById("timeline");
      const [data, layout] = whole(d.timeline);
      Plotly.newPlot(div, data, layout, CONFIG).then(() => {
        div.on("plotly_hover", (ev) => liveAt(d, ev.points[0].x));
      });
      liveAt(d, d.peak_position);
    }
  }

  function select(i) {
    const g = group();
    if (i === null || i === undefined || i < 0 || i >= g.rows.length) return;
    st.sel = i;
    document.querySelectorAll("#policy-table tbody tr").forEach((tr) =>
      tr.classList.toggle("selected", Number(tr.dataset.index) === i));
    highlight();
    detail();
  }

  // -- Two policies side by side ---------------------------------------------------------------
  function compare() {
    const g = group();
    const box = document.getElementById("compare-body");
    const a = st.a, b = st.b;
    if (a === null || b === null || a === b) {
      box.replaceChildren(el("p", { class: "muted" }, "pick two different policies"));
      return;
    }
    const key = a < b ? `${a},${b}` : `${b},${a}`;
    const d = g.diffs[key];
    const kids = [];
    if (!d) {
      kids.push(el("p", { class: "muted" }, "no diff for this pair (figures only, or not precomputed)"));
    } else {
      const flip = a > b;
      let section = null;
      const rows = [];
      for (const r of d.rows) {
        if (r[0] !== section && r[0]) rows.push([el("b", {}, r[0]), "", "", ""]);
        section = r[0];
        let [va, vb, ch] = [r[2], r[3], r[4]];
        if (flip) {
          [va, vb] = [vb, va];
          ch = ch.startsWith("+") ? "−" + ch.slice(1) : ch.startsWith("−") ? "+" + ch.slice(1) : ch;
        }
        rows.push([r[1], va, vb, ch]);
      }
      kids.push(table(["", g.rows[a].label, g.rows[b].label, "change"], rows, "plain diff"));
      if (d.moved.length) kids.push(el("p", {}, "moved between device and host: " + d.moved.join("; ")));
    }
    kids.push(el("div", { class: "row" }, el("div", { id: "cmp-a", class: "plot half" }),
      el("div", { id: "cmp-b", class: "plot half" })));
    box.replaceChildren(...kids);
    const drawn = [];
    for (const [id, i] of [["cmp-a", a], ["cmp-b", b]]) {
      const t = g.details[i].timeline;
      const div = document.getElementById(id);
      // the legend below the plot: half a row is narrow
      const below = { height: 560, legend: { orientation: "h", yanchor: "top", y: -0.22, font: { size: 10 } },
        margin: Object.assign({}, t && t.layout.margin, { b: 170 }) };
      if (t) drawn.push(Plotly.newPlot(div, ...whole(t, below), CONFIG));
      else div.textContent = "no timeline for " + g.rows[i].label;
    }
    Promise.all(drawn).then((divs) => { // one y range for both, so heights compare
      if (divs.length < 2) return;
      const top = Math.max(...divs.map((d) => d._fullLayout.yaxis.range[1]));
      divs.forEach((d) => Plotly.relayout(d, { "yaxis.range": [0, top] }));
    });
  }

  function picker(id, which) {
    const g = group();
    return el("select", {
      id: id, onchange: (ev) => { st[which] = Number(ev.target.value); compare(); },
    }, g.rows.map((r, i) => {
      const o = el("option", { value: String(i) }, r.label);
      if (i === st[which]) o.selected = true;
      return o;
    }));
  }

  // -- The page --------------------------------------------------------------------------------
  function render() {
    const g = group();
    const withReport = g.rows.map((r, i) => (r.has_report ? i : -1)).filter((i) => i >= 0);
    st.sel = firstSelected(g);
    st.a = withReport.length ? withReport[0] : 0;
    st.b = withReport.length > 1 ? withReport[1] : Math.min(1, g.rows.length - 1);
    st.x = g.xoptions.length ? g.xoptions[0][0] : null;
    st.sortCol = null;
    const kids = [];
    if (DATA.groups.length > 1) {
      kids.push(el("p", {}, "group: ", el("select", {
        id: "group", onchange: (ev) => { st.g = Number(ev.target.value); render(); },
      }, DATA.groups.map((x, k) => {
        const o = el("option", { value: String(k) }, x.title);
        if (k === st.g) o.selected = true;
        return o;
      }))));
    }
    kids.push(el("h2", {}, g.title));
    if (g.notes.length) kids.push(el("ul", { class: "notes" }, g.notes.map((n) => el("li", {}, n))));
    kids.push(el("div", { class: "row" },
      el("div", { class: "tablebox" }, el("p", { class: "muted" },
        "click a column to sort (unknown figures, —, last); click a row to select"), policyTable()),
      el("div", { class: "plotbox" },
        st.x ? el("label", {}, "x axis: ", el("select", {
          id: "xaxis", onchange: (ev) => { st.x = ev.target.value; drawScatter(); },
        }, g.xoptions.map(([k, name]) => el("option", { value: k }, name)))) : null,
        el("div", { id: "scatter", class: "plot" }))));
    kids.push(el("section", { id: "detail" }));
    kids.push(el("section", { id: "compare" }, el("h2", {}, "two policies side by side"),
      el("p", {}, picker("cmp-pick-a", "a"), " vs ", picker("cmp-pick-b", "b")),
      el("div", { id: "compare-body" })));
    app.replaceChildren(...kids);
    drawScatter();
    detail();
    compare();
  }

  render();
})();
