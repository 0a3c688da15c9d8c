"""The OpenAI server with Bole under load and faults (CPU, tiny Qwen3.5, one server for the module).

* the soak (``benchmarks/soak.py``): vLLM's serving benchmark plus a concurrent mix of greedy, seeded (prompts of up
  to 500 tokens, prefilled in chunks of 128), stop-string, ``n=2``, logprobs, JSON-schema, aborted and bad
  requests; nothing lost, no 5xx, greedy outputs equal to the same requests alone, the server back to idle;
* clients that disconnect after k = 0..5 streamed chunks, one at a time and all at once beside other requests: the
  same greedy request afterwards equals its reference taken before the aborts;
* stop strings that end inside a step of several accepted tokens: the output is the greedy reference cut right
  before the string, streamed or not.
"""

import asyncio
import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import soak  # noqa: E402

pytestmark = pytest.mark.vllm

TIMEOUT = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    srv = soak.start_server(log=log, startup_timeout=300)  # tiny Qwen3.5, Bole k=4 top-2, max_num_batched_tokens 128
    try:
        yield srv
    finally:
        srv.stop()


def _post(server, path: str, body: dict) -> dict:
    status, out = soak._sync_post(server.base, path, body, TIMEOUT)
    assert status == 200, f"{status} {out}\n{server.log_tail(3000)}"
    return out


def _prompts(n: int, words: int = 12) -> list[str]:
    from vllm_bole.testing.tiny_models import CORPUS_PATH

    text = CORPUS_PATH.read_text().split()
    return [" ".join(text[31 * i: 31 * i + words + 3 * i]) for i in range(n)]


