"""The built site in a real browser: headless Chromium (Debian's) driven by selenium.

Opened from disk (file://), as a reader without a server opens it: every page loads
without a SEVERE console message, math is typeset by KaTeX and Mermaid draws every diagram
(no raw `$$`, `\\(` or ```mermaid left), every image loads, no snippet marker
`--8<--` is left unexpanded, every link to an anchor of the site finds its target, no page is
wider than the window, no table is wider than the text column (none scrolls sideways at the
window's 1280 px), no inline code in a table is wider than half the text column,
search finds a lesson for "zero", and the memory
calculator's page shows, for a grid of inputs, the bytes `tinyscale.calculator.estimate`
computes. Run: `pytest -k site_browser` (the calculator's check also has `calculator`).

Which site: `site/` when it is newer than every file it is built from (docs/, lessons/,
src/, mkdocs.yml), as after `make docs`; otherwise the fixture builds it once per session
into a temporary folder with `mkdocs build --strict` (~25 s on 2 cores). Without Chromium,
chromedriver or selenium the tests skip, naming the install command; under CI=true they fail.
TINYSCALE_SITE_DIR=path tests a site built elsewhere as it is.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import pytest

from tinyscale.calculator import estimate

from .grid import ROOT, calculator_grid, require, unavailable

CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
SOURCES = ("docs", "lessons", "src", "mkdocs.yml")
# 404.html links its assets from the site's root (/assets/...): a server shows it for any
# missing path, so from disk it cannot load them. Every other page uses relative links.
NOT_FROM_DISK = {"404.html"}
# The page that teaches the snippet syntax shows `--8<--` in its examples.
SHOWS_SNIPPET_SYNTAX = {"lessons/index.html"}
CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states", "activations")


def _newest_source() -> float:
    newest = 0.0
    for name in SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())
        newest = max([newest, *(f.stat().st_mtime for f in files if "__pycache__" not in f.parts)])
    return newest


@pytest.fixture(scope="session")
def site_dir(tmp_path_factory) -> Path:
    if os.environ.get("TINYSCALE_SITE_DIR"):  # a site built elsewhere, used as it is
        return Path(os.environ["TINYSCALE_SITE_DIR"]).resolve()
    built = ROOT / "site" / "index.html"
    if built.exists() and built.stat().st_mtime >= _newest_source():
        return built.parent
    if not (ROOT / "docs" / "assets" / "vendor" / "VERSIONS").exists():
        unavailable("the site's Mermaid/KaTeX files are missing: bash scripts/fetch_site_assets.sh")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.fixture(scope="session")
def browser():
    chromium = require("chromium", CHROMIUM_INSTALL)
    driver_path = require("/usr/bin/chromedriver", CHROMIUM_INSTALL)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed: .venv/bin/pip install -e '.[dev]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--allow-file-access-from-files"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, script: str, timeout_s: float = 20.0):
    """Poll a JS expression until it is truthy (or the time is up); return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = driver.execute_script(f"return {script}")
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


# What each page must show once loaded: numbers of unrendered things (0 when all is well).
# The text searched for raw delimiters leaves out code (a page may show the syntax, as
# lessons/README.md does), scripts, and KaTeX's output (its MathML keeps the TeX source).
_PAGE_PROBLEMS = """
const body = document.body.cloneNode(true);
body.querySelectorAll("code, pre, script, style, .katex").forEach((e) => e.remove());
const text = body.textContent;
return {
  raw_mermaid: document.querySelectorAll("pre.mermaid").length + (text.includes("```mermaid") ? 1 : 0),
  empty_mermaid: [...document.querySelectorAll("div.mermaid")]
      .filter((e) => e.getBoundingClientRect().height === 0).length,
  raw_math: [...document.querySelectorAll(".arithmatex")].filter((e) => !e.querySelector(".katex")).length
      + ["$$", "\\\\(", "\\\\["].filter((d) => text.includes(d)).length,
  broken_image: [...document.images].filter((i) => !(i.complete && i.naturalWidth > 0)).length,
  // Anywhere, code included: a snippet that did not expand is left inside its code block.
  raw_snippet: (document.body.textContent.match(/--8<--/g) || []).length,
  wider_than_window: document.documentElement.scrollWidth > window.innerWidth ? 1 : 0,
  // One unbreakable code span (a test id, a path) wider than half the text column makes the
  // whole table scroll sideways; docs/hooks.py lets the long ones wrap.
  wide_table_code: [...document.querySelectorAll("article td code")].filter((c) =>
      c.getBoundingClientRect().width > c.closest("article").clientWidth / 2).length,
  // Any table, code or not: material puts each in a box that scrolls sideways when the table
  // is wider than the text column; a reader should never have to (docs/stylesheets/extra.css).
  wide_table: [...document.querySelectorAll("article table")].map((t) => {
    const box = t.closest(".md-typeset__scrollwrap") || t.parentElement;
    const head = [...t.rows[0].cells].map((c) => c.textContent.trim()).join(" | ").slice(0, 80);
    return box.scrollWidth > box.clientWidth ? `${box.scrollWidth} px in ${box.clientWidth}: ${head}` : "";
  }).filter((s) => s),
};
"""
# Links into the site with a fragment, as the browser resolves them.
_LINKS = """
return [...document.querySelectorAll("a[href*='#']")].map((a) => a.href).filter((h) => h.startsWith("file:"));
"""


