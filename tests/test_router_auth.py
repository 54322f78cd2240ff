"""API keys (spec.router.auth) on the real router process, in front of a real (canned) upstream: no key or
a wrong one gets OpenAI's 401 (the openai client raises AuthenticationError), any of the keys serves,
the probes stay open, every refusal is counted, no key ever reaches the router's log, and a changed keys
file (swapped the way the kubelet updates a Secret volume) takes effect without a restart. /metrics is
served on the metrics port alone (as the operator runs routers): the serving port, which clients reach,
has none; a router without a metrics port (a local run) serves it behind the keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import free_port, metric_sum, scrape

OLD, NEW, WRONG = "sk-old-3b1f0c9e7d5a42e8", "sk-new-8c2d4e6f0a1b3c5d", "sk-wrong-0000000000000000"


class SecretVolume:
    """A directory laid out as the kubelet lays out a mounted Secret: ``keys -> ..data/keys``,
    ``..data -> ..<version>``, updated by writing a new version and swapping ``..data`` atomically."""

    def __init__(self, root: Path) -> None:
        self.root, self.version = root, 0
        root.mkdir(parents=True, exist_ok=True)

    def write(self, text: str) -> None:
        self.version += 1
        d = self.root / f"..v{self.version}"
        d.mkdir()
        (d / "keys").write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(d.name)
        os.replace(tmp, self.root / "..data")
        if not (self.root / "keys").is_symlink():
            (self.root / "keys").symlink_to("..data/keys")

    @property
    def file(self) -> Path:
        return self.root / "keys"


@pytest.fixture(scope="module")
def served(routers, tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-auth")
    upstream = routers.upstream(logs, "auth-upstream", 4, 0)
    volume = SecretVolume(logs / "secret")
    volume.write(f"# rotated keys: old and new both valid while clients move\n{OLD}\n\n  {NEW}  \n")
    metrics_port = free_port()
    with routers.serving(tiny_model, logs, [upstream], api_keys_file=str(volume.file), metrics_port=metrics_port) as r:
        r.metrics = f"http://127.0.0.1:{metrics_port}"      # where Prometheus scrapes it, with no key
        yield r, volume


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_no_key_or_a_wrong_one_is_refused_in_openais_shape(served):
    r, _ = served
    before = scrape(r.metrics)
    for key in (WRONG, OLD + "x", OLD[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            _client(r.url, key).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert e.value.body["type"] == "invalid_request_error" and key not in str(e.value.body)
        assert e.value.response.headers["WWW-Authenticate"] == "Bearer"
    for headers in ({}, {"Authorization": OLD}, {"Authorization": "Basic " + OLD}, {"Authorization": "Bearer "}):
        status, _, body = _get(f"{r.url}/v1/models", headers)
        err = json.loads(body)["error"]
        assert status == 401 and err["code"] == "invalid_api_key" and "No API key" in err["message"], err
        assert OLD.encode() not in body
    s = scrape(r.metrics)
    assert s[f'{m.ROUTER_AUTH_FAILURES}{{reason="{m.AUTH_INVALID}"}}'] - \
        before.get(f'{m.ROUTER_AUTH_FAILURES}{{reason="{m.AUTH_INVALID}"}}', 0) == 3
    assert s[f'{m.ROUTER_AUTH_FAILURES}{{reason="{m.AUTH_MISSING}"}}'] - \
        before.get(f'{m.ROUTER_AUTH_FAILURES}{{reason="{m.AUTH_MISSING}"}}', 0) == 4
    # not load: the planner reads requests_total's rate as demand, and refused requests are none
    assert metric_sum(s, m.ROUTER_REQUESTS) == metric_sum(before, m.ROUTER_REQUESTS)
    assert m.ROUTER_IN_FLIGHT in s and s[m.ROUTER_IN_FLIGHT] == 0


def test_every_key_in_the_file_serves_and_probes_stay_open(served):
    r, _ = served
    for key in (OLD, NEW):
        c = _client(r.url, key)
        assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text == "tok tok "
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "tok tok "
        assert [mdl.id for mdl in c.models.list()] == ["tiny"]
    for path in ("/health", "/livez"):
        assert _get(f"{r.url}{path}")[0] == 200, path
    # the clients' port has no /metrics (its series name every worker and count every request): without a
    # key it is refused as every path but the probes is, with one it is not found
    status, _, body = _get(f"{r.url}/metrics")
    assert status == 401, (status, body[:200])
    status, _, body = _get(f"{r.url}/metrics", {"Authorization": f"Bearer {OLD}"})
    assert status == 404 and json.loads(body)["error"]["code"] == 404, (status, body[:200])
    assert scrape(r.metrics)[m.ROUTER_API_KEYS] == 2


def test_no_key_reaches_the_log(served):
    r, _ = served
    for key in (WRONG, OLD):
        try:
            _client(r.url, key).completions.create(model="tiny", prompt="hi", max_tokens=2)
        except openai.AuthenticationError:
            pass
    log = r.log_path.read_text(errors="replace")
    assert "API keys loaded" in log            # the log is there, and says how many, not which
    for key in (OLD, NEW, WRONG):
        assert key not in log


def test_a_rotated_secret_takes_effect_without_a_restart(served):
    r, volume = served
    pid = r.proc.pid
    try:
        volume.write(f"{NEW}\n")                                  # the old key retired
        wait_for(lambda: scrape(r.metrics)[m.ROUTER_API_KEYS] == 1, 30, "the router to re-read its keys")
        with pytest.raises(openai.AuthenticationError):
            _client(r.url, OLD).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert _client(r.url, NEW).completions.create(model="tiny", prompt="hi", max_tokens=2).choices
        volume.write("# no keys at all\n")                        # an emptied Secret fails closed
        wait_for(lambda: scrape(r.metrics)[m.ROUTER_API_KEYS] == 0, 30, "the router to re-read its keys")
        with pytest.raises(openai.AuthenticationError):
            _client(r.url, NEW).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert r.proc.pid == pid and r.proc.poll() is None
    finally:
        volume.write(f"{OLD}\n{NEW}\n")
        wait_for(lambda: scrape(r.metrics)[m.ROUTER_API_KEYS] == 2, 30, "the keys restored")


def test_without_a_metrics_port_metrics_need_a_key(routers, tiny_model, tmp_path):
    """A local run (no metrics port) keeps /metrics on the serving port, behind the same keys as the API."""
    upstream = routers.upstream(tmp_path, "auth-upstream-local", 2, 0)
    (tmp_path / "keys").write_text(f"{OLD}\n")
    with routers.serving(tiny_model, tmp_path, [upstream], name="router-local", api_keys_file=str(tmp_path / "keys")) as r:
        status, _, body = _get(f"{r.url}/metrics")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (status, body[:200])
        status, _, body = _get(f"{r.url}/metrics", {"Authorization": f"Bearer {OLD}"})
        assert status == 200 and m.ROUTER_API_KEYS.encode() in body
        assert _get(f"{r.url}/livez")[0] == 200


def test_a_router_told_to_authenticate_without_its_keys_file_does_not_start(routers, tiny_model, tmp_path):
    (tmp_path / "router.json").write_text(json.dumps(routers.config(
        tiny_model, free_port(), ["http://127.0.0.1:9"], api_keys_file=str(tmp_path / "missing" / "keys"))))
    out = subprocess.run([sys.executable, "-P", "-m", "disagg.router", "--config", str(tmp_path / "router.json")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and f"cannot read {tmp_path / 'missing' / 'keys'}" in out.stderr, out.stderr
