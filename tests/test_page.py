"""The web page at /, in headless Chromium (Debian's chromium and chromium-driver; `make test`
installs them where it can): it lists the models, translates, shows the n-best list with scores
and, for a GRET model, one coloured cell of context gate per output piece. The screenshot it takes
is the README's picture (docs/web-page.png)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from server.client import Client
from tests.served import RunningServer, config_for, free_port

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "web-page.png"
TEXTS = ["Ein Hund läuft über die Wiese.", "Zwei Männer spielen Fußball."]


@pytest.fixture(scope="module")
def server(served_models, tmp_path_factory):
    """The GRET model from its checkpoint (diagnostics need it) and the summariser."""
    running = RunningServer(config_for(served_models.parent / "runs", tmp_path_factory.mktemp("build-cache"),
                                       models=["de-en"], http_port=free_port()))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    driver_path, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    if not (driver_path and chromium):
        pytest.skip("needs Debian's chromium and chromium-driver (make test installs them as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,760"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    yield driver
    driver.quit()


def test_the_page_translates_and_shows_the_n_best_list_and_the_gate_strip(server, browser):
    browser.get(f"http://127.0.0.1:{server.app.http_port}/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    Select(browser.find_element(By.ID, "model")).select_by_value("de-en")
    assert browser.find_element(By.ID, "gate").is_selected()  # a GRET model: the gate is asked for
    browser.find_element(By.ID, "texts").send_keys("\n".join(TEXTS))
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".result")) == len(TEXTS))

    with Client(server.address, timeout=60) as c:
        expected = c.translate(TEXTS, model="de-en", beam_size=4, n_best=3, return_diagnostics=True).results
    for box, result in zip(browser.find_elements(By.CSS_SELECTOR, ".result"), expected):
        rows = box.find_elements(By.CSS_SELECTOR, "tr")
        texts = [r.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent") for r in rows]
        assert texts == [h.text for h in result.hypotheses]  # textContent: rendering collapses spaces
        assert all(r.find_element(By.CSS_SELECTOR, ".score").text.startswith("score -") for r in rows)
        cells = box.find_elements(By.CSS_SELECTOR, ".gate .piece")
        assert len(cells) == len(result.diagnostics.gate) == result.hypotheses[0].tokens
        assert cells[0].get_attribute("title") == f"piece 1: gate {result.diagnostics.gate[0]:.3f}"
    assert browser.find_element(By.ID, "status").text == ""
    SCREENSHOT.parent.mkdir(exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))


def test_an_error_is_shown_with_its_status_and_message(server, browser):
    browser.get(f"http://127.0.0.1:{server.app.http_port}/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))
    beam = browser.find_element(By.ID, "beam")
    beam.clear()
    beam.send_keys("99")
    browser.find_element(By.ID, "texts").send_keys("Ein Hund.")
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("400"))
    assert "beam" in browser.find_element(By.ID, "status").text
