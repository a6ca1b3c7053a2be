"""The benchmark harness runs on tiny models and writes well-formed output (not a speed test)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from specdec.bench import report
from specdec.bench.grid import CLOCK_ROWS, NOISE, GridSettings, model_speedups, run_grid, summarise
from specdec.bench.grid import DEFAULT_METHODS as METHODS
from specdec.costs import Costs
from specdec.drafters.suffix import STORE
from specdec.memory import pools_of

PROMPTS = [
    {"id": "c1", "category": "chat", "turns": [{"role": "user", "content": "hello there, how are you?"}]},
    {
        "id": "c2",
        "category": "chat",
        "turns": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hey"},
            {"role": "user", "content": "tell me more"},
        ],
    },
    {"id": "e1", "category": "edit", "turns": [{"role": "user", "content": "copy: abc abc abc abc abc abc abc"}]},
]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.mark.slow
def test_grid_on_tiny_models_is_well_formed(tiny, prompt_file, tmp_path):
    target, draft = tiny("llama"), tiny("llama", "close")
    # k drafts every step (adaptive_k=False), so that every method's acceptance figures are filled
    settings = GridSettings(
        target="tiny",
        draft="tiny-draft",
        temperatures=(0.0, 1.0),
        k=3,
        max_new_tokens=12,
        repeats=2,
        prompts_file=str(prompt_file),
        per_category=1,
        peers=False,
        adaptive_k=False,
    )
    result = run_grid(settings, target=target, draft=draft)
    # per_category=1: c1 and e1; 2 repeats x 2 temperatures x (every method + the plain-again control)
    assert len(result.records) == 2 * 2 * 2 * (len(METHODS) + 1)
    assert {r["prompt_id"] for r in result.records} == {"c1", "e1"}
    for r in result.records:
        # (a sampled run may draw the end token early: its draws depend on the method's drafts)
        assert r["speedup"] > 0 and (r["new_tokens"] == 12 if r["temperature"] == 0 else 1 <= r["new_tokens"] <= 12)
        assert r["steps"] >= 1 if r["method"] != NOISE else r["steps"] == 0 and r["proposed"] == 0
        # plain decoding twice gives the same greedy tokens (the control checks determinism too)
        assert (r["identical"] is True) if r["temperature"] == 0 else (r["identical"] is None)
    # ABBA: in each block the methods ran in one order, in the next block of the prompt in the reverse
    order = [*METHODS, NOISE]
    for rep in (0, 1):
        for pid, parity in (("c1", 0), ("e1", 1)):
            block = sorted(
                (r for r in result.records if (r["prompt_id"], r["repeat"], r["temperature"]) == (pid, rep, 0.0)),
                key=lambda r: r["position"],
            )
            assert [r["method"] for r in block] == (order if (rep + parity) % 2 == 0 else order[::-1])
    # every run carries its modelled speedup; plain against plain is priced at exactly 1 when greedy
    assert all(r["modelled_speedup"] > 0 for r in result.records)
    assert all(
        r["modelled_speedup"] == pytest.approx(1.0)
        for r in result.records
        if r["method"] == NOISE and r["temperature"] == 0
    )
    # each run of a cell beside the others: a band from two repeats
    cell = next(
        r for r in result.summary() if (r["method"], r["temperature"], r["category"]) == ("prompt-lookup", 0.0, "chat")
    )
    assert cell["runs"] == 2 and cell["speedup_band"][0] <= cell["speedup"] <= cell["speedup_band"][1]
    # each method ran untimed before the suite (its first-use costs are reported apart)
    assert set(result.first_use) == set(METHODS) and all(s > 0 for s in result.first_use.values())
    summary = result.summary()
    assert {(r["method"], r["category"]) for r in summary if r["temperature"] == 0} == {
        (m, c) for m in (*METHODS, NOISE) for c in ("chat", "edit", "all")
    }
    assert [r["method"] for r in summary if (r["temperature"], r["category"]) == (0.0, "all")][-1] == NOISE
    draft_all = next(
        r for r in summary if (r["method"], r["temperature"], r["category"]) == ("draft-model", 0.0, "all")
    )
    assert draft_all["runs"] == 4 and 0 <= draft_all["acceptance_rate"] <= 1
    assert len(draft_all["acceptance_by_position"]) == 3 and draft_all["identical"] is True

    paths = report.write(result, tmp_path / "out")
    assert [p.name for p in paths] == [
        "results.json",
        "report.md",
        "report.html",
        "speedup_by_category.png",
        "acceptance_by_position.png",
    ]
    # report.html: the same tables as tables, the plots inside it, nothing to fetch from elsewhere
    page = paths[2].read_text()
    assert page.count("<table>") == sum(line.startswith("|---") for line in paths[1].read_text().splitlines()) > 0
    assert page.count('src="data:image/png;base64,') == 2 and not re.search(r'(src|href)="(https?:)?//', page)
    data = json.loads(paths[0].read_text())
    assert data["settings"]["k"] == 3 and data["machine"]["torch"] and len(data["records"]) == len(result.records)
    # the pass table timed between the blocks, over every row count it prices
    assert set(data["costs"]["target_ms"]) == {str(r) for r in CLOCK_ROWS}
    cm = {(r["method"], r["temperature"], r["category"]) for r in data["cost_model"]}
    assert ("draft-model", 0.0, "all") in cm and not any(m in ("early-exit", NOISE) for m, _, _ in cm)
    assert set(data["first_use_seconds"]) == set(METHODS)
    assert all(1 <= r["best_k"] <= 8 and r["predicted_speedup"] > 0 for r in data["cost_model"])
    md = paths[1].read_text()
    assert (
        "## Temperature 0 (greedy)" in md
        and "specdec's greedy output identical to plain decoding in every run: yes" in md
    )
    assert "## Cost model" in md and "## What auto chose" in md and "k = 3 (fixed: k drafts every step)" in md
    assert (
        f"`{NOISE}` is plain decoding run once more among the methods" in md and "untimed, on the shortest prompt" in md
    )
    auto = {(r["temperature"], r["category"]): r for r in data["auto_choices"]}
    assert set(auto) == {(t, c) for t in (0.0, 1.0) for c in ("chat", "edit", "all")}
    assert auto[(0.0, "all")]["steps"] > 0 and sum(auto[(0.0, "all")]["share"].values()) == pytest.approx(1.0)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths[3:])
    text = report.table(result)
    assert "prompt-lookup" in text and "edit" in text


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown methods"):
        GridSettings(methods=("telepathy",))
    with pytest.raises(ValueError, match="needs a draft model"):
        GridSettings(draft=None)
    with pytest.raises(ValueError, match="must be >= 1"):
        GridSettings(k=0)


@pytest.mark.slow
def test_cli_bench_quick_as_written(tiny_dir, prompt_file, tmp_path):
    """`specdec bench --quick --out DIR --prompts FILE` writes DIR/results.json, report.md, plots."""
    out = tmp_path / "b"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "bench",
            "--quick",
            "--out",
            str(out),
            "--prompts",
            str(prompt_file),
            "--target",
            str(tiny_dir("llama")),
            "--draft",
            str(tiny_dir("llama", "close")),
            "--max-new-tokens",
            "8",
            "--temperatures",
            "0",
            "--no-peers",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    assert {p.name for p in out.iterdir()} == {
        "results.json",
        "report.md",
        "report.html",
        "speedup_by_category.png",
        "acceptance_by_position.png",
    }
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["repeats"] == 3 and data["settings"]["per_category"] == 1
    assert len(data["records"]) == 3 * 2 * (len(METHODS) + 1) and "speedup" in res.stdout and "first use" in res.stdout
    assert "band" in res.stdout and "modelled" in res.stdout
    two = tmp_path / "two"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "bench",
            "--quick",
            "--out",
            str(two),
            "--prompts",
            str(prompt_file),
            "--no-peers",
            "--max-new-tokens",
            "6",
            "--temperatures",
            "0",
            "--no-noise-control",
            "--methods",
            "draft-model",
            "prompt-lookup",
            "--pairs",
            f"{tiny_dir('llama')}:{tiny_dir('llama', 'close')}",
            f"{tiny_dir('qwen2')}:{tiny_dir('qwen2', 'close')}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    data = json.loads((two / "results.json").read_text())
    assert [p["settings"]["target"] for p in data["pairs"]] == [str(tiny_dir("llama")), str(tiny_dir("qwen2"))]
    assert all({r["method"] for r in p["records"]} == {"draft-model", "prompt-lookup"} for p in data["pairs"])
    assert (two / "speedup_by_category-2.png").exists() and (two / "report.md").read_text().count(
        "# specdec benchmark"
    ) == 2
    bad = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "bench", "--pairs", "a:"], capture_output=True, text=True, timeout=600
    )
    assert bad.returncode == 2 and "TARGET or TARGET:DRAFT" in bad.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "bench",
            "--prompts",
            str(tmp_path / "none.jsonl"),
            "--target",
            str(tiny_dir("llama")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "cannot read the prompt file" in bad.stderr and "Traceback" not in bad.stderr


def test_tune_stores_k_where_generate_finds_it(tiny, prompt_file, tmp_path, monkeypatch):
    from specdec import tuning

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    target, draft = tiny("qwen2"), tiny("qwen2", "close")
    settings = GridSettings(
        target=target.name,
        draft=draft.name,
        methods=("draft-model", "prompt-lookup"),
        temperatures=(0.0,),
        k=3,
        max_new_tokens=10,
        repeats=1,
        prompts_file=str(prompt_file),
        peers=False,
    )
    result = run_grid(settings, target=target, draft=draft)
    written = tuning.save(result)
    assert set(written) == {
        f"{target.name}|draft-model|{draft.name}|{target.model.mode}",
        f"{target.name}|prompt-lookup|-|{target.model.mode}",
    }
    best = {key.split("|")[1]: e["k"] for key, e in written.items()}
    expected = {r.method: r.best_k for r in result.recommendations() if r.category == "all"}
    assert best == expected and set(written[next(iter(written))]["by_category"]) == {"chat", "edit"}

    out = specdec_generate(target, drafter="prompt-lookup")
    assert (out.metrics.k, out.metrics.k_source) == (best["prompt-lookup"], "tuned")
    out = specdec_generate(target, assistant_model=draft)
    assert (out.metrics.k, out.metrics.k_source) == (best["draft-model"], "tuned")
    assert specdec_generate(target, drafter="prompt-lookup", k=2).metrics.k_source == "given"
    assert specdec_generate(target, drafter="lookahead").metrics.k_source == "default"
    assert specdec_generate(target, drafter="lookahead").metrics.k == 4
    # a file another version wrote badly is ignored, not fatal
    tuning.tuned_path().write_text("{not json")
    assert specdec_generate(target, drafter="prompt-lookup").metrics.k_source == "default"


def specdec_generate(target, **kw):
    import specdec

    return specdec.generate(target, "abcabc", max_new_tokens=6, ignore_eos=True, **kw)


def test_peers_run_beside_us_and_missing_ones_are_skipped(tiny, prompt_file):
    target, draft = tiny("llama"), tiny("llama", "close")
    settings = GridSettings(
        target=target.name,
        draft=draft.name,
        methods=("draft-model",),
        temperatures=(0.0, 1.0),
        k=2,
        max_new_tokens=8,
        repeats=1,
        prompts_file=str(prompt_file),
        per_category=1,
    )
    result = run_grid(settings, target=target, draft=draft)
    peer_rows = [r for r in result.records if r["method"].startswith("peer:")]
    assert {r["method"] for r in peer_rows} == {
        "peer:transformers",
        "peer:transformers-assisted",
        "peer:transformers-prompt-lookup",
    }
    assert all(r["temperature"] == 0.0 and r["error"] is None and r["tokens_per_second"] > 0 for r in peer_rows)
    assert all(isinstance(r["identical"], bool) for r in peer_rows if r["method"] != "peer:transformers")
    # no GGUF for a tiny model directory: llama.cpp peers are skipped with the reason
    assert set(result.peers_skipped) == {
        "llama.cpp",
        "llama.cpp-prompt-lookup",
        "llama-server",
        "llama-server-speculative",
    }
    summary = {(r["method"], r["category"]) for r in result.summary()}
    assert ("peer:transformers-assisted", "all") in summary
    assert not any(r.method.startswith("peer:") for r in result.recommendations())


def test_llama_server_not_built_says_how(monkeypatch, tmp_path):
    from specdec.bench import llama_server, peers

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert llama_server.binary() is None
    why = peers.unavailable("llama-server-speculative", has_draft=True, gguf=tmp_path / "m.gguf")
    assert "specdec bench peers --build" in why
    assert "draft" in peers.unavailable("llama-server-speculative", has_draft=False, gguf=None)
    fake = llama_server.home() / "bin" / "llama-server"  # control: once built, only the GGUF is asked for
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    assert (
        peers.unavailable("llama-server", has_draft=True, gguf=tmp_path / "none.gguf") == "no GGUF file for this target"
    )


def test_a_crashing_llama_cpp_worker_costs_one_request(monkeypatch, tmp_path):
    """The parent keeps the finished results, fails the request the worker died in, and
    restarts the worker for the rest."""
    from specdec.bench import peers

    calls = []

    def fake_run(cmd, **kw):
        spec = json.loads(open(cmd[-1]).read())
        ids = [r["id"] for r in spec["requests"]]
        calls.append(ids)
        done = [r for r in ids if r != "boom"]
        if "boom" in ids:  # finish the requests before it, then die
            done = ids[: ids.index("boom")]
            code = -11
        else:
            code = 0
        out = "".join(json.dumps({"id": i, "tokens": [1, 2], "seconds": 0.5}) + "\n" for i in done)
        return subprocess.CompletedProcess(cmd, code, out, "Segmentation fault")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    reqs = [{"id": i, "ids": [1], "max_new_tokens": 2, "eos": []} for i in ("a", "boom", "c")]
    got = peers.run_llama_cpp(tmp_path / "m.gguf", False, reqs, 4)
    assert calls == [["a", "boom", "c"], ["c"]]
    assert got["a"].tokens == got["c"].tokens == [1, 2] and got["boom"].tokens is None
    assert "crashed (exit -11)" in got["boom"].error and "Segmentation fault" in got["boom"].error


def test_each_method_remembers_only_its_own_earlier_outputs(tiny, prompt_file, monkeypatch):
    """auto's suffix member runs each prompt before suffix decoding does: suffix decoding must
    not draft from that answer. Each method's runs share a memory of their own earlier prompts'
    outputs, and nothing else."""
    from specdec.bench import grid

    target = tiny("llama")
    seen: list[tuple[str, str, int]] = []  # (method, pool, tokens its pool held when it began)
    real = grid.run_request

    def spy(t, req, *a, **kw):  # (the timed runs; the warm-up runs go through `generate`)
        drafter = req.drafter
        if drafter is not None and drafter.name in ("auto", "suffix"):
            store = pools_of(t.model).of(req.drafter_pool).get(STORE)
            seen.append((drafter.name, req.drafter_pool, store.tokens if store is not None else 0))
        return real(t, req, *a, **kw)

    monkeypatch.setattr(grid, "run_request", spy)
    settings = GridSettings(
        target="tiny",
        draft="tiny-draft",
        temperatures=(0.0,),
        methods=("auto", "suffix"),
        max_new_tokens=8,
        repeats=1,
        prompts_file=str(prompt_file),
        peers=False,
        noise_control=False,
    )
    run_grid(settings, target=target, draft=tiny("llama", "close"))
    timed = seen
    # (in alternating order, prompt by prompt)
    assert [m for m, _, _ in timed] == ["auto", "suffix", "suffix", "auto", "auto", "suffix"]
    assert len({p for m, p, _ in timed if m == "auto"} | {p for m, p, _ in timed if m == "suffix"}) == 2
    held = [n for m, _, n in timed if m == "suffix"]
    assert held[0] == 0  # auto answered this prompt already, into its own memory only
    assert held[1] >= 7 and held[2] >= held[1] + 7  # its own earlier answers (8 tokens each, less the last)


def _rec(category: str, speedup: float, **kw) -> dict:
    base = {
        "prompt_id": category,
        "category": category,
        "method": "m",
        "proposed": 0,
        "accepted": 0,
        "steps": 1,
        "step_tokens": 1,
        "scored_rows": 1,
        "proposed_per_position": [],
        "accepted_per_position": [],
        "identical": None,
        "speedup": speedup,
        "decode_speedup": speedup,
        "modelled_speedup": None,
        "tokens_per_second": 1.0,
        "plain_tokens_per_second": 1.0,
    }
    return base | kw


def test_a_band_that_holds_one_is_no_measurable_difference():
    cell = summarise([_rec("a", 0.95), _rec("a", 1.20), _rec("a", 1.10)])
    assert cell["speedup"] == 1.10 and cell["speedup_band"] == [0.95, 1.20] and cell["no_difference"] is True
    clear = summarise([_rec("a", 1.25), _rec("a", 1.40), _rec("a", 1.31)])  # control: every run above 1
    assert clear["speedup_band"] == [1.25, 1.40] and clear["no_difference"] is False
    assert summarise([_rec("a", 1.3)])["speedup_band"] is None  # one run has no band


def test_over_categories_the_median_of_medians_with_a_bootstrap_band():
    rs = [
        _rec(c, x) for c, xs in {"a": (1.1, 1.2, 1.3), "b": (1.5, 1.6, 1.7), "c": (2.0, 2.1, 2.2)}.items() for x in xs
    ]
    out = summarise(rs, cells=True)
    assert out["speedup"] == 1.6  # the median of 1.2, 1.6, 2.1
    lo, hi = out["speedup_band"]
    assert 1.1 <= lo <= 1.6 <= hi <= 2.2 and out["no_difference"] is False
    assert summarise(rs, cells=True)["speedup_band"] == [lo, hi]  # seeded: the same band every time


def test_the_modelled_speedup_prices_the_passes():
    costs = Costs({1: 10.0, 2: 11.0, 5: 14.0})
    r = {
        "method": "m",
        "passes": {"5": 8},
        "plain_passes": {"1": 39},
        "draft_seconds": 0.016,
        "prefill_seconds": 0.01,
        "new_tokens": 40,
        "plain_new_tokens": 40,
        "plain_pass_ms": 10.0,
    }
    model_speedups([r], costs)
    # plain: 10 + 39 x 10 = 400 ms; the method: 10 + 8 x 14 + 16 = 138 ms, for 40 tokens each
    assert r["modelled_speedup"] == pytest.approx(400 / 138)
    long = dict(r, plain_pass_ms=20.0)  # a long prompt: every pass costs twice the table's, drafting the same
    model_speedups([long], costs)
    assert long["modelled_speedup"] == pytest.approx((10 + 780) / (10 + 224 + 16))
    slow = dict(r, draft_seconds=0.5)  # control: drafting that costs more than it saves
    model_speedups([slow], costs)
    assert slow["modelled_speedup"] < 1


def test_the_priced_table_keeps_what_pooling_evens_out():
    """Where one row costs more than two (seen on Zen 5), the cost model's table pools them; the
    table that prices the runs keeps them as measured."""
    from specdec.costs import PassClock

    clock = PassClock.__new__(PassClock)  # (hand-set rounds: no model)
    clock.rows, clock.times = [1, 2, 3], {1: [30.0, 30.0], 2: [24.0, 24.0], 3: [27.0, 27.0]}
    assert clock.table(pooled=False) == pytest.approx({1: 30.0, 2: 24.0, 3: 27.0})
    assert clock.table() == pytest.approx({1: 27.0, 2: 27.0, 3: 27.0})
