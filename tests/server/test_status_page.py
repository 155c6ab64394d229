"""The status page at ``/`` of ``hyprefix serve``, in a real headless browser (Debian's Chromium,
driven through its chromedriver by Selenium): it renders the server's ``/status``, its numbers
move after a repeated request, and its chat box streams a reply whose second turn is a cache hit.
``make test`` installs Chromium where it can (``tools/ensure_browser.sh``); elsewhere this
skips, saying so."""

from __future__ import annotations

import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.test_server import MODEL, launch_server

pytestmark = pytest.mark.slow  # a server and a browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# a prompt of several 16-token blocks, so a repeat of it is a prefix-cache hit
PROMPT = " ".join(f"word{i}" for i in range(120))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with launch_server(tmp_path_factory.mktemp("status") / "server.log") as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no Chromium here: the status page test needs Debian's chromium and chromium-driver "
                    "(`apt-get install chromium chromium-driver`; make test installs them where it can)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], object], what: str, timeout: float = 120.0) -> object:
    """Poll ``check`` until it holds; the timeout only guards against a hang (a loaded 2-core runner
    takes many seconds for a 256-token reply)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def shown(driver, element_id: str) -> float:
    """The number the page shows in ``element_id`` (its ``data-value``)."""
    return float(driver.find_element("id", element_id).get_attribute("data-value"))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_page_shows_the_cache_at_work(server, browser, tmp_path):
    browser.get(server + "/")
    wait_for(lambda: browser.find_element("id", "health").text == "● serving", "the page to reach /status")
    wait_for(lambda: shown(browser, "kv-total") > 0, "the KV pool's size")
    assert browser.find_element("id", "model").text.startswith(MODEL + " ·")
    assert browser.find_element("id", "checkpoints").text == "none"  # a dense model
    assert browser.find_element("id", "disk").text == "off"
    saved_before, hits_before = shown(browser, "tokens-saved"), shown(browser, "hit-rate")

    for _ in range(2):  # the same prompt twice: the second finds the first's blocks
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200

    def newest_cached() -> int:
        cells = browser.find_elements("css selector", "#recent tr:first-child td")
        return int(cells[2].text.split()[0].replace(",", "")) if len(cells) == 7 else -1

    # The page shows what its last poll saw: wait for the state after both requests, in one view
    # (a poll during the second request already counts its hit but still holds its blocks).
    wait_for(lambda: shown(browser, "tokens-saved") > saved_before and shown(browser, "kv-used") == 0
             and newest_cached() >= 16 * 4, "the page to show both requests finished, the repeat a hit")
    assert shown(browser, "hit-rate") > hits_before
    assert shown(browser, "kv-cached") > 0  # the finished requests' blocks stay findable
    assert len(browser.find_elements("css selector", "#recent tr")) >= 2
    assert newest_cached() % 16 == 0  # the repeat's cached tokens: whole blocks of its prompt
    shot = tmp_path / "status.png"
    assert browser.save_screenshot(str(shot))
    width, height = png_size(shot)
    assert width == 1400 and height > 600  # the window less the browser's own frame


def test_chat_box_streams_and_its_second_turn_hits_the_cache(server, browser):
    browser.get(server + "/")
    wait_for(lambda: browser.find_element("id", "health").text == "● serving", "the page to reach /status")
    browser.find_element("id", "system").send_keys(PROMPT)  # a long system prompt every turn repeats
    for turn, question in enumerate(("hello there", "and again")):
        browser.find_element("id", "prompt").send_keys(question)
        browser.find_element("id", "send").click()
        wait_for(lambda n=turn: len(browser.find_elements("css selector", ".turn")) > n, f"turn {turn + 1}'s reply")
    replies = browser.find_elements("css selector", ".msg.assistant")
    # sampled replies (the box samples as hyprefix chat does): one may end at once, both hardly
    assert len(replies) == 2 and any(r.text for r in replies)
    assert not browser.find_elements("css selector", ".msg.error")
    first, second = (int(t.get_attribute("data-cached")) for t in browser.find_elements("css selector", ".turn"))
    assert first == 0 or first < second
    assert second >= 16 * 4  # the system prompt and the first turn came from the cache
    assert "cached" in browser.find_elements("css selector", ".turn")[1].text


def test_status_json_and_page_need_nothing_from_outside(server):
    page = httpx.get(f"{server}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # no external assets
    status = httpx.get(f"{server}/status", timeout=10).json()
    assert status["model"] == MODEL and status["api_key_required"] is False
    assert status["config"]["block_size"] == 16 and status["stats"]["kv_blocks_total"] == 1024
    for item in status["recent_requests"]:
        assert set(item) == {"request_id", "finished_at", "prompt_tokens", "cached_tokens", "completion_tokens",
                             "ttft_s", "e2e_s", "finish_reason"}


def test_the_access_log_leaves_out_the_pages_polls():
    import logging

    from hyprefix.server.api import _not_status_polls

    def access(method: str, path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", method, path, "1.1", 200), None)

    assert not _not_status_polls(access("GET", "/status"))
    assert _not_status_polls(access("GET", "/"))
    assert _not_status_polls(access("POST", "/v1/chat/completions"))