def _greedy(server, prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def _stream_chunks(server, body: dict) -> tuple[list[list[int]], str, dict]:
    """A streamed completion: the token ids of each chunk, the text, and the last choice (finish reason...)."""
    req = urllib.request.Request(server.base + "/v1/completions", data=json.dumps(body | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, text, last = [], [], {}
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[5:])["choices"]:
                if choice.get("token_ids"):
                    chunks.append(choice["token_ids"])
                text.append(choice.get("text") or "")
                last = choice
    return chunks, "".join(text), last


def test_soak_300_requests(server):
    """≥ 300 requests: 200 through vLLM's serving benchmark, 160 in the mix (32 greedy, 24 seeded of which most
    prompts span several 128-token chunks, 16 stop strings, 16 n=2, 16 logprobs, 8 JSON schema, 24 aborts, 24 bad
    requests)."""
    result = soak.run(["--num-requests", "360", "--mix-requests", "160", "--max-tokens", "20", "--seed", "1",
                       "--max-concurrency", "16", "--mix-concurrency", "6", "--quiet-bench"], server=server)
    assert result["ok"] and result["lost"] == 0 and result["http_5xx"] == 0 and result["idle_ok"]
    assert result["bench"]["completed"] == 200 and result["bench"]["failed"] == 0
    assert result["mix"]["seeded"] == 24 and result["seeded_prompts_over_batch"] >= 10
    assert result["greedy_equal"] == result["greedy_total"] == 32
    assert result["aborted"] + result["aborts_finished_early"] == 24 and result["aborted"] >= 20
    assert result["stopped_by_string"] >= 12
    assert result["bench"]["spec_decode_acceptance_length"] > 1.5


def test_disconnects_after_k_chunks(server):
    """A streamed greedy request whose client goes after k = 0..5 chunks; then the same request, not streamed,
    equals its reference (taken before any abort). Then all six disconnects at once beside greedy requests of
    other prompts, whose outputs must equal their own references too; at the end the server is idle."""
    idle = soak.read_metrics(server.base)
    url = server.base + "/v1/completions"
    prompts = _prompts(4)
    bodies = [_greedy(server, p, 64) for p in prompts]
    refs = [_post(server, "/v1/completions", b)["choices"][0] for b in bodies]
    assert all(len(r["token_ids"]) == 64 for r in refs)

    for k in range(6):
        status, what = asyncio.run(soak.disconnect_after(url, bodies[0], k, TIMEOUT))
        assert (status, what) == (200, "aborted"), (k, status, what)
        again = _post(server, "/v1/completions", bodies[0])["choices"][0]
        assert again["token_ids"] == refs[0]["token_ids"] and again["text"] == refs[0]["text"], k

    async def together():
        aborts = [soak.disconnect_after(url, bodies[0], k, TIMEOUT) for k in range(6)]
        others = [asyncio.to_thread(_post, server, "/v1/completions", b) for b in bodies[1:]]
        return await asyncio.gather(*aborts, *others)

    outs = asyncio.run(together())
    assert all(o == (200, "aborted") for o in outs[:6]), outs[:6]
    for out, ref in zip(outs[6:], refs[1:]):
        assert out["choices"][0]["token_ids"] == ref["token_ids"]
    again = _post(server, "/v1/completions", bodies[0])["choices"][0]
    assert again["token_ids"] == refs[0]["token_ids"] and again["text"] == refs[0]["text"]
    ok, now, _ = soak._wait_idle(server.base, idle, 15)
    assert ok, (now, idle)


def test_stop_strings_inside_accepted_steps(server):
    """Stop strings that end inside a step that emitted several tokens (the reference's streamed chunks, one per
    step, show where its steps ended): at the end of a token that is not its step's last, or one character into
    the next token of the same step. The output is the reference cut right before the string's first occurrence,
    finish reason "stop", streamed or not; a streamed run's token ids (vLLM cuts the text, not the step's tokens)
    go on past the string within that step."""
    max_tokens, cases = 40, []
    for prompt in _prompts(8, words=8):
        body = _greedy(server, prompt, max_tokens)
        chunks, text, _ = _stream_chunks(server, body)
        ids = [t for c in chunks for t in c]
        ref = _post(server, "/v1/completions", body)["choices"][0]
        assert ids == ref["token_ids"] and text == ref["text"]
        # the text up to and including token j
        upto = [_post(server, "/detokenize", {"model": server.model, "tokens": ids[:j + 1]})["prompt"]
                for j in range(len(ids))]
        pos = 0
        for chunk in chunks:
            for j in range(pos, pos + len(chunk) - 1):  # token j is not the last of its step, token j + 1 is in it
                a, b = upto[j], upto[j + 1]
                if not (text.startswith(b) and len(a) >= 3 and len(b) > len(a)):
                    continue
                # ends with token j; ends one character into token j + 1
                for stop, last_token in ((a[-3:], j), (b[len(a) - 2:len(a) + 1], j + 1)):
                    start = len(a) + (last_token - j) - 3
                    if stop.strip() and text.find(stop) == start:
                        cases.append((body, stop, text[:start], last_token, ids))
            pos += len(chunk)
    picked = cases[::max(1, len(cases) // 16)][:16]  # spread over the prompts
    assert len(picked) >= 8, f"only {len(cases)} stop strings inside multi-token steps"
    past_stop = 0
    for body, stop, want, last_token, ids in picked:
        out = _post(server, "/v1/completions", body | {"stop": [stop]})["choices"][0]
        assert (out["text"], out["finish_reason"], out["stop_reason"]) == (want, "stop", stop), (stop, out, want)
        assert out["token_ids"] == ids[:len(out["token_ids"])] and len(out["token_ids"]) > last_token
        chunks, text, last = _stream_chunks(server, body | {"stop": stop})
        got = [t for c in chunks for t in c]
        assert (text, last.get("finish_reason")) == (want, "stop"), (stop, text, want)
        assert got == ids[:len(got)] and len(got) > last_token
        past_stop += len(got) > last_token + 1
    assert past_stop >= len(picked) // 2, f"only {past_stop} of {len(picked)} stops inside a step that went on"


def test_a_benchmark_stopped_by_sigterm_stops_its_server(tmp_path):
    """``timeout`` or a job's stop sends SIGTERM; the server runs in its own session, so without
    ``exit_on_sigterm`` it outlived the benchmark and held the GPU (the next server then failed to start)."""
    import os
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "server.pid"
    script = f"""
import subprocess, sys, time
sys.path.insert(0, {str(Path(soak.__file__).parent)!r})
import soak
soak.exit_on_sigterm()
proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
server = soak.Server("http://127.0.0.1:1", "m", proc, None, [])
open({str(pid_file)!r}, "w").write(str(proc.pid))
try:
    time.sleep(600)
finally:
    server.stop(timeout=10)
"""
    bench = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and bench.poll() is None
        time.sleep(0.1)
    server_pid = int(pid_file.read_text())
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=30) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