def test_site_browser_every_page_loads_and_renders_math_and_mermaid(browser, site_dir):
    pages = sorted(p for p in site_dir.rglob("*.html") if p.name not in NOT_FROM_DISK)
    assert len(pages) >= 10, f"only {len(pages)} pages in {site_dir}"
    problems, links, ids = [], {}, {}
    browser.get_log("browser")  # drop anything logged before
    for page in pages:
        browser.get(page.as_uri())
        # Material renders Mermaid asynchronously: wait until no diagram is left as source.
        _wait(browser, 'document.querySelectorAll("pre.mermaid").length === 0', timeout_s=15)
        found = browser.execute_script(_PAGE_PROBLEMS)
        severe = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        name = str(page.relative_to(site_dir))
        if name in SHOWS_SNIPPET_SYNTAX:
            found.pop("raw_snippet")
        problems += [f"{name}: {what} x{n}" if isinstance(n, int) else f"{name}: {what} x{len(n)}: {'; '.join(n)}"
                     for what, n in found.items() if n]
        problems += [f"{name}: console: {message[:300]}" for message in severe]
        links[name] = browser.execute_script(_LINKS)
        ids[page.as_uri()] = set(re.findall(r'\bid="([^"]+)"', page.read_text()))  # the page's anchors
    for name, hrefs in links.items():
        for href in hrefs:
            target, _, anchor = href.partition("#")
            if anchor and target in ids and unquote(anchor) not in ids[target]:
                problems.append(f"{name}: link to a missing anchor: {href}")
    assert not problems, "\n".join(problems)


def test_site_browser_search_finds_a_lesson_for_zero(browser, site_dir):
    from selenium.webdriver.common.by import By

    browser.get((site_dir / "index.html").as_uri())
    browser.find_element(By.CSS_SELECTOR, "label.md-search__icon, .md-search__input").click()
    browser.find_element(By.CSS_SELECTOR, "input.md-search__input").send_keys("zero")
    hrefs = _wait(browser, '[...document.querySelectorAll(".md-search-result__item a")].map((a) => a.href)',
                  timeout_s=30)
    assert any("/lessons/03-zero.html" in href for href in hrefs or []), hrefs


# Set the page's form to one input dict, let the page recompute, read back what it shows.
_SHOW = """
const [grid, done] = [arguments[0], arguments[arguments.length - 1]];
const form = document.getElementById("calc-form");
const results = grid.map((inputs) => {
  const x = Object.assign({}, window.tinyscaleCalculator.DEFAULTS, inputs);
  for (const el of form.querySelectorAll("[name]")) {
    if (!(el.name in x)) continue;
    if (el.type === "checkbox") el.checked = Boolean(x[el.name]);
    else el.value = x[el.name] === null ? "" : String(x[el.name]);
  }
  for (const el of form.querySelectorAll("#calc-custom [name]")) {
    if (el.name in x) continue;  // a field the inputs leave out: the model's default
    if (el.type === "checkbox") el.checked = false;
    else if (el.tagName === "SELECT") el.selectedIndex = 0;
    else el.value = "";
  }
  form.dispatchEvent(new Event("change"));
  if (!document.getElementById("calc-error").hidden) return null;
  const shown = {num_params: Number(document.getElementById("calc-params").dataset.bytes)};
  for (const td of document.querySelectorAll("#calc-results td[data-key]")) {
    shown[td.dataset.key] = Number(td.dataset.bytes);
  }
  const bars = {};  // the stacked bar's segments: width per category and place
  for (const rect of document.querySelectorAll("#calc-bar rect[data-key]")) {
    bars[rect.dataset.key] = Number(rect.getAttribute("width"));
  }
  return [shown, bars];
});
done(results);
"""


def test_site_browser_calculator_page_equals_python(browser, site_dir):
    grid = calculator_grid(400)
    browser.get((site_dir / "calculator.html").as_uri())
    assert _wait(browser, "window.tinyscaleCalculator !== undefined")
    browser.set_script_timeout(120)
    shown = browser.execute_async_script(_SHOW, grid)
    checked = 0
    for inputs, page in zip(grid, shown, strict=True):
        try:
            py = estimate(inputs)
        except ValueError:
            assert page is None, f"the page shows numbers for an impossible layout: {inputs}"
            continue
        assert page is not None, f"the page refuses a possible layout: {inputs}"
        page, bars = page
        want = {"num_params": py["num_params"]}
        for loc in ("device", "host", "disk"):
            if loc == "device" or py[loc]["total"] > 0:  # the page shows host/disk when used
                want.update({f"{loc}.{k}": v for k, v in py[loc].items()})
        want.update({f"comm.{k}": v for k, v in py["comm"].items()})
        assert page == want, inputs
        # One segment per category a place holds, as long as its bytes (one scale for all;
        # a segment under half a pixel is drawn half a pixel wide, so it can be seen).
        segments = {k: v for k, v in want.items() if k.split(".")[-1] in CATEGORIES and v > 0}
        assert set(bars) == set(segments), inputs
        largest = max(segments, key=segments.get)
        scale = bars[largest] / segments[largest]  # pixels per byte
        for key, width in bars.items():
            # 1e-12: scale recovered by one division, a few ulps from the page's own
            assert width == pytest.approx(max(segments[key] * scale, 0.5), rel=1e-12), (key, inputs)
        checked += 1
    assert checked >= 100
