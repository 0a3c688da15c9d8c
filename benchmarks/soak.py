#!/usr/bin/env python3
"""Soak: vLLM's OpenAI server with Bole under load and faults; nothing may be lost, fail or stay behind.

    python benchmarks/soak.py                                         # tiny Qwen3.5 (built offline), 300 requests
    python benchmarks/soak.py --num-requests 2000 --out benchmarks/results/soak_cpu.json
    python benchmarks/soak.py --model Qwen/Qwen3.5-9B --max-model-len 4096 --max-num-batched-tokens 0 \\
        --server-args "--max-num-seqs 64" --max-concurrency 64 --output-len 128 --max-tokens 128

Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with ``--speculative-config`` (default Bole,
4 draft tokens, top-2), waits for /health and reads the idle /metrics, then runs two loads at the same time:

* ``--num-requests`` minus the mix through vLLM's own serving benchmark client (``vllm bench serve``'s module,
  dataset ``random``, ``--ignore-eos``, ``--max-concurrency``): every one must complete with its full length;
* a mix (``--mix-requests``, default a third of ``--num-requests``) sent by an aiohttp client, ``--mix-concurrency``
  at a time, of token-id prompts cut from a corpus (4 to 500 tokens, so that prompts are prefilled in chunks under
  a small ``--max-num-batched-tokens``): greedy requests (half of them streamed), seeded sampled requests,
  greedy requests with stop strings (taken from the middle of the request's greedy continuation, fetched alone
  before the load), ``n=2``, ``logprobs`` (and ``prompt_logprobs``), a JSON-schema ``response_format`` (chat),
  streaming requests whose client disconnects after k = 0..5 chunks, and bad requests (answered 400/404).

Then checks: every request that was not aborted completed with its length (``max_tokens`` with ``ignore_eos``, or
the finish reason it should have: a stop string's output is its greedy reference cut right before the first
occurrence of the string), zero lost requests (exception or timeout), zero HTTP 5xx, the bad requests got their
4xx, every greedy output equals the same request sent alone to the same server after the load, and
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` are back to their idle
values within ``--idle-timeout`` seconds after the load. Seeded requests are sent alone again after the load too;
how many reproduce is reported (``--check-seeded`` makes it a check). Prints one summary line, writes ``--out``
(JSON) if given, exits 1 when a check fails (``run`` raises ``SoakFailure``) and prints the tail of the server's
log then. The server is always terminated at the end.

Importable: ``run(argv, server=None)`` returns the result dict; ``start_server`` / ``Server.stop`` let a test share
one server between the soak and other tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_SPEC = {"method": "bole", "num_speculative_tokens": 4, "topk": 2}

# Share of each kind in the mix (largest remainder over --mix-requests).
MIX_WEIGHTS = {"greedy": 4, "seeded": 3, "stop": 2, "n2": 2, "logprobs": 2, "structured": 1, "abort": 3, "bad": 3}

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "enum": [7, 21, 64]}},
          "required": ["name", "age"], "additionalProperties": False}

NEVER = "\u00a7\u00a7never\u00a7\u00a7"  # a stop string that no continuation contains


class SoakFailure(AssertionError):
    """A soak check failed; ``result`` holds the soak's result dict."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", help="model to serve (default: the tiny Qwen3.5 built offline)")
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC), help="JSON (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra api_server arguments (one shell-quoted string)")
    p.add_argument("--max-model-len", type=int, default=1024, help="0: vLLM's default")
    p.add_argument("--max-num-batched-tokens", type=int, default=128,
                   help="small, so that long prompts are prefilled in chunks (0: vLLM's default)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="0: vLLM's default")
    p.add_argument("--base-url", help="use this running server instead of starting one (no log, no idle KV read "
                                      "before it was loaded by others)")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--log", help="server log file (default: a temporary file)")
    p.add_argument("--num-requests", type=int, default=300, help="requests in all: the benchmark's and the mix's")
    p.add_argument("--mix-requests", type=int, help="of which the mix (default: a third)")
    p.add_argument("--skip", default="", help=f"comma-separated mix kinds to leave out ({','.join(MIX_WEIGHTS)})")
    p.add_argument("--max-concurrency", type=int, default=16, help="the benchmark client's concurrency")
    p.add_argument("--mix-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32, help="the benchmark's prompt length")
    p.add_argument("--output-len", type=int, default=16, help="the benchmark's output length")
    p.add_argument("--max-tokens", type=int, default=16, help="the mix's max_tokens (greedy ones vary below it)")
    p.add_argument("--max-prompt-len", type=int, default=500, help="the mix's longest prompt (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole load")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one mix request")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--idle-timeout", type=float, default=15.0, help="seconds for /metrics to be back to idle")
    p.add_argument("--check-seeded", action="store_true",
                   help="fail when a seeded request sent alone after the load differs from its output under load")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--quiet-bench", action="store_true", help="hide the benchmark client's printout")
    return p


# --------------------------------------------------------------------------------------------------- the server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """A started api_server (``proc`` None for one started elsewhere)."""

    def __init__(self, base: str, model: str, proc: subprocess.Popen | None = None, log: Path | None = None,
                 cmd: list[str] | None = None):
        self.base, self.model, self.proc, self.log, self.cmd = base, model, proc, log, cmd

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        if self.log is None or not self.log.exists():
            return "(no server log)"
        data = self.log.read_bytes()[-chars:]
        return data.decode(errors="replace")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM the server, then SIGKILL its process group (the engine's processes) if it does not exit."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a job's stop) into ``SystemExit`` so that ``finally`` blocks stop the server:
    the server runs in its own session, and a killed benchmark would otherwise leave it holding the GPU."""
    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def _tiny_model() -> tuple[str, list[str]]:
    from vllm_bole.testing.tiny_models import engine_kwargs, tiny_model_dir

    args = ["--dtype", "bfloat16", "--enforce-eager", "--language-model-only"]
    extra = engine_kwargs("qwen3_5").get("additional_config")
    if extra:
        args += ["--additional-config", json.dumps(extra)]
    return tiny_model_dir("qwen3_5"), args


def start_server(model: str | None = None, speculative_config: str | dict | None = None,
                 server_args: list[str] | str = (), max_model_len: int = 1024, max_num_batched_tokens: int = 128,
                 max_num_seqs: int = 32, port: int = 0, log: str | os.PathLike | None = None,
                 startup_timeout: float = 600.0) -> Server:
    """Start vLLM's OpenAI server on 127.0.0.1 and wait for /health; raise (with the log's tail) if it does not
    come up. ``model`` None serves the tiny Qwen3.5 (with its CPU arguments)."""
    args: list[str] = []
    if model is None:
        model, args = _tiny_model()
    spec = speculative_config if speculative_config is not None else DEFAULT_SPEC
    if not isinstance(spec, str):
        spec = json.dumps(spec)
    port = port or _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), *args]
    for flag, value in (("--max-model-len", max_model_len), ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--max-num-seqs", max_num_seqs)):
        if value:
            cmd += [flag, str(value)]
    if spec:
        cmd += ["--speculative-config", spec]
    cmd += shlex.split(server_args) if isinstance(server_args, str) else list(server_args)
    if log is None:
        fd, log = tempfile.mkstemp(prefix="soak-server-", suffix=".log")
        os.close(fd)
    log = Path(log)
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; only read by vLLM's CPU platform
    if os.path.isdir(model):
        env["HF_HUB_OFFLINE"] = "1"
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL)
    server = Server(f"http://127.0.0.1:{port}", model, proc, log, cmd)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if _get(server.base + "/health", timeout=2)[0] == 200:
                    return server
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_timeout:.0f} s:\n{server.log_tail()}")
            time.sleep(1.0)
    except BaseException:
        server.stop()
        raise


def metric_sums(text: str, names) -> dict[str, float]:
    """Each of ``names`` (exact metric names) in a Prometheus /metrics text, summed over its label sets; names
    with no sample are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def read_metrics(base: str) -> dict[str, float]:
    """The idle-relevant gauges, summed over their label sets (None when absent)."""
    status, body = _get(base + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return metric_sums(body.decode(), ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                       "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"))


