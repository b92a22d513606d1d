"""The farm's web monitor in a real browser: headless Chromium (Debian's, driven through
Playwright) opens the page of an in-process farm serving fake-pipeline batches, with the token in the
URL's fragment, and, without reloading: sees jobs move to done, pauses a batch and sees none of its
jobs start, raises a priority and sees the order change (on the page and in which job started
first), finds a failed job's traceback, plays a finished video, and shows a prompt holding
``<script>`` and ``"><img onerror=...>`` as text that runs nothing. Skipped without Chromium or
Playwright; CI installs both (.ci/run, the test extras)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runner_helpers import CHROMIUM, serving_farm, submit_file

from pan2render.jobs.ledger import Ledger

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")

HOSTILE = 'A fox <script>window.__pwned = 1</script> "><img src=x onerror="window.__pwned = 2">'
WAIT_MS = 20000
FAULTS = {"fail": {"job": "broken", "stage": "sampling"},
          # One GPU, held this long by one job: the pause clicked on the page lands while the batch waits.
          "slow": {"job": "hold", "stage": "sampling", "seconds": 6.0}}

pytestmark = [pytest.mark.browser, pytest.mark.slow,  # ~15 s: one GPU held 6 s, five batches after it
              pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")]


@pytest.fixture
def page() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        # Debian's Chromium, not a browser Playwright downloads (nothing is fetched at test time).
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            pg = browser.new_page(viewport={"width": 1200, "height": 900})
            pg.problems = []  # script errors and dialogs: the page must raise none
            pg.on("pageerror", lambda e: pg.problems.append(f"page error: {e}"))
            pg.on("dialog", lambda d: (pg.problems.append(f"dialog: {d.message}"), d.dismiss()))
            yield pg
        finally:
            browser.close()


def _started(out: Path) -> list[float]:
    led = Ledger.open_readonly(out)
    try:
        return [e.at for e in led.events() if e.started]
    finally:
        led.close()


def _order(page: Any) -> list[str]:
    return page.eval_on_selector_all("#batches tbody tr", "rows => rows.map(r => r.dataset.batch)")


def _wait_text(page: Any, selector: str, text: str) -> None:
    page.wait_for_function("([sel, text]) => { const n = document.querySelector(sel); "
                           "return n !== null && n.textContent.includes(text); }", arg=[selector, text],
                           timeout=WAIT_MS)


def test_the_monitor_follows_the_farm_and_acts_on_it(tmp_path: Path, page: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.05")
    one = {"steps": 4}
    with serving_farm(tmp_path, faults=FAULTS, retries=0) as (farm, url, token):
        sweep = submit_file(farm, tmp_path / "sweep", {"defaults": one, "jobs": [{"name": "fox", "prompt": HOSTILE}],
                                                       "sweep": {"seed": [0, 1], "guidance": [2.5, 3.5]}}, priority=2)
        submit_file(farm, tmp_path / "hold", {"jobs": [{"name": "hold", "prompt": "h", **one}]}, priority=1)
        later = submit_file(farm, tmp_path / "later", {"defaults": one, "jobs": [{"name": "la", "prompt": "l"},
                                                                                   {"name": "lb", "prompt": "m"}]})
        # Held back until the page has changed a priority (paused as they are queued).
        failing = submit_file(farm, tmp_path / "failing", {"defaults": one, "jobs": [{"name": "broken", "prompt": "b"},
                                                                                      {"name": "c1", "prompt": "c"}]},
                              paused=True)
        last = submit_file(farm, tmp_path / "last", {"jobs": [{"name": "d1", "prompt": "d", **one}]}, paused=True)

        page.goto(f"{url}/#token={token}")
        _wait_text(page, "#conn", "live")
        assert page.evaluate("location.hash") == ""  # the token left the address bar and the history
        assert page.evaluate("sessionStorage.getItem('pan2-render-farm-token')") == token
        page.evaluate("window.__sameDocument = 'yes'")  # gone if the page ever reloads
        page.wait_for_selector(f"#batch-{last}")
        order = _order(page)
        assert order.index(failing) < order.index(last)  # equal priority: submission order

        # Pause a waiting batch; raise the last one above every other.
        page.click(f"#batch-{later} button[data-action=pause]")
        _wait_text(page, f"#batch-{later} td.state", "paused")
        page.fill(f"#batch-{last} td.priority input", "5")
        page.click(f"#batch-{last} td.priority button")
        page.wait_for_function("([a, b]) => { const rows = [...document.querySelectorAll('#batches tbody tr')]"
                               ".map(r => r.dataset.batch); return rows.indexOf(a) < rows.indexOf(b); }",
                               arg=[last, failing], timeout=WAIT_MS)
        assert _order(page)[0] == last  # priority 5: first of all, above the running batches too
        def unpause_both() -> None:  # in one request: both at once
            for b in (failing, last):
                farm.actions.pause(b, paused=False)

        farm.ask(unpause_both).result(timeout=30)

        for batch, counts in [(sweep, "4 / 0 / 4"), (last, "1 / 0 / 1"), (failing, "1 / 1 / 2")]:
            _wait_text(page, f"#batch-{batch} td.counts", counts)
        assert min(_started(tmp_path / "last")) < min(_started(tmp_path / "failing"))  # it ran first
        time.sleep(1.0)  # the farm is idle now but for the paused batch: it must stay so
        assert _started(tmp_path / "later") == []
        assert page.text_content(f"#batch-{later} td.counts").replace(" ", "") == "0/0/2"

        # Unpause: its jobs move to done on the page, which never reloads.
        page.click(f"#batch-{later} button[data-action=unpause]")
        _wait_text(page, f"#batch-{later} td.counts", "2 / 0 / 2")
        assert page.evaluate("window.__sameDocument") == "yes"

        # The failed job's error and traceback, in the batch's jobs.
        page.click(f"#batch-{failing} td.id button")
        page.wait_for_selector("#jobs tr.error-row details.traceback")
        page.click("#jobs tr.error-row details.traceback summary")
        trace = page.text_content("#jobs tr.error-row details.traceback pre")
        assert "Traceback (most recent call last)" in trace and "injected failure in sampling of job broken" in trace
        assert page.is_visible("#jobs tr.error-row details.traceback pre")
        assert "sampling: " in page.text_content("#jobs tr.error-row p.error")

        # The sweep: its grid, the hostile prompt as text, and a finished video that plays.
        page.click(f"#batch-{sweep} td.id button")
        page.wait_for_selector("#grids table.grid figure.cell")
        assert page.eval_on_selector_all("#grids table.grid th.col", "ths => ths.map(t => t.textContent)") == ["0", "1"]
        prompts = page.eval_on_selector_all("#jobs .prompt", "ps => ps.map(p => p.textContent)")
        assert prompts == [HOSTILE] * 4
        assert page.evaluate("window.__pwned") is None
        assert page.query_selector_all("img[src='x'], #jobs script, #grids script") == []
        page.click("#jobs button[data-action=play]")
        page.wait_for_function("() => { const v = document.querySelector('#jobs video'); "
                               "return v !== null && v.readyState >= 1; }", timeout=WAIT_MS)
        assert page.evaluate("document.querySelector('#jobs video').videoWidth") == 64
        assert page.problems == []

        # Without the token the page asks for it and shows nothing.
        other = page.context.browser.new_page()  # (a tab of its own: its own sessionStorage)
        other.goto(url + "/")
        other.wait_for_selector("#token-form", state="visible")
        assert other.query_selector_all("#batches tbody tr") == []
        assert os.path.exists(tmp_path / "sweep" / "index.html")  # the report the page links to


# The sum of a shown image's pixels (drawn to a canvas: a blob of the page's own origin), or null
# while it has not decoded.
_PIXELS = """img => { if (!img.complete || !img.naturalWidth) return null;
  const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  return g.getImageData(0, 0, c.width, c.height).data.reduce((a, b) => a + b, 0); }"""


def test_the_monitor_shows_a_running_jobs_picture_changing_before_it_ends(
        tmp_path: Path, page: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake sampling of 40 steps of 0.15 s beside the farm's loop, a preview every 0.3 s: the
    job's row shows a picture (decoded by Chromium: our WebP with its note chunk), then another of
    a later step with other pixels, while the row still says running; once done, its video."""
    from runner_helpers import ThreadedExecutor

    monkeypatch.setenv("PAN2_FAKE_STEP_SECONDS", "0.15")
    with serving_farm(tmp_path, executor=ThreadedExecutor) as (farm, url, token):
        b = submit_file(farm, tmp_path / "live", {"jobs": [{"name": "fox", "prompt": "f", "steps": 40,
                                                            "preview_every": 0.3}]})
        page.goto(f"{url}/#token={token}")
        _wait_text(page, "#conn", "live")
        shown = "#jobs tr[data-job] img.preview"
        page.wait_for_function(f"() => {{ const i = document.querySelector('{shown}'); "
                               "return i !== null && i.complete && i.naturalWidth > 0; }", timeout=WAIT_MS)
        first = page.eval_on_selector(shown, "i => [Number(i.dataset.step), i.src]")
        first_pixels = page.eval_on_selector(shown, _PIXELS)
        later = page.wait_for_function(
            f"([step, pixels]) => {{ const i = document.querySelector('{shown}'); const px = ({_PIXELS})(i);"
            " const row = i && i.closest('tr'); "
            " return i !== null && Number(i.dataset.step) > step && px !== null && px !== pixels "
            "   && row.querySelector('.badge').textContent === 'running' && [Number(i.dataset.step), i.src]; }",
            arg=[first[0], first_pixels], timeout=WAIT_MS).json_value()
        print(f"preview at step {first[0]}, then at step {later[0]}")
        assert later[1] != first[1] and later[0] > first[0] >= 1
        assert "preview at step" in page.text_content("#jobs tr[data-job] .media")
        _wait_text(page, f"#batch-{b} td.counts", "1 / 0 / 1")
        page.wait_for_selector("#jobs button[data-action=play]")  # done: its video, no preview
        assert page.query_selector(shown) is None
        assert page.problems == []
