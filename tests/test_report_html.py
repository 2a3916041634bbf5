"""The interactive HTML report, opened in a real browser (headless Chromium through Selenium).

CI installs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run``); the browser tests skip,
saying why, only where those are absent. A user's plain-JAX program (its own tag names: attn_in,
attn_out, mlp_hidden; 3 scanned layers, d_model 64) feeds every test: two policies compiled
through the library, one through ``remat-kit analyze --html``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from remat_kit import doctor
from remat_kit import report_html as H
from remat_kit.cli import main as cli_main
from remat_kit.doctor import Finding
from remat_kit.loading import load_program
from remat_kit.memory import analyze_policies
from remat_kit.policies import parse_policy_arg, policy_label

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync",
         "--window-size=1400,1800")  # fmt: skip
PROGRAM = str(Path(__file__).parent / "user_models" / "plain_jax.py") + ":program"
SPECS = [parse_policy_arg(p) for p in ("attn_in=save", "mlp_hidden=save")]
LABELS = [policy_label(s) for s in SPECS]  # "custom: attn_in=save", as the CLI names them


@pytest.fixture(scope="module")
def reports():
    """The plain-JAX program on the CPU under two per-tag policies (scanned: remat survives on
    XLA:CPU)."""
    return analyze_policies(load_program(PROGRAM), SPECS, target="cpu")


@pytest.fixture(scope="module")
def page(reports, tmp_path_factory) -> Path:
    finding = Finding("no-op-policy", "error", "made-up what <b>", "made-up cause", "made-up fix")
    group = H.group_of_reports(reports, LABELS, findings=[[], [finding]], notes=["a group note"])
    path = tmp_path_factory.mktemp("report") / "report.html"
    H.write_report(path, [group], command="pytest plain-jax")
    return path


@pytest.fixture(scope="module")
def program_page(tmp_path_factory) -> Path:
    """``remat-kit analyze --html --doctor`` of the program, one policy; the doctor's checks
    (two more compiles) replaced by one made-up finding: what is tested is that its findings
    reach the page."""
    path = tmp_path_factory.mktemp("program") / "sub" / "program.html"
    finding = Finding("made-up-code", "warning", "made-up what", "made-up cause", "made-up fix")
    calls = []

    def check_policies(program, specs, target):
        calls.append([policy_label(s) for s in specs])
        return [[finding] for _ in specs]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(doctor, "check_policies", check_policies)
        code = cli_main(["analyze", "--model", PROGRAM, "--policy", "attn_out=save", "--target",
                         "cpu", "--html", str(path), "--doctor"])  # fmt: skip
    assert code == 0 and calls == [["custom: attn_out=save"]]
    return path


def _data(path: Path) -> dict:
    text = path.read_text()
    m = re.search(r"<script id='report-data' type='application/json'>(.*?)</script>", text, re.S)
    return json.loads(m.group(1))


def test_page_is_self_contained_and_unknowns_are_dashes(page, reports):
    text = page.read_text()
    assert not re.search(r"<script[^>]+src=", text)  # no CDN, nothing fetched
    assert not re.search(r"<link[^>]+href=", text)
    assert text.count("Plotly.newPlot") >= 1 and "plotly.js v" in text  # the library inlined once
    g = _data(page)["groups"][0]
    assert [r["label"] for r in g["rows"]] == LABELS
    row = g["rows"][1]["cells"]
    measured = row[3]
    assert measured == [None, "—"]  # unknown: a dash, never 0
    assert row[0][0] == reports[1].peak_bytes
    # the buffers under the pointer come from the timeline's spans, sized by buffer assignment
    spans = g["details"][0]["spans"]
    tl = reports[0].timeline
    assert len(spans) == len(tl.spans) > 0
    at_peak = [s for s in spans if s[0] <= tl.peak_position <= s[1]]
    assert sum(s[2] for s in at_peak) <= tl.peak_bytes
    assert g["diffs"]["0,1"]["rows"]  # the policy diff, precomputed


def test_entry_of_report_reads_an_estimated_step_time_when_the_report_has_one(reports):
    assert H.entry_of_report(reports[0]).step_time_s == getattr(reports[0], "step_time_s", None)


def test_group_of_reports_rejects_mismatched_labels(reports):
    with pytest.raises(ValueError, match="one label and one finding list per report"):
        H.group_of_reports(reports, ["only-one"])


def test_header_and_group_menu_name_the_groups_targets(reports, tmp_path):
    """The header names the targets the groups hold (not the machine the rows ran on), and the
    group menu reads ``gpt-10m b=4 s=128 scan_layers=True @ local``, not a Python dict."""
    rows = [
        {"model": "gpt-10m", "target": target, "batch_size": 4, "seq_len": 128,
         "overrides": {"scan_layers": True}, "policy": label, "status": "ok",
         "report": r.to_dict(), "step_time_s": 0.2}
        for target in ("h100-sxm", "local")
        for r, label in zip(reports, LABELS, strict=True)
    ]  # fmt: skip
    groups = H.groups_of_rows(rows)
    assert [g.title for g in groups] == [
        "gpt-10m b=4 s=128 scan_layers=True @ h100-sxm",
        "gpt-10m b=4 s=128 scan_layers=True @ local",
    ]
    path = tmp_path / "sweep.html"
    H.write_report(path, groups, command="pytest", hardware="1 x cpu (cpu backend)")
    header = path.read_text().split("<header>")[1].split("</header>")[0]
    assert "<dt>targets</dt><dd>h100-sxm: NVIDIA H100" in header and "; local</dd>" in header
    assert "<dt>run on</dt><dd>1 x cpu (cpu backend)</dd>" in header
    data = _data(path)
    assert data["template"] and all("template" not in f["layout"]
                                    for f in data["groups"][0]["scatter"].values())  # fmt: skip
    assert data["groups"][0]["rows"][0]["cells"][3] == [0.2, "200 ms"]  # ms, as the sweep's


def test_rows_make_groups_and_failed_rows_stay(reports):
    base = {"program": "plain-jax", "target": "cpu"}
    rows = [
        {**base, "policy": label, "status": "ok", "report": r.to_dict(), "step_time_s": 0.012}
        for r, label in zip(reports, LABELS, strict=True)
    ] + [{**base, "policy": "save-dots", "status": "oom", "error": "out of memory", "report": None}]
    (g,) = H.groups_of_rows(rows)
    assert [e.label for e in g.entries] == [*LABELS, "save-dots"]
    assert g.entries[0].measured_step_time_s == 0.012 and g.entries[2].error == "out of memory"
    # a row compiled to an earlier row's program says so, as the sweep's table does
    twin = {**rows[1], "policy": "minimal", "report": {**rows[1]["report"],
            "program_sha256": rows[0]["report"]["program_sha256"] or "same"}}  # fmt: skip
    rows[0]["report"] = {**rows[0]["report"], "program_sha256": twin["report"]["program_sha256"]}
    (g,) = H.groups_of_rows([*rows, twin])
    assert g.entries[-1].label == f"minimal (same program as {LABELS[0]})"
    assert g.entries[0].label == LABELS[0]


# -- In the browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
    for path, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(path).exists():
            pytest.skip(f"{path} absent: apt-get install -y {pkg} (.ci/run installs it)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def _actions():
    from selenium.webdriver.common.action_chains import ActionChains

    return ActionChains


def _open(driver, path: Path) -> None:
    driver.get(path.as_uri())
    _wait(driver, "return document.querySelectorAll('#timeline .scatterlayer .trace').length > 0")


def _wait(driver, script: str, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {script}")


def _errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_report_renders_without_errors_and_selecting_a_policy_changes_the_page(
    browser, page, reports, tmp_path
):
    _open(browser, page)
    assert _errors(browser) == []
    rows = browser.find_elements("css selector", "#policy-table tbody tr")
    labels = [r.find_element("css selector", "td").text for r in rows]
    assert labels == LABELS
    assert reports[0].peak_bytes != reports[1].peak_bytes
    low = int(reports[1].peak_bytes < reports[0].peak_bytes)  # selected first: the lower peak
    title = browser.find_element("id", "detail-title")
    assert title.text == f"selected: {labels[low]}"
    names = browser.execute_script(
        "return document.getElementById('timeline').data.map(t => t.name)"
    )
    assert "opt_state" in names and any("attn_in" in n or "mlp_hidden" in n for n in names)
    live = browser.find_elements("css selector", "#live tbody tr")  # buffers live at the peak
    assert live
    browser.save_screenshot(str(tmp_path / "report.png"))
    assert (tmp_path / "report.png").stat().st_size > 10_000
    before = browser.execute_script("return document.getElementById('timeline').layout.title.text")
    rows[1 - low].click()  # select the other policy
    _wait(browser, f"return document.getElementById('detail-title').textContent.endsWith("
                   f"{json.dumps(labels[1 - low])})")  # fmt: skip
    after = browser.execute_script("return document.getElementById('timeline').layout.title.text")
    assert labels[1 - low] in after and after != before
    rows[1].click()  # the finding is the second policy's
    _wait(browser, f"return document.getElementById('detail-title').textContent.endsWith("
                   f"{json.dumps(labels[1])})")  # fmt: skip
    assert "made-up what <b>" in browser.find_element("id", "detail").text  # findings, escaped
    rows[0].click()  # checked, nothing found: said so
    _wait(browser, "return !!document.getElementById('no-findings')")
    # sort by peak, twice: the lower peak first, then last
    for order in (0, -1):
        browser.find_elements("css selector", "#policy-table th")[1].click()
        cells = browser.find_elements("css selector", "#policy-table tbody tr td.label")
        assert cells[order].text == labels[low]
    # hovering the timeline lists the buffers live at that point (the peak's before)
    heading = "return document.querySelector('#live h3').textContent"
    at_peak = browser.execute_script(heading)
    area = browser.find_element("css selector", "#timeline .nsewdrag")  # the plot area
    _actions()(browser).move_to_element_with_offset(area, -area.size["width"] // 3, 0).perform()
    _wait(browser, f"{heading} !== {json.dumps(at_peak)}")
    assert re.match(r"live at schedule position \d+: \d+ of the", browser.execute_script(heading))
    assert browser.execute_script(heading) != at_peak
    assert _errors(browser) == []


#: The page's plotly controls and titles, and which controls lie on which titles (page
#: coordinates, each plot's own; a hidden control, drawn on hover only, counts as drawn).
_LAYOUT = """
const rect = (e) => { const r = e.getBoundingClientRect();
  return [r.left, r.top, r.right, r.bottom, r.width * r.height]; };
