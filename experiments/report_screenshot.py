"""Screenshot an interactive report (``remat-kit analyze ... --html``) in headless Chromium.

Opens the page in Debian's ``chromium`` through Selenium and ``chromedriver`` (nothing
downloaded), fails on any JavaScript console error, optionally selects a policy (a click on its
table row), and saves a PNG of the top of the page. The README's image was made with::

    remat-kit analyze --model llama3-8b --batch 1 --seq 8192 --target h100-sxm --all-policies \\
        --html report.html
    python experiments/report_screenshot.py report.html \\
        docs/images/report-llama3-8b-h100.png --height 1700

(3 min 25 s wall, 51 s of CPU, on a 2-core machine shared with 6 other jobs; jax 0.10.2,
deviceless XLA GPU compile on the CPU; the screenshot ~11 s, Chromium 150.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync")  # fmt: skip


def screenshot(page: Path, png: Path, width: int, height: int, select: str | None) -> None:
    """Open ``page``, check the console, select ``select``, save ``png``.

    Raises:
      RuntimeError: the page logged a JavaScript error, or no policy row is named ``select``.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = "/usr/bin/chromium"
    for f in (*FLAGS, f"--window-size={width},{height}"):
        opts.add_argument(f)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        driver.get(page.resolve().as_uri())
        time.sleep(2)  # plotly draws asynchronously
        if select is not None:
            rows = driver.find_elements("css selector", "#policy-table tbody tr")
            hit = [r for r in rows if r.find_element("css selector", "td").text == select]
            if not hit:
                names = [r.find_element("css selector", "td").text for r in rows]
                raise RuntimeError(f"no policy {select!r} in the table; it has {names}")
            hit[0].click()
            time.sleep(1.5)
        errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        if errors:
            raise RuntimeError("JavaScript errors: " + "; ".join(errors))
        png.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(png))
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("page", type=Path, help="the report's .html file")
    p.add_argument("png", type=Path, help="the screenshot to write")
    p.add_argument("--width", type=int, default=1500)
    p.add_argument("--height", type=int, default=1400)
    p.add_argument("--select", default=None, help="select this policy first (its table label)")
    args = p.parse_args(argv)
    if not args.page.is_file():
        print(f"report_screenshot.py: error: no file {args.page}", file=sys.stderr)
        return 2
    screenshot(args.page, args.png, args.width, args.height, args.select)
    print(f"wrote {args.png} ({args.png.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
