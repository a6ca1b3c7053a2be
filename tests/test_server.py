"""`specdec serve`: a real server on a free localhost port, driven by the official `openai`
client (unchanged) and by raw HTTP for the error cases. SmolLM2-135M in its exact mode, so
greedy outputs are asserted equal to `specdec generate`'s token for token."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import EXACT_MODES
from helpers import Running, assert_bench_page

import specdec
from specdec.cli import main
from specdec.costs import Costs, batch_drafting_pays
from specdec.drafters.suffix import STORE
from specdec.memory import pools_of
from specdec.server import ServeSettings, create_app

KEY = "test-key"
PROMPTS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "List three colours of the rainbow.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def models(smollm2_exact):
    draft = specdec.load("smollm2-135m", dtype=smollm2_exact.model.mode, device="cpu")  # its own copy as the draft
    return smollm2_exact, draft


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    app = create_app(
        target,
        draft,
        ServeSettings("smollm2-135m", "prompt-lookup", {}, k=4, max_batch=8, api_keys=(KEY,), max_body_bytes=64 * 1024),
    )
    running = Running(app)
    yield running
    running.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _reference(target, draft, prompt: str, method: str, n: int, chat: bool = True) -> str:
    kw = {"none": {}, "prompt-lookup": {"drafter": "prompt-lookup"}, "draft-model": {"assistant_model": draft}}[method]
    p = [{"role": "user", "content": prompt}] if chat else prompt
    return specdec.generate(target, p, max_new_tokens=n, temperature=0.0, k=4, chat=chat, **kw).text


def _spec(method: str) -> dict:
    return {"speculative": {"method": method, "k": 4}}


@pytest.mark.real
@pytest.mark.parametrize("method", ["none", "prompt-lookup", "draft-model"])
def test_openai_client_greedy_equals_generate(client, models, method):
    target, draft = models
    prompt = PROMPTS[2]
    want = _reference(target, draft, prompt, method, 24)
    assert want == _reference(target, draft, prompt, "none", 24)  # the same with and without speculation
    chat = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        extra_body=_spec(method),
    )
    assert chat.choices[0].message.content == want
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0
    spec = chat.usage.model_extra["speculative"]
    assert spec["method"] == method and (spec["target_passes"] > 0) == (method != "none")
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=_spec(method),
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        chat.choices[0].finish_reason
    ]
    want_raw = _reference(target, draft, "def fibonacci(n):", method, 20, chat=False)
    comp = client.completions.create(
        model="smollm2-135m", prompt="def fibonacci(n):", max_tokens=20, temperature=0, extra_body=_spec(method)
    )
    assert comp.choices[0].text == want_raw
    streamed = client.completions.create(
        model="smollm2-135m",
        prompt="def fibonacci(n):",
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body=_spec(method),
    )
    assert "".join(c.choices[0].text for c in streamed) == want_raw


@pytest.mark.real
def test_server_default_method_and_seeded_sampling(client):
    # no "speculative" field: the server's default (prompt lookup); a seed reproduces a sampled answer
    kw = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 16,
        "temperature": 0.8,
        "top_p": 0.9,
        "seed": 7,
        "extra_body": {"top_k": 40},
    }
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.model_extra["speculative"]["method"] == "prompt-lookup"
    # ignore_eos (vLLM's extra field): an answer that ends by itself runs on to max_tokens
    kw = {"model": "smollm2-135m", "messages": [{"role": "user", "content": PROMPTS[3]}], "temperature": 0}
    ended = client.chat.completions.create(**kw, max_tokens=200)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 200
    n = ended.usage.completion_tokens + 8
    longer = client.chat.completions.create(**kw, max_tokens=n, extra_body={"ignore_eos": True})
    assert longer.choices[0].finish_reason == "length" and longer.usage.completion_tokens == n
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]


@pytest.mark.real
def test_32_concurrent_streaming_clients(server, models, capsys):
    target, draft = models
    methods = ["none", "prompt-lookup", "draft-model"]
    lengths = [8, 24]
    jobs = [(PROMPTS[i % 4], methods[i % 3], lengths[(i // 4) % 2]) for i in range(32)]
    want = {(p, n): _reference(target, draft, p, "none", n) for p, _, n in jobs}

    async def one(aclient, prompt, method, n):
        t0 = time.perf_counter()
        first = None
        text = []
        stream = await aclient.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body=_spec(method),
        )
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                first = first or time.perf_counter() - t0
                text.append(c.choices[0].delta.content)
        return "".join(text), first, time.perf_counter() - t0

    async def everyone():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        return await asyncio.gather(*(one(aclient, *j) for j in jobs))

    results = asyncio.run(everyone())
    assert len(results) == 32
    for (prompt, method, n), (text, _, _) in zip(jobs, results, strict=True):
        assert text == want[(prompt, n)], (method, n)
    ttft = sorted(r[1] for r in results if r[1] is not None)
    total = sorted(r[2] for r in results)
    with capsys.disabled():
        print(
            f"\n32 concurrent streams: TTFT p50 {statistics.median(ttft):.2f} s p99 {ttft[-1]:.2f} s; "
            f"latency p50 {statistics.median(total):.2f} s p99 {total[-1]:.2f} s"
        )
    metrics = httpx.get(server.url + "/metrics").text
    assert "specdec_time_to_first_token_seconds_count" in metrics and "specdec_batch_size" in metrics
    assert 'specdec_draft_tokens_total{method="draft-model"}' in metrics
    assert "specdec_drafting_enabled" in metrics and 'specdec_steps_total{drafting="on"}' in metrics


def _post(server, path: str, body, headers=None, **kw) -> httpx.Response:
    h = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        server.url + path, content=data, headers={"Content-Type": "application/json", **h}, timeout=60, **kw
    )


CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.mark.real
@pytest.mark.parametrize(
    "change, status, param",
    [
        ({"model": "gpt-9"}, 404, "model"),
        ({"speculative": {"method": "prompt-lookup", "k": 0}}, 400, "speculative.k"),
        ({"speculative": {"method": "telepathy"}}, 400, "speculative.method"),
        ({"speculative": {"method": "prompt-lookup", "bogus_option": 3}}, 400, "speculative"),
        ({"temperature": -0.5}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_p": 1.5}, 400, "top_p"),
        ({"max_tokens": 10**6}, 400, "max_tokens"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"n": 2}, 400, "n"),
        ({"messages": []}, 400, "messages"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"presence_penalty": 1.0}, 400, "presence_penalty"),
        ({"speculative": {"method": "prompt-lookup", "k": 65}}, 400, "speculative.k"),
        ({"temperature": float("nan")}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    ],
)
def test_bad_requests_get_openai_errors(server, change, status, param):
    r = _post(server, "/v1/chat/completions", {**CHAT, **change})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


@pytest.mark.real
@pytest.mark.parametrize(
    "change, reason",
    [
        ({"temperature": float("nan")}, "finite number"),  # not "less than or equal to 100"
        ({"messages": [{"role": "user", "content": None}]}, "not null"),
        ({"speculative": {"method": "prompt-lookup", "k": 1000}}, "less than or equal to 64"),
    ],
)
def test_bad_requests_say_what_is_wrong(server, change, reason):
    r = _post(server, "/v1/chat/completions", {**CHAT, **change})
    assert r.status_code == 400 and reason in r.json()["error"]["message"], r.text


@pytest.mark.real
def test_transport_errors_and_keys(server, client):
    r = _post(server, "/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = _post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 70000}]})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit still holds
        for _ in range(80):
            yield b"x" * 1024

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    assert _post(server, "/v1/chat/completions", CHAT, headers={}).status_code == 401
    assert _post(server, "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer nope"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # open without the key
    # and it still serves
    assert client.chat.completions.create(**CHAT).choices[0].message.content is not None


@pytest.mark.real
def test_a_client_that_disconnects_frees_its_sequence(server, client):
    body = {
        **CHAT,
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "speculative": {"method": "none"},
    }
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.time() + 30
    while httpx.get(server.url + "/health").json()["batch"] and time.time() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").json()["batch"] == 0  # gone long before its 400 tokens
    assert client.chat.completions.create(**CHAT).choices[0].finish_reason in ("stop", "length")


@pytest.mark.real
def test_graceful_shutdown_finishes_or_cancels_in_flight_requests(models):
    # a stream in flight when the server is told to stop still ends properly: within the grace
    # period it runs to its end; past it, it is cancelled and the engine thread stops
    target, draft = models
    for graceful_s, max_tokens in ((30.0, 24), (0.5, 2000)):
        app = create_app(target, draft, ServeSettings("smollm2-135m", max_batch=2))
        running = Running(app, graceful_s)
        got: list[str] = []
        body = {
            **CHAT,
            "max_tokens": max_tokens,
            "stream": True,
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "speculative": {"method": "none"},
            # the long one must outlast its grace period however fast the machine: it may not end early
            "ignore_eos": max_tokens == 2000,
        }

        started = threading.Event()

        def read(running=running, body=body, got=got, started=started) -> None:
            try:
                with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        got.append(line)
                        if line.startswith("data: "):
                            started.set()
            except httpx.HTTPError as exc:  # a cancelled stream may end abruptly
                got.append(f"closed: {type(exc).__name__}")
            started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60) and got, "the stream did not start"
        t0 = time.time()
        running.close()
        reader.join(60)
        assert not reader.is_alive() and time.time() - t0 < 30 + 10
        if max_tokens == 24:  # finished inside the grace period: the whole answer and [DONE]
            assert [line for line in got if line][-1] == "data: [DONE]"
        else:  # cancelled: no [DONE], the connection closed
            assert "data: [DONE]" not in got
        assert not app.state.worker.thread.is_alive()  # the engine thread ended with the app
        with pytest.raises(httpx.HTTPError):
            httpx.get(running.url + "/health", timeout=5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.real
def test_specdec_serve_command_serves_and_stops_on_sigterm(smollm2_exact):
    # the command as a user runs it: the engine on the main thread, uvicorn beside it; SIGTERM
    # ends it cleanly (exit 0); a port already taken is one clear line, exit 2
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve",
        "--target",
        "smollm2-135m",
        "--dtype",
        smollm2_exact.model.mode,
        "--drafter",
        "prompt-lookup",
        "--port",
        str(port),
        "--max-batch",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        lines = []  # its log, up to the line that says it serves (it prepares before it listens)
        for line in proc.stdout:
            lines.append(line)
            if "serving smollm2-135m on http://" in line:
                break
        assert httpx.get(url + "/health", timeout=10).status_code == 200, "".join(lines)
        out = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120).chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=16, temperature=0
        )
        assert out.choices[0].message.content == _reference(smollm2_exact, None, PROMPTS[2], "prompt-lookup", 16)
        taken = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert taken.returncode == 2 and "Traceback" not in taken.stderr
        assert taken.stderr.startswith(f"specdec: error: cannot listen on 127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, log[-2000:]
    assert "Traceback" not in log


def test_drafting_stops_paying_as_the_batch_grows():
    # one row costs about what 8 do (memory-bound), then each row adds its compute
    costs = Costs({1: 20.0, 2: 20.5, 4: 21.0, 8: 23.0, 16: 40.0, 32: 74.0})
    assert batch_drafting_pays(costs, 1, 4, 0.0)  # one sequence: its own controller decides
    assert batch_drafting_pays(costs, 2, 4, 0.7)
    assert not batch_drafting_pays(costs, 2, 4, 0.0)  # nothing accepted never pays
    assert not batch_drafting_pays(costs, 8, 4, 0.7)  # 40 rows against 8
    small = [b for b in range(1, 17) if batch_drafting_pays(costs, b, 3, 0.6)]
    assert small == list(range(1, small[-1] + 1)) and 2 <= small[-1] < 16  # on up to some size, off beyond


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "0"],
        ["serve", "--drafter", "draft-model"],
        ["serve", "--max-batch", "0"],
        ["serve", "-k", "0"],
    ],
)
def test_serve_cli_bad_values(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and "Traceback" not in err


@pytest.mark.real
def test_bench_serve_load_test(server, tmp_path, capsys):
    out = tmp_path / "serve"
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                server.url,
                "--concurrency",
                "1",
                "3",
                "--requests",
                "3",
                "--max-tokens",
                "8",
                "--api-key",
                KEY,
                "--method",
                "prompt-lookup",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed
    result = json.loads((out / "serve.json").read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        assert lv["failed"] == 0 and lv["completion_tokens"] > 0 and lv["ttft_s"]["p50"] > 0
    assert (out / "serve.png").stat().st_size > 0
    assert_bench_page(out / "serve.html", "TTFT p50")


@pytest.mark.parametrize("url", ["http://example.com:8000", "ftp://127.0.0.1", "http://10.1.2.3:8000"])
def test_bench_serve_is_localhost_only(url, capsys):
    assert main(["bench", "serve", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: --url") and "Traceback" not in err


@pytest.mark.real
@pytest.mark.parametrize("shared", [False, True], ids=["per-key", "suffix-shared"])
def test_one_clients_outputs_never_draft_for_another(models, shared):
    """Suffix decoding keeps earlier outputs, and the server earlier requests' rows, per API key:
    a response's speed must not reveal what another client sent or generated. Two keys, the same
    request from each: each key's outputs are in its own pool and nowhere else, and the second
    key's prompt is prefilled afresh (with --suffix-shared: one pool for both, and its prompt's
    rows come from the first request's)."""
    target, draft = models
    keys = ("key-a", "key-b")
    app = create_app(
        target, draft, ServeSettings("smollm2-135m", "suffix", {}, max_batch=4, api_keys=keys, suffix_shared=shared)
    )
    running = Running(app)
    try:
        texts, pools, cached = [], [], []
        for key in keys:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key=key, max_retries=0, timeout=120)
            out = client.completions.create(model="smollm2-135m", prompt=PROMPTS[2], max_tokens=24, temperature=0)
            texts.append(out.choices[0].text)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            pools.append(
                {name: len(m.get(STORE).docs) for name, m in pools_of(target.model).pools.items() if m.get(STORE)}
            )
    finally:
        running.close()
    assert texts[0] == texts[1]  # (drafts never change an output, nor do reused rows)
    reuses = target.model.rows_bitwise
    if shared:
        assert pools == [{"": 1}, {"": 2}]
        assert cached == [0, out.usage.prompt_tokens - 1 if reuses else 0]  # (its last row gives the first token)
    else:  # after a's request only a's pool holds anything; b's request fills a pool of its own
        (a_pool,) = pools[0]
        assert pools[0] == {a_pool: 1} and a_pool != "" and "key-a" not in a_pool  # (named by a digest)
        assert pools[1][a_pool] == 1 and len(pools[1]) == 2 and all(n == 1 for n in pools[1].values())
        assert cached == [0, 0]


