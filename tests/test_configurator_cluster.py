"""What the configurator writes is accepted by the API server of the local control plane, from the command
line and from its web page driven in a real headless Chromium (Debian's chromium + chromium-driver)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from disagg.api import v1alpha1 as api
from disagg.api.names import GROUP
from disagg.configurator import Inputs, configure, manifest

pytestmark = pytest.mark.cluster


def create(api_client, namespace: str, doc: dict, dry_run: bool = True) -> dict:
    objects = client.CustomObjectsApi(api_client)
    kwargs = {"dry_run": "All"} if dry_run else {}
    return objects.create_namespaced_custom_object(GROUP, api.VERSION, namespace, api.PLURAL, doc, **kwargs)


@pytest.mark.parametrize("link", ["nvlink", "infiniband"])
def test_emitted_yaml_is_accepted_by_the_api_server(link, api_client, crd_installed, namespace, tmp_path):
    from disagg.cli import main

    out = tmp_path / "out"
    assert main(["configure", "--model", "Qwen/Qwen2.5-32B-Instruct", "--gpu", "h200", "--gpus", "16",
                 "--isl", "3000", "--osl", "150", "--ttft-ms", "500", "--itl-ms", "20", "--interconnect", link,
                 "--out", str(out)]) == 0
    doc = yaml.safe_load((out / "deployment.yaml").read_text())
    stored = create(api_client, namespace, doc, dry_run=False)        # really stored, then read back
    got = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
        GROUP, api.VERSION, namespace, api.PLURAL, doc["metadata"]["name"])
    assert got["spec"]["prefill"]["replicas"] == doc["spec"]["prefill"]["replicas"]
    assert got["spec"]["router"]["policy"] == "kv-aware"             # the API server applied the CRD's defaults
    assert stored["metadata"]["uid"]
    # every point of both frontiers (aggregated ones included) passes admission too
    result = configure(Inputs(model="Qwen/Qwen2.5-32B-Instruct", gpu="h200", gpus=16, itl_ms=20, interconnect=link))
    for n, e in enumerate(result.aggregated + result.disaggregated):
        doc = yaml.safe_load(manifest.to_yaml(result, e, name=f"point-{n}"))
        assert create(api_client, namespace, doc)["kind"] == api.KIND
    # and the dry run does validate: a spec the API refuses is refused here
    bad = yaml.safe_load(manifest.to_yaml(result, result.best))
    bad["spec"]["decode"]["resources"]["limits"]["nvidia.com/gpu"] = bad["spec"]["decode"]["tensorParallelSize"] + 1
    with pytest.raises(ApiException) as refused:
        create(api_client, namespace, bad)
    assert refused.value.status == 422 and "tensorParallelSize" in refused.value.body


# ---------------------------------------------------------------- the web page in a real browser

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def page_url(tmp_path):
    """``disagg configure --serve`` as its own process."""
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "disagg.cli", "configure", "--serve", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "api/options", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the page did not start: {(tmp_path / 'serve.log').read_text()}")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("needs Debian's chromium and chromium-driver (make test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1100"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(driver), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


def _fill(browser, values: dict[str, str]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    for name, value in values.items():
        el = browser.find_element(By.ID, name)
        if el.tag_name == "select":
            Select(el).select_by_value(value)
        else:
            el.clear()
            el.send_keys(value)


def test_web_page_draws_both_frontiers_and_gives_yaml_the_api_server_accepts(
        browser, page_url, api_client, crd_installed, namespace):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(page_url)
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "ready")
    _fill(browser, {"model": "Qwen/Qwen2.5-32B-Instruct", "gpu": "h200", "gpus": "16", "isl": "3000", "osl": "150",
                    "ttft_ms": "500", "itl_ms": "20", "interconnect": "nvlink", "prefix_reuse": "0.3"})
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") in ("drawn", "error"))
    assert browser.find_element(By.ID, "error").text == ""
    agg = browser.find_elements(By.CSS_SELECTOR, "#frontier-agg circle.point")
    dis = browser.find_elements(By.CSS_SELECTOR, "#frontier-disagg circle.point")
    assert len(agg) >= 2 and len(dis) >= 2, "both frontiers drawn"
    assert browser.find_elements(By.CSS_SELECTOR, "#frontier-agg path, #frontier-disagg path")
    # the page ran the CLI's code path: same frontier sizes as configure() for the same inputs
    result = configure(Inputs(model="Qwen/Qwen2.5-32B-Instruct", gpu="h200", gpus=16, itl_ms=20,
                              interconnect="nvlink", prefix_reuse=0.3))
    assert (len(agg), len(dis)) == (len(result.aggregated), len(result.disaggregated))

    accepted, docs = [], []
    for point in (browser.find_element(By.CSS_SELECTOR, 'circle.point[data-best="true"]'), agg[0]):
        ActionChains(browser).move_to_element(point).click().perform()
        wait.until(lambda d: d.find_elements(By.ID, "yaml"))
        text = browser.find_element(By.ID, "yaml").text
        assert "kind: DisaggDeployment" in text
        figures = browser.find_element(By.ID, "figures").text
        assert "tokens/s/GPU" in figures and "TTFT" in figures
        # the download link carries the same YAML
        link = browser.find_element(By.ID, "download")
        assert link.get_attribute("download").endswith(".yaml")
        downloaded = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(document.getElementById('download').href).then(r => r.text()).then(done);")
        assert yaml.safe_load(downloaded) == yaml.safe_load(text)
        doc = yaml.safe_load(text)
        docs.append(doc)
        accepted.append(create(api_client, namespace, doc))
    assert all(a["kind"] == api.KIND and a["spec"]["router"]["policy"] == "kv-aware" for a in accepted)
    assert docs[0] == yaml.safe_load(manifest.to_yaml(result, result.best))   # the CLI's YAML for the best
    assert accepted[1]["spec"]["router"]["disaggregation"] == "never"          # an aggregated point
