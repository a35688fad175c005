#!/usr/bin/env python3
"""Serve.WebPageInARealBrowser: dalle-serve's page at / in headless Chromium, driven as a user
would through chromedriver (the W3C WebDriver protocol, spoken with the standard library).

Usage: web_page_browser_test.py SOURCE_DIR TOOLS_DIR [--screenshot PNG]  (Debian's chromium and
chromium-driver, which scripts/setup installs; --screenshot writes the page with the job's
images, docs/serve.md's picture)

- The page asks for the API key, then names the served model and offers its adapters.
- A job is submitted from the form with an adapter chosen; the page is reloaded while it runs,
  finds the job again (the key kept for the tab) and shows its settings in the form; its images
  come, decoded by the browser (naturalWidth), captioned with the prompt, seed and candidate,
  and they are the PNGs the same request gets from the API, byte for byte.
- The server's errors are shown as the page's status: a wrong API key, a request the server
  refuses (n above max_n).

Everything runs on 127.0.0.1: dalle-serve and chromedriver on free ports; every call has a
timeout and the whole test an alarm; both processes are killed on the way out.
"""
import base64
import json
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SOURCE, TOOLS = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sys.path.insert(0, str(SOURCE / "scripts"))
from serve_process import ServeProcess, write_random_adapter  # noqa: E402

MODEL = SOURCE / "models" / "fashion-compose-f8"
KEY = "browser-key-0123456789"
PROMPT = "a blue sneaker at the top"
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference


def fail(message):
    sys.exit(f"web_page_browser_test: FAILED: {message}")


