"""Secrets never reach a log: disagg.redact masks them, and every place that logs or prints an argv or an
environment (the worker supervisor, `python -m disagg.workers command`) goes through it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from disagg import redact

SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize("args,expect", [
    (["--api-key", SECRET], ["--api-key", "***"]),
    ([f"--api-key={SECRET}"], ["--api-key=***"]),
    (["--hf-token", SECRET, "--port", "8000"], ["--hf-token", "***", "--port", "8000"]),
    ([f"--hf_token={SECRET}"], ["--hf_token=***"]),
    (["--db-password", SECRET, f"--client-secret={SECRET}", "--aws-secret-access-key", SECRET],
     ["--db-password", "***", "--client-secret=***", "--aws-secret-access-key", "***"]),
    (["--apiKey", SECRET], ["--apiKey", "***"]),
    # a bare secret-named switch (vLLM's --hf-token without a value reads the stored token)
    (["--hf-token", "--port", "8000"], ["--hf-token", "--port", "8000"]),
    # whole words only: what runs stays readable
    (["--tokenizer", "org/m", "--max-num-batched-tokens", "8192", "--ssl-keyfile", "/tls/key.pem"],
     ["--tokenizer", "org/m", "--max-num-batched-tokens", "8192", "--ssl-keyfile", "/tls/key.pem"]),
    (["--model", f"https://user:{SECRET}@example.com/m"], ["--model", "https://***@example.com/m"]),
    (["--model-loader-extra-config", json.dumps({"access_key": SECRET, "region": "eu"})],
     ["--model-loader-extra-config", '{"access_key":"***","region":"eu"}']),
    ([f"--kv-transfer-config={json.dumps({'kv_connector': 'NixlConnector', 'auth_token': SECRET})}"],
     ['--kv-transfer-config={"kv_connector":"NixlConnector","auth_token":"***"}']),
], ids=["flag-value", "flag-equals", "hf-token", "underscore", "password-secret", "camel", "bare-switch",
        "not-secret", "url-credentials", "json-field", "json-equals"])
def test_argv_masks_secret_values_in_both_spellings(args, expect):
    assert redact.argv(args) == expect


def test_argv_leaves_an_ordinary_command_as_it_was():
    cmd = ["python", "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m",
           "--kv-events-config", '{"enable_kv_cache_events":true,"topic":"kv-events"}', "--port", "8000"]
    assert redact.argv(cmd) == cmd


def test_env_masks_secret_named_variables():
    env = {"HF_TOKEN": SECRET, "VLLM_API_KEY": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET,
           "UCX_TLS": "tcp", "HTTPS_PROXY": f"http://me:{SECRET}@proxy:3128", "TOKENIZERS_PARALLELISM": "false"}
    assert redact.env(env) == {"HF_TOKEN": "***", "VLLM_API_KEY": "***", "AWS_SECRET_ACCESS_KEY": "***",
                               "UCX_TLS": "tcp", "HTTPS_PROXY": "http://***@proxy:3128",
                               "TOKENIZERS_PARALLELISM": "false"}


def test_the_supervisor_logs_its_command_masked():
    """The real supervisor running a real child: its 'started' line has the argv, without the secret."""
    code = ("import sys; from disagg.workers.supervisor import run; from disagg.workers.command import Command;"
            f"sys.exit(run(Command([sys.executable, '-c', 'pass', '--api-key', '{SECRET}', "
            f"'--hf-token={SECRET}'], {{}}), 1))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    started = next(e for e in events if e["event"] == "started")
    assert started["argv"][-3:] == ["--api-key", "***", "--hf-token=***"]
    assert SECRET not in out.stderr and SECRET not in out.stdout


def test_the_command_printout_is_masked():
    out = subprocess.run([sys.executable, "-P", "-m", "disagg.workers", "command", "--role", "decode",
                          "--model", "/m", "--", "--api-key", SECRET],
                         capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    assert SECRET not in out.stdout
    assert json.loads(out.stdout)["argv"].endswith("--api-key '***'")