const plots = [...document.querySelectorAll('.js-plotly-plot')];
const hits = [];
for (const p of plots) {
  const titles = [...p.querySelectorAll('.gtitle')].filter((t) => t.textContent.trim());
  for (const m of p.querySelectorAll('.modebar')) {
    const a = rect(m);
    for (const t of titles) { const b = rect(t);
      if (a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3]) hits.push([p.id, t.textContent]); }
  }
}
return {plots: plots.map((p) => p.id), hits: hits,
  titles: plots.map((p) => p.querySelectorAll('.gtitle').length),
  modebars: plots.map((p) => p.querySelectorAll('.modebar').length),
  legends: plots.map((p) => p.querySelectorAll('.legend').length)};
"""


def test_no_control_covers_a_title_and_every_plot_has_a_legend(browser, page, tmp_path):
    """At a 1400-pixel window: plotly's toolbar (the mode bar) lies on no plot title (it
    covered the side-by-side timelines' titles), every plot has a legend (the two side-by-side
    timelines had none), and the step times are in ms (the table's unit) on the plot too."""
    _open(browser, page)
    browser.set_window_size(1400, 1800)
    _wait(browser, "return document.querySelectorAll('#cmp-b .scatterlayer .trace').length > 0")
    browser.execute_script("document.getElementById('compare').scrollIntoView()")
    browser.save_screenshot(str(tmp_path / "compare.png"))
    layout = browser.execute_script(_LAYOUT)
    assert set(layout["plots"]) >= {"scatter", "timeline", "cmp-a", "cmp-b"}, layout
    assert all(n >= 1 for n in layout["titles"]) and all(n >= 1 for n in layout["modebars"])
    assert layout["hits"] == [], layout
    assert all(n == 1 for n in layout["legends"]), layout
    axis = browser.execute_script(
        "return document.getElementById('scatter').layout.xaxis.title.text"
    )
    assert "(ms)" in axis or "FLOPs" in axis, axis
    assert _errors(browser) == []


def test_console_errors_are_caught(browser, page):
    """The check above can fail: an error logged by the page is seen."""
    _open(browser, page)
    browser.execute_script("console.error('deliberate')")
    assert any("deliberate" in m for m in _errors(browser))


def test_analyze_html_of_a_program(browser, program_page):
    data = _data(program_page)
    g = data["groups"][0]
    assert {r[0] for r in g["details"][0]["residuals"]} >= {"attn_out"}
    assert any("checkpoint names 'plain-jax' emits: attn_in, attn_out, mlp_hidden" in n
               for n in g["notes"])  # fmt: skip
    assert "remat-kit analyze --model" in program_page.read_text()  # the command, at the top
    _open(browser, program_page)
    assert _errors(browser) == []
    names = browser.execute_script(
        "return document.getElementById('timeline').data.map(t => t.name)"
    )
    assert any(n.startswith("residual:") and "attn_out" in n for n in names)
    assert "[made-up-code] made-up what" in browser.find_element("id", "detail").text


def test_analyze_html_refuses_bad_input_before_compiling(tmp_path, capsys):
    for extra, match in (
        (["--html", str(tmp_path)], "is a folder"),
        (["--doctor"], "give --html"),
    ):
        assert cli_main(["analyze", "--model", PROGRAM, "--target", "cpu", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and match in err, err


def test_figures_only_entries_render(browser, tmp_path):
    """Entries without a report (a recommendation's candidates; a failed compile) render: the
    table, the trade-off against the estimated step time, no timeline, no error."""
    entries = (
        H.Entry("a", 3 * 2**30, 0, 0.12, None, 1.0, True),
        H.Entry("b", 2 * 2**30, 2**30, 0.15, None, 1.3, True),
        H.Entry("c", None, None, None, None, None, None, error="compile failed: made up"),
    )
    path = tmp_path / "figures.html"
    H.write_report(path, [H.Group("made-up candidates", entries)], command="pytest")
    browser.get(path.as_uri())
    _wait(browser, "return !!document.querySelector('#scatter .scatterlayer')")
    assert _errors(browser) == []
    assert browser.find_element("id", "xaxis").get_attribute("value") == "step_time_s"
    cells = [td.text for td in browser.find_elements("css selector", "#policy-table tbody td")]
    assert "compile failed: made up" in cells and "120 ms" in cells
    assert browser.find_element("id", "detail-title").text == "selected: b"  # the lower peak
    assert not browser.find_elements("id", "timeline")


def test_report_without_spans_says_so(browser, reports, tmp_path):
    """A report written before timelines kept buffer live ranges (an older sweep row): the
    stacked timeline, and a line instead of the list under the pointer; no error."""
    old = [dataclasses.replace(r, timeline=dataclasses.replace(r.timeline, spans=()))
           for r in reports]  # fmt: skip
    path = tmp_path / "old.html"
    H.write_report(path, [H.group_of_reports(old, LABELS)], command="pytest")
    _open(browser, path)
    assert _errors(browser) == []
    assert "keeps no buffer live ranges" in browser.find_element("id", "live").text