def _trace(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.real
def test_bench_serve_replays_an_agent_trace(tmp_path, capsys):
    ask = [{"role": "user", "content": "Write a Python function add(a, b) that returns a + b."}]
    again = [
        *ask,
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
        {"role": "user", "content": "Add type hints. Reply with the whole function."},
    ]
    trace = _trace(
        tmp_path / "t.jsonl",
        [
            {"conversation": "c1", "turn": 1, "messages": again, "max_tokens": 24},
            {"conversation": "c1", "turn": 0, "messages": ask, "max_tokens": 24},
            {"conversation": "c2", "turn": 0, "messages": ask, "max_tokens": 16},
        ],
    )
    out = tmp_path / "out"
    assert (
        main(["bench", "serve", "--trace", trace, "--target", "smollm2-135m", "--methods", "suffix", "--out", str(out)])
        == 0
    )
    printed = capsys.readouterr().out
    assert "trace: 3 requests in 2 conversations" in printed and "suffix memory after suffix" in printed
    result = json.loads((out / "trace.json").read_text())
    assert list(result["methods"]) == ["none", "suffix", "none-again"]
    for r in result["methods"].values():  # greedy: every answer plain decoding's
        assert r["failed"] == 0 and r["identical"] and r["completion_tokens"] > 0
    assert result["methods"]["none"]["speedup"] == 1.0 and result["suffix_memory"]["suffix"]["tokens"] > 0
    rows = result["methods"]["suffix"]["per_request"]  # each request, by conversation and turn
    assert sorted((r["conversation"], r["turn"]) for r in rows) == [("c1", 0), ("c1", 1), ("c2", 0)]
    assert sum(r["tokens"] for r in rows) == result["methods"]["suffix"]["completion_tokens"]
    if result["prefix_cache"]:  # (the mode's rows are bitwise the same in any pass) c2's prompt is c1's first
        assert all(m["hits"] >= 1 and m["reused_tokens"] >= 16 for m in result["prefix_cache"].values())
        assert "prompt tokens reused" in printed
    assert (out / "trace.png").stat().st_size > 0
    assert_bench_page(out / "trace.html", "suffix memory after suffix")


@pytest.mark.real
def test_bench_serve_replays_predictions_to_the_methods_that_read_them(tmp_path, capsys, smollm2_exact):
    text = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs."
    ask = [{"role": "user", "content": f"Repeat this text exactly, nothing else: {text}"}]
    # the prediction is the model's own plain answer (whatever this CPU's kernels make it), so the
    # prediction drafter has a run of right tokens to follow on any machine
    expected = specdec.generate(smollm2_exact, ask, max_new_tokens=32, temperature=0.0).text
    assert len(expected) > 20
    trace = _trace(
        tmp_path / "t.jsonl",
        [{"conversation": "c1", "turn": 0, "messages": ask, "max_tokens": 32, "prediction": expected}],
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "serve",
                "--trace",
                trace,
                "--target",
                "smollm2-135m",
                "--dtype",
                EXACT_MODES[-1],
                "--methods",
                "suffix",
                "prediction",
                "auto+prediction",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "auto+prediction" in printed and "pred. acc/rej" in printed
    runs = json.loads((out / "trace.json").read_text())["methods"]
    assert list(runs) == ["none", "suffix", "prediction", "auto+prediction", "none-again"]
    assert all(r["identical"] and r["failed"] == 0 for r in runs.values())
    pred = runs["prediction"]
    assert pred["prediction_tokens"]["accepted"] >= pred["completion_tokens"] // 2 > 0
    assert runs["auto+prediction"]["prediction_tokens"]["accepted"] > 0
    assert runs["suffix"]["prediction_tokens"] == runs["none"]["prediction_tokens"] == {"accepted": 0, "rejected": 0}


def test_the_bundled_edit_trace_sends_the_file_as_its_prediction():
    from specdec.bench.trace import load_trace

    convs = load_trace("edit")
    reqs = [r for rs in convs.values() for r in rs]
    assert len(reqs) == 10 and {r["conversation"].rsplit("-", 1)[1] for r in reqs} == {
        "rename",
        "parameter",
        "comments",
        "docstring",
        "bugfix",
    }
    for r in reqs:
        assert r["prediction"].startswith("```python\n") and r["prediction"] in r["messages"][-1]["content"]
    for a, b in zip(
        [r for r in reqs if r["conversation"].endswith("rename")],
        [r for r in reqs if r["conversation"].endswith("bugfix")],
        strict=True,
    ):
        changed = [
            (x, y) for x, y in zip(a["prediction"].splitlines(), b["prediction"].splitlines(), strict=False) if x != y
        ]
        assert len(changed) == 1  # the planted bug: one line


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "a trace line is a JSON object"),
        (json.dumps({"conversation": "c", "turn": 0, "messages": []}), "max_tokens"),
        (json.dumps({"conversation": "c", "turn": 0, "messages": [], "max_tokens": 8}), "non-empty list"),
        (
            json.dumps(
                {"conversation": "c", "turn": 0, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
            ),
            "positive integer",
        ),
    ],
)
def test_bad_trace_is_one_clear_line(tmp_path, capsys, line, reason):
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    assert main(["bench", "serve", "--trace", str(path), "--target", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdec: error: {path}:1: ") and reason in err and "Traceback" not in err
    assert main(["bench", "serve", "--trace", str(path), "--url", "http://127.0.0.1:9"]) == 2
    assert "drop --url" in capsys.readouterr().err


def test_the_bundled_agent_trace_resends_a_growing_conversation():
    from specdec.bench.trace import load_trace

    convs = load_trace()
    assert len(convs) == 8 and sum(len(r) for r in convs.values()) == 40
    calls = 0
    for reqs in convs.values():
        assert [r["turn"] for r in reqs] == [0, 1, 2, 3, 4] and all(
            r["tools"][0]["function"]["name"] == "run_tests" for r in reqs
        )
        for before, after in itertools.pairwise(reqs):  # each request: the one before, its answer, the next ask
            assert after["messages"][: len(before["messages"])] == before["messages"]
            assert after["messages"][len(before["messages"])] == before["answer"]
        for call in reqs[1]["answer"].get("tool_calls") or ():  # the tool's result follows its call
            calls += 1
            assert reqs[2]["messages"][len(reqs[1]["messages"]) + 1] == {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": reqs[2]["messages"][-2]["content"],
            }
    assert calls >= 4  # (the model called its tool where asked in most sessions; the others wrote code again)


def test_the_methods_offered_include_the_servers_own_default(tiny):
    """`/health`'s methods (what the page offers): no head-needing method a request could not
    load, unless the server was started with it: its default is always offered (a request
    gets it by naming no method)."""
    from specdec.server.app import Service

    plain = Service(tiny("llama"), None, ServeSettings("t")).methods()
    assert plain[0] == "none" and "eagle3" not in plain and "draft-model" not in plain and "suffix" in plain
    headed = Service(tiny("llama"), None, ServeSettings("t", "eagle3", {"head": "h"})).methods()
    assert headed[0] == "none" and headed[1:] == sorted(headed[1:]) and "eagle3" in headed
    assert "medusa" not in headed


def test_a_request_naming_the_servers_own_method_with_k_only_gets_the_servers_options(tiny):
    """(the page sends `{"method": <the default>, "k": K}` when k is set): the server's options
    for its own method stand; a request naming options of its own, or another method, gets its own."""
    from specdec.server.app import Service
    from specdec.server.schemas import ChatRequest

    svc = Service(tiny("llama"), None, ServeSettings("t", "prompt-lookup", {"max_ngram": 5}))
    svc.worker.start()
    try:

        def job(spec: dict | None):
            body = ChatRequest(model="t", messages=[{"role": "user", "content": "hi"}], speculative=spec)
            return asyncio.run(svc.make_job(body, [5, 6, 7], 4)).req.drafter

        assert job(None).max_ngram == 5 and job({"method": "prompt-lookup", "k": 3}).max_ngram == 5
        assert job({"method": "prompt-lookup", "k": 3, "max_ngram": 2}).max_ngram == 2
        assert job({"method": "suffix"}).name == "suffix"
    finally:
        svc.worker.stop()