def _finished_by_reason(base: str) -> dict[str, float]:
    status, body = _get(base + "/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in body.decode().splitlines() if status == 200 else ():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="' in line:
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# --------------------------------------------------------------------------------------------------- the plan

def _split(total: int, weights: dict[str, int]) -> dict[str, int]:
    """``total`` over the kinds by weight (largest remainder; ties by order)."""
    wsum = sum(weights.values())
    if not wsum:
        return {}
    exact = {k: total * w / wsum for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(weights, key=lambda k: -(exact[k] - counts[k]))[:total - sum(counts.values())]:
        counts[k] += 1
    return counts


def _bad_cases(model: str, max_model_len: int) -> list[tuple[str, str, object, int]]:
    """(name, path, body (a dict, or bytes sent as is), expected status)."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    base = {"model": model, "prompt": "Hi", "max_tokens": 4}
    return [
        ("max_tokens -3", comp, base | {"max_tokens": -3}, 400),
        ("prompt over max_model_len", comp, base | {"prompt": [17] * (max_model_len + 8)}, 400),
        ("unknown model", comp, base | {"model": "no-such-model"}, 404),
        ("temperature -1", comp, base | {"temperature": -1}, 400),
        ("n 0", comp, base | {"n": 0}, 400),
        ("logprobs 1000", comp, base | {"logprobs": 1000}, 400),
        ("max_tokens over max_model_len", comp, base | {"max_tokens": max_model_len + 1}, 400),
        ("broken json", comp, b'{"model": "x", "prompt": "Hi",', 400),
        ("token id out of vocabulary", comp, base | {"prompt": [50_000_000]}, 400),
        ("top_p 0", comp, base | {"top_p": 0}, 400),
        ("chat unknown model", chat, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404),
        ("chat messages not a list", chat, {"model": model, "messages": "x"}, 400),
        ("invalid json schema", comp, base | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}, 400),
    ]


def _plan(opts, model: str, max_len: int, corpus: list[int], n_mix: int) -> list[dict]:
    rng = random.Random(opts.seed)
    skip = {s.strip() for s in opts.skip.split(",") if s.strip()}
    unknown = skip - set(MIX_WEIGHTS)
    if unknown:
        raise ValueError(f"--skip: unknown kinds {sorted(unknown)}")
    counts = _split(n_mix, {k: w for k, w in MIX_WEIGHTS.items() if k not in skip})
    abort_tokens = max(64, 4 * opts.max_tokens)
    longest = max(8, min(opts.max_prompt_len, max_len - max(abort_tokens, 64) - 8))

    def prompt(long: bool | None = None) -> list[int]:
        if long is None:
            long = rng.random() < 0.5
        n = rng.randint(min(100, longest), longest) if long else rng.randint(4, min(64, longest))
        start = rng.randrange(len(corpus))
        return [corpus[(start + j) % len(corpus)] for j in range(n)]

    mt = opts.max_tokens
    bad = _bad_cases(model, max_len)
    items: list[dict] = []
    for kind, count in counts.items():
        for j in range(count):
            it: dict = {"kind": kind}
            common = {"model": model, "return_token_ids": True}
            if kind == "greedy":
                it["stream"] = j % 2 == 1
                it["body"] = common | {"prompt": prompt(), "max_tokens": rng.randint(max(1, mt // 2), mt),
                                       "temperature": 0, "ignore_eos": True}
            elif kind == "seeded":
                body = common | {"prompt": prompt(long=j % 3 != 2), "max_tokens": mt, "temperature": 0.8,
                                 "seed": rng.randrange(1 << 31), "ignore_eos": True}
                if j % 2:
                    body |= {"top_p": 0.95, "top_k": 50}
                it["body"] = body
            elif kind == "stop":  # its stop string comes from its reference, fetched before the load
                it["body"] = common | {"prompt": prompt(), "max_tokens": max(mt, 12), "temperature": 0,
                                       "ignore_eos": True}
                it["stop_list"] = j % 2 == 1
            elif kind == "n2":
                body = common | {"prompt": prompt(), "max_tokens": mt, "temperature": 0.8, "n": 2,
                                 "ignore_eos": True}
                if j % 2:
                    body["seed"] = rng.randrange(1 << 31)
                it["body"] = body
            elif kind == "logprobs":
                body = common | {"prompt": prompt(), "max_tokens": mt, "temperature": 0 if j % 2 == 0 else 0.8,
                                 "logprobs": 3, "ignore_eos": True}
                if j % 2 == 0:
                    body["prompt_logprobs"] = 1
                it["body"] = body
            elif kind == "structured":
                body = {"model": model, "max_tokens": 64,
                        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "person", "schema": SCHEMA}}}
                body |= {"temperature": 0} if j % 2 == 0 else {"temperature": 0.8, "seed": rng.randrange(1 << 31)}
                it["body"] = body
            elif kind == "abort":
                body = common | {"prompt": prompt(), "max_tokens": abort_tokens, "stream": True, "ignore_eos": True,
                                 "temperature": 0 if j % 2 == 0 else 0.8}
                if j % 4 == 3:
                    body["seed"] = rng.randrange(1 << 31)
                it["body"], it["k"] = body, j % 6
            elif kind == "bad":
                it["name"], it["path"], it["body"], it["expect"] = bad[j % len(bad)]
            items.append(it)
    rng.shuffle(items)
    for i, it in enumerate(items):
        it["i"] = i
    return items


# --------------------------------------------------------------------------------------------------- the mix

class Tally:
    def __init__(self):
        self.failures: list[str] = []
        self.lost = 0
        self.http_5xx = 0
        self.aborted = 0
        self.aborts_finished_early = 0
        self.done: set[int] = set()  # mix requests that came to an end (any outcome)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)


async def _post(session, url: str, body, timeout: float) -> tuple[int, object]:
    import aiohttp

    kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    async with session.post(url, timeout=aiohttp.ClientTimeout(total=timeout), **kwargs) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")


async def sse_events(response):
    """The JSON events of an OpenAI streamed response as they arrive, up to ``[DONE]``; RuntimeError if the stream
    ends without it."""
    async for line in response.content:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)
    raise RuntimeError("stream ended without [DONE]")


async def _stream(session, url: str, body: dict, timeout: float) -> tuple[int, object]:
    """A streamed completion collected into one choice (text, token ids, finish reason) and usage."""
    import aiohttp

    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raw = await r.read()
            return r.status, raw.decode(errors="replace")
        text, ids, finish, usage = [], [], None, None
        async for chunk in sse_events(r):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or ():
                text.append(c.get("text") or "")
                ids += c.get("token_ids") or []
                finish = c.get("finish_reason") or finish
        return 200, {"choices": [{"text": "".join(text), "token_ids": ids, "finish_reason": finish}],
                     "usage": usage}


def _check_length(it: dict, out: dict, tally: Tally) -> bool:
    body, choices = it["body"], out.get("choices") or []
    n, mt = body.get("n", 1), body["max_tokens"]
    ok = len(choices) == n
    for c in choices:
        ok &= len(c.get("token_ids") or ()) == mt and c.get("finish_reason") == "length"
    usage = out.get("usage") or {}
    ok &= usage.get("completion_tokens") == n * mt
    if not ok:
        got = [(len(c.get("token_ids") or ()), c.get("finish_reason")) for c in choices]
        tally.fail(f"#{it['i']} {it['kind']}: expected {n} x {mt} tokens (length), got {got}, usage {usage}")
    return ok


def _check_logprobs(it: dict, out: dict, tally: Tally) -> None:
    body = it["body"]
    k, choice = body["logprobs"], out["choices"][0]
    lp = choice.get("logprobs") or {}
    tokens, top, chosen = lp.get("tokens") or [], lp.get("top_logprobs") or [], lp.get("token_logprobs") or []
    mt = body["max_tokens"]
    problems = []
    if not (len(tokens) == len(top) == len(chosen) == mt):
        problems.append(f"{len(tokens)} tokens, {len(top)} top, {len(chosen)} chosen for {mt}")
    for j, (t, d, c) in enumerate(zip(tokens, top, chosen)):
        if not d or len(d) < k or c is None or not math.isfinite(c) or c > 1e-6:
            problems.append(f"token {j}: top {d}, chosen {c}")
        elif body["temperature"] == 0 and c < max(d.values()) - 1e-3:
            problems.append(f"token {j} {t!r}: greedy token's logprob {c} below the top {max(d.values())}")
    if "prompt_logprobs" in body:
        plp, ids = choice.get("prompt_logprobs"), body["prompt"]
        if not isinstance(plp, list) or len(plp) != len(ids) or plp[0] is not None:
            problems.append(f"prompt_logprobs: {type(plp).__name__} of {len(plp or ())} for {len(ids)} tokens")
        else:
            for j in range(1, len(ids)):
                if not plp[j] or str(ids[j]) not in plp[j]:
                    problems.append(f"prompt token {j} ({ids[j]}) missing from {plp[j]}")
                    break
    if problems:
        tally.fail(f"#{it['i']} logprobs: " + "; ".join(problems[:3]))


def _check_structured(it: dict, out: dict, tally: Tally) -> None:
    choice = out["choices"][0]
    content = (choice.get("message") or {}).get("content")
    try:
        value = json.loads(content)
        ok = (choice.get("finish_reason") == "stop" and isinstance(value, dict) and set(value) == {"name", "age"}
              and isinstance(value["name"], str) and len(value["name"]) <= 6 and value["age"] in (7, 21, 64))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        tally.fail(f"#{it['i']} structured: {choice.get('finish_reason')} {content!r}")


async def disconnect_after(url: str, body: dict, k: int, timeout: float) -> tuple[int, str]:
    """Stream ``body`` (``stream`` set), read ``k`` chunks (SSE events), then close the connection so that the server
    sees its client go. Returns (HTTP status, "aborted" | "finished" when the stream ended first | the error body);
    raises when the server closes the stream before [DONE]."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        r = await session.post(url, json=body | {"stream": True}, timeout=aiohttp.ClientTimeout(total=timeout))
        try:
            if r.status != 200:
                return r.status, (await r.read()).decode(errors="replace")
            chunks = 0
            while chunks < k:
                line = await r.content.readline()
                if not line:
                    raise RuntimeError(f"stream closed by the server after {chunks} chunks")
                line = line.strip()
                if line == b"data: [DONE]":
                    return 200, "finished"
                if line.startswith(b"data:"):
                    chunks += 1
            return 200, "aborted"
        finally:
            r.close()  # drops the connection


async def _abort(it: dict, url: str, timeout: float, tally: Tally) -> None:
    status, what = await disconnect_after(url, it["body"], it["k"], timeout)
    if not _status(it, status, what, tally):
        return
    if what == "finished":
        tally.aborts_finished_early += 1
    else:
        tally.aborted += 1


def _status(it: dict, status: int, out, tally: Tally) -> bool:
    return _ok(f"#{it['i']} {it['kind']}", status, out, tally)


def _ok(label: str, status: int, out, tally: Tally) -> bool:
    """True for HTTP 200; otherwise the failure is counted (5xx separately) and said with ``label``."""
    if status >= 500:
        tally.http_5xx += 1
    if status != 200:
        tally.fail(f"{label}: HTTP {status}: {str(out)[:300]}")
        return False
    return True


async def _one(it: dict, session, base: str, opts, tally: Tally, results: dict) -> None:
    kind, body, timeout = it["kind"], it["body"], opts.request_timeout
    comp = base + "/v1/completions"
    try:
        if kind == "abort":
            await _abort(it, comp, timeout, tally)
            return
        if kind == "bad":
            status, out = await _post(session, base + it["path"], body, timeout)
            if status >= 500:
                tally.http_5xx += 1
            if status != it["expect"]:
                tally.fail(f"#{it['i']} bad request {it['name']!r}: HTTP {status} (expected {it['expect']}): "
                           f"{str(out)[:200]}")
            return
        if kind == "structured":
            status, out = await _post(session, base + "/v1/chat/completions", body, timeout)
            if _status(it, status, out, tally):
                _check_structured(it, out, tally)
            return
        if kind == "stop":
            body = body | {"stop": [it["stop"], NEVER] if it["stop_list"] else it["stop"]}
        if it.get("stream"):
            status, out = await _stream(session, comp, body, timeout)
        else:
            status, out = await _post(session, comp, body, timeout)
        if not _status(it, status, out, tally):
            return
        results[it["i"]] = out
        if kind == "stop":
            _check_stop(it, out, tally)
            return
        if _check_length(it, out, tally) and kind == "logprobs":
            _check_logprobs(it, out, tally)
    except Exception as e:  # timeouts, aiohttp's errors, a broken reply: the request is lost, the soak goes on
        tally.lost += 1
        tally.fail(f"#{it['i']} {kind}: lost: {type(e).__name__}: {e}")
    finally:
        tally.done.add(it["i"])


def _check_stop(it: dict, out: dict, tally: Tally) -> None:
    choice = out["choices"][0]
    text, ids = choice.get("text"), choice.get("token_ids") or []
    ref_text, ref_ids, stop = it["ref_text"], it["ref_ids"], it["stop"]
    cut = ref_text.find(stop)
    want_text, want_finish = (ref_text[:cut], "stop") if cut >= 0 else (ref_text, "length")
    # vLLM cuts the text at the stop string, not the step's tokens after it: the ids are a prefix of the reference.
    ok = (text == want_text and choice.get("finish_reason") == want_finish and stop not in text
          and ids == ref_ids[:len(ids)] and 0 < len(ids) <= it["body"]["max_tokens"])
    if ok and want_finish == "stop":
        ok = choice.get("stop_reason") == stop
    if not ok:
        tally.fail(f"#{it['i']} stop {stop!r}: got {text!r} ({choice.get('finish_reason')}, "
                   f"{choice.get('stop_reason')!r}), want {want_text!r} ({want_finish}); reference {ref_text!r}")
    else:
        it["stopped"] = want_finish == "stop"


def _pick_stop(text: str, rng: random.Random) -> str:
    """A few characters from the middle of ``text`` (not blank); the whole text when it is short."""
    if len(text) < 6:
        return text or NEVER
    for _ in range(20):
        pos = rng.randrange(len(text) // 3, max(len(text) // 3 + 1, 2 * len(text) // 3))
        stop = text[pos:pos + rng.randint(2, 5)]
        if stop.strip():
            return stop
    return text[len(text) // 2:]


async def _mix(items: list[dict], base: str, opts, tally: Tally, results: dict) -> None:
    import aiohttp

    sem = asyncio.Semaphore(opts.mix_concurrency)
    connector = aiohttp.TCPConnector(limit=opts.mix_concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def guarded(it):
            async with sem:
                await _one(it, session, base, opts, tally, results)
        await asyncio.gather(*(guarded(it) for it in items))


async def _bench(base: str, model: str, n: int, opts) -> dict:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", base, "--model", model, "--dataset-name", "random",
        "--random-input-len", str(opts.input_len), "--random-output-len", str(opts.output_len),
        "--num-prompts", str(n), "--ignore-eos", "--seed", str(opts.seed), "--max-concurrency",
        str(opts.max_concurrency), "--disable-tqdm", "--save-detailed", "--ready-check-timeout-sec",
        str(int(min(opts.timeout, 600)))])
    if opts.quiet_bench:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            return await serve.main_async(args)
    return await serve.main_async(args)


async def _load(server: Server, opts, items: list[dict], n_bench: int, tally: Tally, results: dict):
    bench_out: dict = {}
    times: dict = {}

    async def bench():
        t = time.monotonic()
        if n_bench:
            bench_out.update(await _bench(server.base, server.model, n_bench, opts))
        times["bench_s"] = time.monotonic() - t

    async def mix():
        t = time.monotonic()
        await _mix(items, server.base, opts, tally, results)
        times["mix_s"] = time.monotonic() - t

    async def watchdog():
        while server.alive():
            await asyncio.sleep(1.0)

    work = asyncio.ensure_future(asyncio.gather(bench(), mix()))
    dog = asyncio.ensure_future(watchdog())
    done, _ = await asyncio.wait({work, dog}, timeout=opts.timeout, return_when=asyncio.FIRST_COMPLETED)
    dog.cancel()
    if work not in done:
        work.cancel()
        try:
            await work
        except BaseException:
            pass
        tally.fail("server exited during the load" if dog in done else f"load not done in {opts.timeout:.0f} s")
    elif work.exception() is not None:
        e = work.exception()
        tally.fail(f"load raised {type(e).__name__}: {e}")
    return bench_out, times


# --------------------------------------------------------------------------------------------------- the run

def _sync_post(base: str, path: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:500]}


def _alone(base: str, body: dict, timeout: float, tally: Tally) -> dict | None:
    """One request with nothing else in flight (references after the load)."""
    try:
        status, out = _sync_post(base, "/v1/completions", {k: v for k, v in body.items() if k != "stream"}, timeout)
    except (OSError, ValueError) as e:
        tally.lost += 1
        tally.fail(f"reference lost: {type(e).__name__}: {e}")
        return None
    return out if _ok("reference", status, out, tally) else None


def _wait_idle(base: str, idle: dict, timeout: float) -> tuple[bool, dict, float]:
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    while True:
        try:
            now = read_metrics(base)
        except (OSError, RuntimeError) as e:
            now = {"error": str(e)}
        ok = (now.get("vllm:num_requests_running") == 0 and now.get("vllm:num_requests_waiting") == 0
              and "vllm:kv_cache_usage_perc" in now
              and abs(now["vllm:kv_cache_usage_perc"] - idle["vllm:kv_cache_usage_perc"]) <= 1e-9)
        if ok or time.monotonic() > deadline:
            return ok, now, time.monotonic() - t0
        time.sleep(0.25)


def run(argv: list[str] | None = None, server: Server | None = None) -> dict:
    """Run the soak; return its result dict or raise ``SoakFailure``. ``server``: an already started server
    (left running); else one is started (``--base-url``: a running one) and always stopped at the end."""
    opts = build_parser().parse_args(argv)
    t_start = time.monotonic()
    own = None
    if server is None:
        if opts.base_url:
            status, body = _get(opts.base_url.rstrip("/") + "/v1/models")
            server = Server(opts.base_url.rstrip("/"), json.loads(body)["data"][0]["id"])
        else:
            server = own = start_server(opts.model, opts.speculative_config, opts.server_args, opts.max_model_len,
                                        opts.max_num_batched_tokens, opts.max_num_seqs, opts.port, opts.log,
                                        opts.startup_timeout)
    start_s = time.monotonic() - t_start
    old_offline = os.environ.get("HF_HUB_OFFLINE")
    if os.path.isdir(server.model):
        os.environ["HF_HUB_OFFLINE"] = "1"  # the benchmark client loads the tokenizer
    try:
        result = _run(opts, server, t_start, start_s, list(sys.argv[1:] if argv is None else argv))
    finally:
        if old_offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_offline
        if own is not None:
            own.stop()
    return result


def _run(opts, server: Server, t_start: float, start_s: float, argv: list[str]) -> dict:
    from vllm_bole.testing.tiny_models import CORPUS_PATH

    tally = Tally()
    rng = random.Random(opts.seed + 1)
    base, model = server.base, server.model
    n_mix = opts.mix_requests if opts.mix_requests is not None else opts.num_requests // 3
    n_mix = min(n_mix, opts.num_requests)
    n_bench = opts.num_requests - n_mix

    idle = read_metrics(base)
    finished_before = _finished_by_reason(base)
    status, tok = _sync_post(base, "/tokenize", {"model": model, "prompt": CORPUS_PATH.read_text(),
                                                 "add_special_tokens": False}, 60)
    if status != 200:
        raise RuntimeError(f"/tokenize answered {status}: {tok}")
    status, models = _get(base + "/v1/models")
    max_len = json.loads(models)["data"][0]["max_model_len"]
    items = _plan(opts, model, max_len, tok["tokens"], n_mix)

    # Stop strings: from each request's greedy continuation, fetched alone before the load.
    for it in items:
        if it["kind"] == "stop":
            ref = _alone(base, it["body"], opts.request_timeout, tally)
            choice = (ref or {}).get("choices", [{}])[0]
            it["ref_text"], it["ref_ids"] = choice.get("text", ""), choice.get("token_ids") or []
            it["stop"] = _pick_stop(it["ref_text"], rng)

    results: dict[int, dict] = {}
    t_load = time.monotonic()
    bench_out, times = asyncio.run(_load(server, opts, items, n_bench, tally, results))
    load_s = time.monotonic() - t_load
    unfinished = [it["i"] for it in items if it["i"] not in tally.done]  # cancelled by a timeout or a dead server
    if unfinished:
        tally.lost += len(unfinished)
        tally.fail(f"{len(unfinished)} mix requests never finished: {unfinished[:20]}")

    # Back to idle: nothing running or waiting, the KV cache as empty as before the load.
    idle_ok, idle_after, idle_wait_s = (False, {}, 0.0)
    if server.alive():
        idle_ok, idle_after, idle_wait_s = _wait_idle(base, idle, opts.idle_timeout)
    if not idle_ok:
        tally.fail(f"not back to idle within {opts.idle_timeout:.0f} s: {idle_after} (idle before: {idle})")

    # The benchmark's requests: all complete, full length.
    bench = {k: bench_out.get(k) for k in ("completed", "failed", "total_input_tokens", "total_output_tokens",
                                           "duration", "request_throughput", "output_throughput",
                                           "spec_decode_acceptance_length", "spec_decode_num_drafts",
                                           "spec_decode_acceptance_rate")}
    bench["errors"] = [e for e in bench_out.get("errors") or () if e][:5]
    if n_bench:
        if not bench_out:
            tally.lost += n_bench
        else:
            tally.lost += n_bench - (bench["completed"] or 0)
            if bench["completed"] != n_bench or bench["failed"] or \
                    bench["total_output_tokens"] != n_bench * opts.output_len:
                tally.fail(f"benchmark: {bench['completed']}/{n_bench} completed, {bench['failed']} failed, "
                           f"{bench['total_output_tokens']} output tokens (want {n_bench * opts.output_len}); "
                           f"errors {bench['errors']}")

    # Greedy outputs against the same request alone; seeded ones reported (checked with --check-seeded).
    greedy_equal = greedy_total = seeded_equal = seeded_total = 0
    for it in items:
        if it["kind"] not in ("greedy", "seeded") or not server.alive():
            continue
        out = results.get(it["i"])
        if out is None:
            continue  # already counted as failed or lost
        ref = _alone(base, it["body"], opts.request_timeout, tally)
        if ref is None:
            continue
        got, want = out["choices"][0], ref["choices"][0]
        same = got.get("token_ids") == want.get("token_ids") and got.get("text") == want.get("text")
        if it["kind"] == "greedy":
            greedy_total += 1
            greedy_equal += same
            if not same:
                tally.fail(f"#{it['i']} greedy{' (streamed)' if it.get('stream') else ''}: under load "
                           f"{got.get('token_ids')} != alone {want.get('token_ids')}")
        else:
            seeded_total += 1
            seeded_equal += same
            if not same and opts.check_seeded:
                tally.fail(f"#{it['i']} seeded: under load {got.get('token_ids')} != alone {want.get('token_ids')}")

    alive = server.alive()
    healthy = False
    if alive:
        try:
            healthy = _get(base + "/health", timeout=10)[0] == 200
        except OSError:
            pass
    if not healthy:
        tally.fail(f"server {'not healthy' if alive else 'exited'} after the load")
    finished = _finished_by_reason(base) if healthy else {}
    finished = {k: finished.get(k, 0.0) - finished_before.get(k, 0.0) for k in finished}

    counts: dict[str, int] = {}
    for it in items:
        counts[it["kind"]] = counts.get(it["kind"], 0) + 1
    n_stops = sum(1 for it in items if it.get("stopped"))
    prompt_lens: dict[str, list[int]] = {}
    for it in items:
        if isinstance(it["body"], dict) and isinstance(it["body"].get("prompt"), list) and it["kind"] != "bad":
            prompt_lens.setdefault(it["kind"], []).append(len(it["body"]["prompt"]))
    wall = time.monotonic() - t_start
    preemptions = idle_after.get("vllm:num_preemptions_total", 0.0) - idle.get("vllm:num_preemptions_total", 0.0)
    mix_desc = ", ".join(f"{counts[k]} {k}" for k in MIX_WEIGHTS if k in counts)
    summary = (f"soak: {opts.num_requests} requests (bench {n_bench}, mix {n_mix}: {mix_desc}), {tally.lost} lost, "
               f"{tally.http_5xx} 5xx, {tally.aborted} aborted, {n_stops} stopped by strings, {preemptions:.0f} "
               f"preemptions, greedy {greedy_equal}/{greedy_total} equal, seeded repro {seeded_equal}/{seeded_total}, "
               f"idle {'ok' if idle_ok else 'NOT ok'}, acceptance length "
               f"{_fmt(bench.get('spec_decode_acceptance_length'))}, {wall:.1f} s")
    ok = not tally.failures and tally.lost == 0 and tally.http_5xx == 0
    if not ok:
        summary += f", FAILED ({len(tally.failures)} failures)"
    chunk = opts.max_num_batched_tokens or 1 << 30
    result = {
        "ok": ok, "summary": summary, "argv": argv, "commit": _commit(), "options": vars(opts),
        "server_cmd": server.cmd, "num_requests": opts.num_requests, "bench_requests": n_bench, "mix_requests": n_mix,
        "mix": counts, "lost": tally.lost, "http_5xx": tally.http_5xx, "aborted": tally.aborted,
        "aborts_finished_early": tally.aborts_finished_early, "stopped_by_string": n_stops, "preemptions": preemptions,
        "greedy_equal": greedy_equal, "greedy_total": greedy_total, "seeded_equal": seeded_equal,
        "seeded_total": seeded_total, "prompt_len_range": {k: [min(v), max(v)] for k, v in prompt_lens.items()},
        "seeded_prompts_over_batch": sum(n > chunk for n in prompt_lens.get("seeded", ())),
        "idle_ok": idle_ok, "idle_before": idle, "idle_after": idle_after, "idle_wait_s": round(idle_wait_s, 2),
        "finished_by_reason": finished, "bench": bench, "server_start_s": round(start_s, 1),
        "load_s": round(load_s, 1), **{k: round(v, 1) for k, v in times.items()}, "wall_s": round(wall, 1),
        "failures": tally.failures[:50],
    }
    print(summary, flush=True)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if not ok:
        lines = "\n".join(tally.failures[:20])
        more = f"\n... and {len(tally.failures) - 20} more" if len(tally.failures) > 20 else ""
        raise SoakFailure(f"{summary}\n{lines}{more}\n--- server log (tail) ---\n{server.log_tail()}", result)
    return result


def _commit() -> str | None:
    """The checkout's commit (with "+dirty" when files differ from it), for the record."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + "+dirty" if dirty else head) or None


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    try:
        run(argv)
    except SoakFailure as e:
        print(str(e).split("\n", 1)[-1], file=sys.stderr)  # the summary line is already out
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
