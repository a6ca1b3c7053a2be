"""Early-exit self-speculation: greedy identity with plain decoding (tiny models of 4 layers,
SmolLM2), the early blocks are not recomputed by verification, calibration, exact sampling
(with a negative control), bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_MODES
from helpers import PROMPTS

import specdec
from specdec.config import SamplingParams
from specdec.drafters import DraftSession, EarlyExitDrafter, early_exit


def test_verification_does_not_recompute_early_blocks(tiny4):
    """After the prefill every call of the early blocks is a one-row drafter call; only the
    blocks from the exit layer on see the multi-row verification pass."""
    target = tiny4("llama", "fp32")
    specdec.api.prepare(target)  # (the pass table, timed once before a first request: not counted below)
    layers = target.model.model.layers
    rows: dict[int, list[int]] = {0: [], 1: [], 2: [], 3: []}
    hooks = [
        layers[i].register_forward_hook(lambda mod, args, out, i=i: rows[i].append(args[0].shape[1])) for i in range(4)
    ]
    try:
        out = specdec.generate(
            target,
            PROMPTS[0],
            drafter=EarlyExitDrafter(target.model, layer=2),
            k=3,
            max_new_tokens=20,
            ignore_eos=True,
            adaptive_k=False,
        )
    finally:
        for h in hooks:
            h.remove()
    steps = out.metrics.steps
    assert all(t == 1 for t in rows[0][1:] + rows[1][1:])  # [0] is the prefill
    drafted = out.metrics.proposed_per_position[0]  # steps that drafted (the last may have no budget left)
    assert len(rows[0]) - 1 == out.metrics.draft_forwards + (steps - drafted)  # drafter calls + plain steps
    assert len(rows[2]) - 1 == len(rows[3]) - 1 == steps and max(rows[3][1:]) == 4  # one k+1-row pass per step


def test_calibration_picks_and_reports_a_layer(tiny4):
    target = tiny4("qwen2", "auto")
    drafter = EarlyExitDrafter(target.model)
    out = specdec.generate(
        target, PROMPTS[1], drafter=drafter, k=3, max_new_tokens=12, ignore_eos=True, adaptive_k=False
    )
    info = out.metrics.drafter_info
    assert info["calibrated"] and info["k"] == 3 and set(info["candidates"]) == {2, 3}
    best = max(info["candidates"], key=lambda L: info["candidates"][L]["predicted_speedup"])
    assert info["layer"] == best == drafter.layer
    for row in info["candidates"].values():
        assert 0 <= row["alpha"] <= 1 and row["draft_ms"] > 0 and row["verify_ms"] > 0
    assert info["timed_layers"] == [2, 3]
    # kept for the next generation: no second calibration
    specdec.generate(target, PROMPTS[2], drafter=drafter, k=3, max_new_tokens=5, ignore_eos=True, adaptive_k=False)
    assert drafter.info is not info and drafter.info["layer"] == best


def _predict(monkeypatch, speedup: float, target=None) -> None:
    """Calibration replaced by one whose best layer (2) is predicted at `speedup` of plain
    (no calibration kept from before: neither in this process nor on disk)."""

    def calibrate(self, context, k):
        self.info = {
            "layer": 2,
            "n_layers": 4,
            "calibrated": True,
            "k": k,
            "plain_ms": 1.0,
            "candidates": {
                2: {"alpha": 0.5, "draft_ms": 1.0, "verify_ms": 1.0, "predicted_speedup": speedup},
                3: {"alpha": 0.6, "draft_ms": 1.0, "verify_ms": 1.0, "predicted_speedup": speedup - 0.1},
            },
        }
        return 2

    from specdec.drafters import early_exit

    if target is not None:
        monkeypatch.delitem(early_exit.CALIBRATIONS, target.model, raising=False)
    monkeypatch.setattr(EarlyExitDrafter, "calibrate", calibrate)
    monkeypatch.setattr(early_exit, "_stored_calibration", lambda model, key: None)


@pytest.mark.parametrize("dtype", EXACT_MODES)
def test_a_predicted_slowdown_falls_back_to_plain_decoding(tiny4, monkeypatch, dtype):
    """Never slower than plain: a calibration that predicts < 1 turns drafting off for the
    request (said in drafter_info); force=True drafts anyway; the output is plain decoding's."""
    target = tiny4("llama", dtype)
    _predict(monkeypatch, 0.6, target)
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=16, ignore_eos=True)
    off = specdec.generate(
        target,
        PROMPTS[0],
        drafter=EarlyExitDrafter(target.model),
        k=3,
        max_new_tokens=16,
        ignore_eos=True,
        adaptive_k=False,
    )
    assert off.token_ids == plain.token_ids
    assert off.metrics.proposed == 0 and off.metrics.scored_rows == off.metrics.target_forwards
    assert (
        "plain decoding" in off.metrics.drafter_info["fallback"] and "--force" in off.metrics.drafter_info["fallback"]
    )
    forced = specdec.generate(
        target,
        PROMPTS[0],
        drafter=EarlyExitDrafter(target.model, force=True),
        k=3,
        max_new_tokens=16,
        ignore_eos=True,
        adaptive_k=False,
    )
    assert forced.token_ids == plain.token_ids and forced.metrics.proposed > 0
    assert "fallback" not in forced.metrics.drafter_info
    _predict(monkeypatch, 1.3, target)  # a layer that pays is used
    on = specdec.generate(
        target,
        PROMPTS[1],
        drafter=EarlyExitDrafter(target.model),
        k=3,
        max_new_tokens=16,
        ignore_eos=True,
        adaptive_k=False,
    )
    assert on.metrics.proposed > 0 and "fallback" not in on.metrics.drafter_info