def check(condition, message):
    if not condition:
        fail(message)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(method, url, body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        fail(f"{method} {url}: {error.code} {error.read()[:500]!r}")


class Browser:
    """One headless Chromium session through chromedriver."""

    def __init__(self, profile):
        chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
        check(chromium and driver, "chromium and chromedriver are needed (Debian's chromium and chromium-driver; "
                                   "scripts/setup installs them)")
        port = free_port()
        self.driver = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if http("GET", self.base + "/status", timeout=2)["value"]["ready"]:
                    break
            except (OSError, KeyError):
                pass
            time.sleep(0.1)
        else:
            fail("chromedriver did not start")
        options = {"binary": chromium, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                                "--disable-dev-shm-usage", "--window-size=1000,800",
                                                f"--user-data-dir={profile}"]}
        answer = http("POST", self.base + "/session",
                      {"capabilities": {"alwaysMatch": {"goog:chromeOptions": options}}}, timeout=120)
        self.session = f"{self.base}/session/{answer['value']['sessionId']}"

    def call(self, method, path, body=None):
        return http(method, self.session + path, body if body is not None or method != "POST" else {})["value"]

    def open(self, url):
        self.call("POST", "/url", {"url": url})

    def reload(self):
        self.call("POST", "/refresh")

    def run(self, script, *arguments):
        return self.call("POST", "/execute/sync", {"script": script, "args": list(arguments)})

    def element(self, css):
        return self.call("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css, text):
        element = self.element(css)
        self.call("POST", f"/element/{element}/clear")
        self.call("POST", f"/element/{element}/value", {"text": text})

    def click(self, css):
        self.call("POST", f"/element/{self.element(css)}/click")

    def wait(self, what, script, seconds=120):
        """The first true value of `script`, polled."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            value = self.run(script)
            if value:
                return value
            time.sleep(0.1)
        fail(f"{what}: not within {seconds} s; the page says {self.run('return document.body.innerText')!r}")

    def screenshot(self, path):
        pathlib.Path(path).write_bytes(base64.b64decode(self.call("GET", "/screenshot")))

    def close(self):
        try:
            http("DELETE", self.session, timeout=30)
        finally:
            self.driver.kill()
            self.driver.wait(30)


STATUS = "return document.getElementById('status').textContent"
FIGURES = """return [...document.querySelectorAll('#images figure')].map((figure) => ({
  caption: figure.querySelector('figcaption').textContent,
  src: figure.querySelector('img').src,
  width: figure.querySelector('img').naturalWidth}))"""


def png_of_api(server, fields):
    """The PNG bytes the API gives for the same request, synchronously."""
    request = urllib.request.Request(server.url + "/v1/images/generations", data=json.dumps(fields).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return [base64.b64decode(image["b64_json"]) for image in json.loads(response.read())["data"]]


def fill_form(browser, n):
    browser.type("#prompt", PROMPT)  # after the key: its change event has fired
    browser.type("#n", str(n))
    browser.type("#candidates", "2")
    browser.type("#seed", "5")
    browser.run("document.getElementById('superres').checked = false")


def test_job_reload_and_images(browser, server):
    browser.open(server.url + "/")
    browser.wait("the page asking for the key", "return document.getElementById('model').textContent === "
                                                "'(needs the API key)'")
    browser.type("#key", KEY)
    fill_form(browser, 2)
    browser.wait("the model's name and adapters", "return document.getElementById('model').textContent === "
                 "'fashion-compose-f8' && !document.getElementById('adapter-label').hidden")
    options = browser.run("return [...document.getElementById('adapter').options].map((option) => option.value)")
    check(options == ["", "sneaker"], f"the adapters offered: {options}")
    browser.run("document.getElementById('adapter').value = 'sneaker'")
    browser.click("#go")
    browser.wait("the job kept in the browser's storage", "return localStorage.getItem('dalle-serve-job')")
    browser.reload()  # while the job runs: the page finds it again
    form = browser.run("return ['prompt', 'n', 'candidates', 'seed', 'superres', 'adapter'].map((id) => "
                       "id === 'superres' ? document.getElementById(id).checked : document.getElementById(id).value)")
    check(form[:5] == [PROMPT, "2", "2", "5", False], f"the reloaded page's form is not the job's: {form}")
    figures = browser.wait("the job's images",
                           "return document.getElementById('go').disabled === false && "
                           "document.getElementById('status').textContent.includes('images in') && " + FIGURES[7:])
    check(len(figures) == 2, f"{len(figures)} images shown for n=2: {figures}")
    check(browser.run("return document.getElementById('adapter').value") == "sneaker",
          "the reloaded page's form does not show the job's adapter")
    expected = png_of_api(server, {"prompt": PROMPT, "n": 2, "candidates": 2, "seed": 5, "superres": False,
                                   "response_format": "b64_json", "adapters": {"sneaker": 1}})
    for rank, figure in enumerate(figures):
        check(figure["width"] > 0, f"image {rank} did not decode in the browser: {figure['caption']}")
        check(figure["caption"].startswith(PROMPT + " (seed 5, candidate "), f"image {rank}'s caption: "
                                                                             f"{figure['caption']}")
        prefix = "data:image/png;base64,"
        check(figure["src"].startswith(prefix) and base64.b64decode(figure["src"][len(prefix):]) == expected[rank],
              f"image {rank} is not the API's image for the same request")


def test_errors_shown(browser, server):
    """The server's refusals appear as the page's status, in its error style."""
    browser.open(server.url + "/")
    fill_form(browser, 9)  # above max_n
    browser.click("#go")
    status = browser.wait("the refusal of n", "const s = document.getElementById('status'); "
                          "return s.className === 'error' && s.textContent")
    check("'n'" in status, f"the page's status for n = 9: {status!r}")
    browser.type("#key", "wrong-key")
    fill_form(browser, 1)
    browser.click("#go")
    browser.wait("the refusal of the key", "const s = document.getElementById('status'); "
                 "return s.className === 'error' && s.textContent.includes('API key') && s.textContent")
    check(not browser.run("return localStorage.getItem('dalle-serve-job')"), "a refused job was kept")


def main():
    signal.signal(signal.SIGALRM, lambda *_: fail("the test took over 300 s: the server or the browser hung"))
    signal.alarm(300)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        (scratch / "key").write_text(KEY + "\n")
        adapter = write_random_adapter(MODEL / "prior" / "model.safetensors", scratch / "sneaker.safetensors")
        server = ServeProcess(TOOLS, ["--model", MODEL, "--threads", "1", "--api-key-file", scratch / "key",
                                      "--adapter", f"sneaker={adapter}"])
        browser = None
        try:
            browser = Browser(scratch / "profile")
            test_job_reload_and_images(browser, server)
            if len(sys.argv) > 4 and sys.argv[3] == "--screenshot":
                browser.screenshot(sys.argv[4])
            test_errors_shown(browser, server)
        finally:
            if browser:
                browser.close()
            server.kill()
    print("web_page_browser_test: all passed")


if __name__ == "__main__":
    main()
