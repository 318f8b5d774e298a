"""The web dashboard in a real headless browser (Debian's chromium through chromedriver and selenium), against a
live server: every page shows what the API holds, and a screenshot of each is kept (issue 21).

Screenshots go to test-artifacts/dashboard/ at the repo's root (ignored by git), for a person to look at.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator

import pytest

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import REPO

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARTIFACTS = REPO / "test-artifacts" / "dashboard"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None, reason="chromium and chromium-driver come with scripts/setup.sh"
)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    profile = tempfile.mkdtemp(prefix="corral-chromium-")
    options = Options()
    options.binary_location = CHROMIUM or ""
    # Flags as this machine kind needs them (no sandbox as root; no background traffic: the network is closed).
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER or ""), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _text_appears(driver: WebDriver, text: str, timeout_s: float = 30) -> str:
    WebDriverWait(driver, timeout_s).until(lambda d: text in d.find_element(By.ID, "view").text)
    return driver.find_element(By.ID, "view").text


def _sign_in(driver: WebDriver, server: EmbeddedServer) -> str:
    """Open the dashboard, give it the key, and wait for the first page (nodes); its text."""
    driver.get(f"{server.url}/")
    driver.find_element(By.ID, "key").send_keys(server.api_key)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    return _text_appears(driver, "memory committed")


def _screenshot(driver: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    assert driver.save_screenshot(str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, f"{path}: {len(data)} bytes"


def test_every_page_shows_the_servers_state(browser: WebDriver, server: EmbeddedServer, client: corral.Client) -> None:
    mark = uuid.uuid4().hex[:10]
    client.fncall("echo from-a-pool", image="busybox")
    with client.create("busybox", memory_mb=64, labels={"dash": mark}) as sandbox:
        sandbox.exec("echo dashboard-$((6*7))")
        sandbox.exec("sleep 3", timeout_s=0.3)  # an audit finding: timeout

        nodes = _sign_in(browser, server)
        assert "e0" in nodes and "container" in nodes
        _screenshot(browser, "nodes")

        browser.get(f"{server.url}/ui/#/sandboxes?label=dash={mark}")
        listed = _text_appears(browser, sandbox.id)
        assert "Sandboxes (1)" in listed and f"dash={mark}" in listed
        _screenshot(browser, "sandboxes")

        browser.find_element(By.LINK_TEXT, sandbox.id).click()
        detail = _text_appears(browser, "dashboard-42")
        assert "Trajectory (2 steps)" in detail and "echo dashboard-$((6*7))" in detail
        assert "timeout" in detail and "loopback only" in detail
        _screenshot(browser, "sandbox")

        browser.get(f"{server.url}/ui/#/pools")
        assert "busybox" in _text_appears(browser, "waiting")
        _screenshot(browser, "pools")

        browser.get(f"{server.url}/ui/#/images")
        images = _text_appears(browser, "Layers (")
        assert "busybox:latest" in images and "debian-12" in images
        _screenshot(browser, "images")


def test_the_live_view_counts_a_burst(browser: WebDriver, server: EmbeddedServer, client: corral.Client) -> None:
    _sign_in(browser, server)
    browser.get(f"{server.url}/ui/#/burst")
    _text_appears(browser, "since this page opened")
    sandboxes = list(client.create_many(5, "busybox", memory_mb=64, labels={"dash-burst": "1"}))
    try:
        _text_appears(browser, "created 5,")
    finally:
        for sandbox in sandboxes:
            sandbox.kill()
    _text_appears(browser, "ended 5,")
    # The totals follow each event; the chart is redrawn once a second, so a burst over within that second
    # has its bars only at the next draw: one for the creates and one for the ends at least.
    WebDriverWait(browser, 5).until(
        lambda driver: len(driver.find_elements(By.CSS_SELECTOR, "#live-chart rect.bar")) >= 2,
        "the chart did not draw the creates and the ends",
    )
    _screenshot(browser, "live")


def test_a_sandbox_page_opens_a_live_terminal(
    browser: WebDriver, server: EmbeddedServer, client: corral.Client
) -> None:
    """xterm.js on the sandbox's page: typed keys reach a shell on the sandbox's terminal, its output is drawn,
    and leaving the page ends the shell."""
    with client.create("busybox", memory_mb=64) as sandbox:
        _sign_in(browser, server)
        browser.get(f"{server.url}/ui/#/sandbox/{sandbox.id}")
        _text_appears(browser, "Open a terminal")
        browser.find_element(By.ID, "open-terminal").click()

        def screen() -> str:
            return str(
                browser.execute_script("return document.querySelector('#terminal .xterm-rows')?.innerText || ''")
            )

        WebDriverWait(browser, 30).until(lambda d: "# " in screen())  # busybox sh's prompt, drawn by xterm.js
        assert sandbox.exec("ps -o args").stdout.splitlines().count("sh -l") == 1
        keys = browser.find_element(By.CSS_SELECTOR, "#terminal .xterm-helper-textarea")
        keys.send_keys("echo term-$((6*7)); stty size\n")
        WebDriverWait(browser, 30).until(lambda d: "term-42" in screen() and "24 100" in screen())
        _screenshot(browser, "terminal")

        browser.get(f"{server.url}/ui/#/nodes")  # leaving the page closes the stream, which ends the shell
        _text_appears(browser, "memory committed")
        WebDriverWait(browser, 30, poll_frequency=0.5).until(
            lambda d: "sh -l" not in sandbox.exec("ps -o args").stdout.splitlines()
        )


def test_a_wrong_key_is_refused_on_the_page(browser: WebDriver, server: EmbeddedServer) -> None:
    browser.get(f"{server.url}/ui/")
    browser.find_element(By.ID, "key").send_keys("ck_wrong")
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    WebDriverWait(browser, 30).until(lambda d: "not accepted" in d.find_element(By.ID, "login-error").text)