def test_force_flag_and_the_fallback_line(tiny4, monkeypatch, capsys):
    from specdec.cli import main

    target = tiny4("llama", "fp32")
    _predict(monkeypatch, 0.5)
    base = [
        "generate",
        "--target",
        str(target.model.source_dir),
        "--drafter",
        "early-exit",
        "-k",
        "2",
        "--prompt",
        "hello",
        "--max-new-tokens",
        "6",
        "--dtype",
        "fp32",
    ]
    assert main(base) == 0
    err = capsys.readouterr().err
    assert "plain decoding: early exit predicted 0.50x" in err and "--force" in err
    assert main([*base, "--force"]) == 0
    assert "plain decoding" not in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--target",
                str(target.model.source_dir),
                "--drafter",
                "prompt-lookup",
                "--force",
                "--prompt",
                "hi",
                "--max-new-tokens",
                "2",
            ]
        )
        == 2
    )  # an option of another drafter
    assert "--drafter early-exit" in capsys.readouterr().err


def test_a_calibration_is_kept_for_later_processes(tiny4, monkeypatch, tmp_path):
    """The calibration lands in the specdec cache; a new process (no calibration in memory)
    reuses it instead of calibrating again."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    target = tiny4("llama", "fp32")
    monkeypatch.delitem(early_exit.CALIBRATIONS, target.model, raising=False)
    first = specdec.generate(
        target, PROMPTS[0], drafter=EarlyExitDrafter(target.model), k=2, max_new_tokens=6, adaptive_k=False
    )
    assert (tmp_path / "early_exit.json").exists()
    early_exit.CALIBRATIONS.pop(target.model, None)  # "a new process"

    def no_calibration(self, context, k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(EarlyExitDrafter, "calibrate", no_calibration)
    again = specdec.generate(
        target, PROMPTS[1], drafter=EarlyExitDrafter(target.model), k=2, max_new_tokens=6, adaptive_k=False
    )
    assert again.metrics.drafter_info["layer"] == first.metrics.drafter_info["layer"]
    assert again.metrics.drafter_info["candidates"] == first.metrics.drafter_info["candidates"]


def test_bad_layers_and_targets_are_refused(tiny4):
    target = tiny4("llama", "fp32")
    for bad in (0, 4, -1):
        with pytest.raises(ValueError, match=r"choose L in \[1, 3\]"):
            EarlyExitDrafter(target.model, layer=bad)
    with pytest.raises(ValueError, match=r"choose L in \[1, 3\]"):
        EarlyExitDrafter(target.model, candidates=(1, 7))
    other = tiny4("qwen2", "fp32")
    with pytest.raises(ValueError, match="different target"):
        specdec.generate(
            target, "abc", drafter=EarlyExitDrafter(other.model, layer=1), max_new_tokens=4, adaptive_k=False
        )
    with pytest.raises(ValueError, match="different target"):
        EarlyExitDrafter(target.model, layer=1).begin(DraftSession([1, 2], 8, SamplingParams(), torch.Generator()))


@pytest.mark.real
def test_greedy_identity_smollm2(smollm2_exact):
    model = smollm2_exact
    prompts = [
        "What is the capital of France?",
        "Write a short poem about the sea.",
        "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and then again 1, 2, 3,",
    ]
    accepted = 0
    drafter = EarlyExitDrafter(model.model)  # calibrated once, reused
    for prompt in prompts:
        plain = specdec.generate(model, prompt, max_new_tokens=40)
        for d, k in ((drafter, 3), (EarlyExitDrafter(model.model, layer=20), 2)):
            out = specdec.generate(model, prompt, drafter=d, k=k, max_new_tokens=40, adaptive_k=False)
            assert out.token_ids == plain.token_ids, (prompt, k)
            accepted += out.metrics.accepted
    assert accepted > 0 and 15 <= drafter.layer <= 29
