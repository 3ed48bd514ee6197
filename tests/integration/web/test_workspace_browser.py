"""The workspace in a real headless chromium: sign in, submit, watch it finish, cancel.

Selenium blocks, and the server runs in the test's own event loop, so each
browser step runs in a thread while the loop keeps serving. A screenshot of
the finished batch is left at /tmp/workspace.png for a person to look at.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.accounts import make_account
from tests.support.deferred_batches import item_rows, worker
from tests.support.server import live_server
from tests.support.waits import HANG_S
from tests.support.workspace import answer_with

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOT = Path("/tmp/workspace.png")

#: CI sets this: there a missing browser is a failure, not a skip that hides one.
REQUIRED = os.environ.get("BATCHYARD_REQUIRE_BROWSER") == "1"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists() and not REQUIRED,
        reason="needs Debian's chromium: apt-get install -y chromium chromium-driver",
    ),
]


def _driver(profile: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1280,1000",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=DriverService(CHROMEDRIVER), options=options)


def _click_and_load(driver: Any, by: str, value: str) -> None:
    """Find, click, then wait until the next page has replaced this one and finished loading.

    The element is found by its locator at the moment of the click, from a page that
    has finished loading: a live batch's page reloads itself (``<meta refresh>``), and an
    element found before such a reload belongs to a document that is gone (chromedriver:
    "Node ... does not belong to the document"). A click that failed that way did not
    happen, so it is tried again on the new page.
    """
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, HANG_S)
    for attempt in range(3):
        wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        old = driver.find_element(By.TAG_NAME, "html")
        try:
            driver.find_element(by, value).click()
        except StaleElementReferenceException:
            continue
        except WebDriverException as exc:
            if "does not belong to the document" not in str(exc) or attempt == 2:
                raise
            continue
        break
    wait.until(lambda d: _replaced(old))
    wait.until(lambda d: d.execute_script("return document.readyState") == "complete")


def _replaced(element: Any) -> bool:
    """Whether ``element``'s document is gone.

    Selenium's ``staleness_of`` knows only ``StaleElementReferenceException``; chromedriver
    sometimes reports the same fact, mid-navigation, as an "unknown error" that the node
    "does not belong to the document", which ``staleness_of`` lets escape.
    """
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


async def test_sign_in_submit_complete_cancel_in_chromium(service, tmp_path):
    from selenium.webdriver.common.by import By

    answer_with(service)
    acct = make_account(service, credit="1")
    driver = await asyncio.to_thread(_driver, tmp_path / "profile")
    try:
        async with live_server(service, worker=False) as base:

            def sign_in_and_submit() -> str:
                driver.get(f"{base}/workspace/")
                driver.find_element(By.ID, "api_key").send_keys(acct.key)
                _click_and_load(driver, By.ID, "sign-in")
                assert driver.current_url == f"{base}/workspace/batches"
                assert '"kettei-core"' in driver.find_element(By.ID, "body").get_attribute("value")
                _click_and_load(driver, By.ID, "submit")
                assert "/workspace/batches/bat." in driver.current_url
                assert driver.find_element(By.ID, "status").text == "in_progress"
                return str(driver.current_url).rsplit("/", 1)[1]

            batch_id = await asyncio.to_thread(sign_in_and_submit)

            def listed_then_opened() -> None:
                driver.get(f"{base}/workspace/batches")
                assert driver.find_element(By.ID, "batches")
                _click_and_load(driver, By.LINK_TEXT, batch_id)
                assert driver.current_url == f"{base}/workspace/batches/{batch_id}"

            await asyncio.to_thread(listed_then_opened)
            report = await worker(service).run_pass()
            assert report.succeeded == 1

            def finished() -> tuple[str, dict[str, Any]]:
                driver.refresh()
                assert driver.find_element(By.ID, "status").text == "completed"
                rows = driver.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
                assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == ["succeeded"]
                assert not driver.find_elements(By.ID, "cancel")
                href = driver.find_element(By.ID, "download").get_attribute("href")
                driver.save_screenshot(str(SCREENSHOT))
                return str(href), driver.get_cookie("by_workspace")

            href, cookie = await asyncio.to_thread(finished)
            assert href == f"{base}/workspace/batches/{batch_id}/results"
            assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
            assert acct.key not in cookie["value"]
            async with httpx.AsyncClient(
                cookies={"by_workspace": cookie["value"]}, timeout=HANG_S
            ) as http:
                download = await http.get(href)
            assert download.headers["content-disposition"].startswith("attachment;")
            assert '"status": "succeeded"' in download.text

            def submit_and_cancel() -> str:
                driver.get(f"{base}/workspace/batches")
                _click_and_load(driver, By.ID, "submit")
                second = str(driver.current_url).rsplit("/", 1)[1]
                _click_and_load(driver, By.ID, "cancel")
                assert driver.find_element(By.ID, "status").text == "canceled"
                return second

            second = await asyncio.to_thread(submit_and_cancel)
            assert second != batch_id
            assert [i.status for i in item_rows(service, second)] == ["canceled"]
    finally:
        await asyncio.to_thread(driver.quit)
    assert SCREENSHOT.stat().st_size > 0


async def test_a_sign_in_survives_a_restart_and_works_on_another_process(
    make_service, settings, tmp_path
):
    """Chromium signs in on one server; a second server over the same store (another
    process, or the same one restarted) takes the same cookie, and a sign-out on either
    ends it on both."""
    from selenium.webdriver.common.by import By

    first = make_service()
    answer_with(first)
    acct = make_account(first, credit="1")
    driver = await asyncio.to_thread(_driver, tmp_path / "profile")
    try:
        async with live_server(first, worker=False) as base:

            def sign_in() -> dict[str, Any]:
                driver.get(f"{base}/workspace/")
                driver.find_element(By.ID, "api_key").send_keys(acct.key)
                _click_and_load(driver, By.ID, "sign-in")
                assert driver.current_url == f"{base}/workspace/batches"
                return driver.get_cookie("by_workspace")

            cookie = await asyncio.to_thread(sign_in)
        assert acct.key not in cookie["value"]
        # The first server is gone; a new one (a restart, or another process) serves the store.
        second = make_service()
        answer_with(second)
        async with live_server(second, worker=False) as other:

            def still_signed_in() -> None:
                # Cookies belong to the host, not the port: the browser sends it here too.
                driver.get(f"{other}/workspace/batches")
                assert driver.current_url == f"{other}/workspace/batches"
                assert driver.find_element(By.ID, "upload")
                _click_and_load(driver, By.CSS_SELECTOR, "button.link")
                assert "note=out" in driver.current_url

            await asyncio.to_thread(still_signed_in)
            async with httpx.AsyncClient(
                cookies={"by_workspace": cookie["value"]}, timeout=HANG_S
            ) as http:
                replayed = await http.get(f"{other}/workspace/batches", follow_redirects=False)
            assert replayed.status_code == 303  # signed out everywhere, copies included
    finally:
        await asyncio.to_thread(driver.quit)
