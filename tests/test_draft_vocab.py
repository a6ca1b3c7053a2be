"""The draft model's cut vocabulary (FR-Spec): the cut head's logits are the full head's rows,
greedy output stays plain decoding's, the sampling law stays the target's when the verifier
gets the cut q (and not when it gets the uncut one), and frequency lists are found by tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import EXACT_MODES
from helpers import ALPHA, PROMPTS, WholeDraftQ, chi2_pvalue, run_cli

import specdec
from specdec.config import SamplingParams
from specdec.drafters import DraftModelDrafter
from specdec.drafters import vocab as dv


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # untied, tied, tied + softcap-free offset norm
@pytest.mark.parametrize("dtype", ["fp32", *EXACT_MODES])
def test_cut_head_gives_the_full_heads_logits_of_its_tokens(tiny, arch, dtype):
    model = tiny(arch, "target", dtype).model
    ids = _ids(100, model.args.vocab_size, 0)
    try:
        vocab = dv.DraftVocab(model, ids)
    except ValueError as e:  # int8 keeps no float rows of an untied head: then no cut (the full head runs)
        assert dtype == "int8" and not model.args.tie_embeddings and "keeps no weights" in str(e)
        return
    h = torch.randn(1, 3, model.args.dim, generator=torch.Generator().manual_seed(1))
    full = model.head_logits(h)  # [1, 3, V]
    sub = vocab.logits(h)  # [1, 3, N]
    assert torch.equal(vocab.ids, torch.sort(ids).values)
    if dtype in EXACT_MODES:  # bitwise: the same rows through the same kernel
        assert torch.equal(sub, full[..., vocab.ids])
    else:  # (fp32's BLAS may block a cut matrix differently)
        assert torch.allclose(sub, full[..., vocab.ids], atol=1e-5)
    expanded = dv.SequenceVocab(vocab).expand(sub)  # (a sequence that has shown nothing new)
    assert torch.equal(expanded[..., vocab.ids], sub)
    outside = torch.ones(model.args.vocab_size, dtype=torch.bool)
    outside[vocab.ids] = False
    assert torch.isneginf(expanded[..., outside]).all()


class _Recording(DraftModelDrafter):
    proposed: list[int] = []

    @classmethod
    def propose_batch(cls, drafters, ks):
        out = super().propose_batch(drafters, ks)
        cls.proposed += [t for d in out for t in d.tokens.tolist()]
        return out


@pytest.mark.parametrize("dtype", EXACT_MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_identity_with_a_cut_vocabulary(tiny, arch, dtype):
    target, draft = tiny(arch, "target", dtype), tiny(arch, "close", dtype)
    if dtype == "int8" and not draft.model.args.tie_embeddings:
        pytest.skip("int8 keeps no float rows of an untied head: the draft runs its full head (tested above)")
    # the draft may propose only these tokens: half the vocabulary, so many targets' tokens lie outside
    ids = _ids(draft.model.args.vocab_size // 2, draft.model.args.vocab_size, 3)
    vocab = dv.DraftVocab(draft.model, ids)
    allowed = set(vocab.ids.tolist())
    outside = 0
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, ignore_eos=True)
        drafter = _Recording(draft.model, vocab=vocab)
        _Recording.proposed = []
        spec = specdec.generate(
            target, prompt, drafter=drafter, k=4, max_new_tokens=24, ignore_eos=True, adaptive_k=False
        )
        assert spec.token_ids == plain.token_ids, prompt
        shown = set(target.tokenizer.encode(prompt)) | set(plain.token_ids)  # (the sequence's own tokens join it)
        assert _Recording.proposed and set(_Recording.proposed) <= allowed | shown
        outside += sum(t not in allowed for t in _Recording.proposed)
    assert outside > 0  # tokens outside the list were drafted once the sequence had shown them


@pytest.mark.parametrize("dtype", ["fp32", *EXACT_MODES])
def test_a_sequences_own_tokens_join_its_vocabulary(tiny, dtype):
    model = tiny("qwen2", "target", dtype).model
    base = dv.DraftVocab(model, torch.arange(0, 200, 2))  # even ids only
    seq = dv.SequenceVocab(base)
    seq.add([3, 4, 7, 3, 263, 9999, -1])  # 4 is in the list; out-of-range ids are ignored
    assert seq.extra == [3, 7, 263]
    assert seq.ids.tolist() == list(range(0, 200, 2)) + [3, 7, 263]
    h = torch.randn(2, model.args.dim, generator=torch.Generator().manual_seed(4))
    own = seq.logits(base.logits(h), h)  # [2, 103]
    ref = model.head_logits(h[None])[0][:, seq.ids]
    # the full head's numbers, every row: bitwise in the exact modes (fp32's BLAS may block a cut differently)
    assert torch.equal(own, ref) if dtype in EXACT_MODES else torch.allclose(own, ref, atol=1e-5)
    full = seq.expand(own)
    assert torch.isneginf(full[:, 5]).all() and torch.equal(full[:, 263], own[:, -1])
    seq.add([11])
    assert seq.ids[-1] == 11 and seq.logits(base.logits(h), h).shape == (2, 104)


def _cut(draft, ids) -> dv.DraftVocab:
    return dv.DraftVocab(draft, torch.tensor(ids))


SUBSET = [0, 2, 3, 5, 6]  # 5 of the 8 tokens


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9)],
    ids=["T1", "T0.8-topk-topp"],
)
@pytest.mark.slow
def test_cut_vocabulary_keeps_the_target_sampling_law(small_vocab, exact_joint, sample_joint, sampling):
    target, draft = small_vocab
    counts = sample_joint(target, lambda: DraftModelDrafter(draft, vocab=_cut(draft, SUBSET)), sampling, runs=3000)
    assert set(counts) - set(exact_joint(target, sampling, 4)) == set()
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) > ALPHA


@pytest.mark.slow
def test_verifier_given_the_uncut_q_fails(small_vocab, exact_joint, sample_joint):
    target, draft = small_vocab
    sampling = SamplingParams(temperature=1.0)
    # (1,200 runs: p about 1e-7 here, far under ALPHA; the law tests keep their 3,000)
    counts = sample_joint(target, lambda: WholeDraftQ(draft, vocab=_cut(draft, SUBSET)), sampling, runs=1200)
    assert chi2_pvalue(counts, exact_joint(target, sampling, 4)) <= ALPHA


def test_lists_are_found_by_tokenizer_and_cut_to_n(tiny, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    draft = tiny("llama", "close", "fp32").model
    key = dv.tokenizer_key(tiny_dir("llama", "close"))
    assert key is not None and key == dv.tokenizer_key(tiny_dir("llama", "target"))  # one byte tokenizer
    counts = np.zeros(draft.args.vocab_size, np.int64)
    counts[[10, 20, 30, 40]] = [5, 9, 7, 1]
    dv.write(dv.user_dir() / "bytes.safetensors", counts, key=key, always=[256], meta={"data": "test"})
    freq = dv.lookup(key)
    assert freq is not None and freq.ids.tolist() == [256, 20, 30, 10, 40]  # eos first, then by count
    assert freq.coverage(3) == pytest.approx(16 / 22)
    assert dv.lookup("0" * 16) is None
    cut = dv.draft_vocab(draft, 3)
    assert cut is not None and cut.ids.tolist() == [20, 30, 256]
    assert DraftModelDrafter(draft, vocab=3).vocab is cut  # built once per model and N
    assert DraftModelDrafter(draft, vocab=0).vocab is None and dv.draft_vocab(draft, draft.args.vocab_size) is None
    with pytest.raises(ValueError, match="give N > 0"):
        dv.draft_vocab(draft, -1)


def test_models_vocab_counts_chat_rendered_conversations(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    data = tmp_path / "talk.json"
    data.write_text(
        json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "aaab"}, {"from": "gpt", "value": "ba"}]}])
    )
    out = tmp_path / "list.safetensors"
    res = run_cli(capsys, "models", "vocab", str(tiny_dir("llama")), "--data", str(data), "--out", str(out))
    assert res.returncode == 0, res.stderr
    freq = dv._read(out)
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_dir("llama"))
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    got = dict(zip(freq.ids.tolist(), freq.counts.tolist(), strict=True))
    assert got[a] == 4 and got[b] == 2 and 256 in got  # eos always kept
    assert freq.meta["tokenizer"] == dv.tokenizer_key(tiny_dir("llama")) and "--out" in freq.meta["command"]


@pytest.mark.slow
def test_bench_forward_times_the_draft(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    counts = np.arange(264, dtype=np.int64)
    dv.write(dv.user_dir() / "bytes.safetensors", counts, key=dv.tokenizer_key(tiny_dir("llama")), meta={})
    res = run_cli(
        capsys,
        "bench",
        "forward",
        "--model",
        str(tiny_dir("llama")),
        "--modes",
        "int8",
        "--context",
        "8",
        "--repeats",
        "1",
        "--draft",
        str(tiny_dir("llama", "close")),
        "--draft-vocab",
        "64",
        "0",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)["draft"]
    assert set(d["vocab"]) == {"64", "0"} and d["vocab"]["64"]["tokens"] == 64 and d["vocab"]["0"]["tokens"] == 264
    assert d["draft_ratio"] == d["vocab"]["64"]["ratio"] > 0 and d["target_ms"] > 0


def test_draft_step_cost_is_timed_once_per_machine_and_vocabulary(tiny, tmp_path, monkeypatch):
    from specdec import costs
    from specdec.drafters.draft_model import step_cost_ms

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    model = tiny("qwen2", "close", "fp32").model
    costs.DRAFT_STEPS.pop(model, None)
    full, cut = step_cost_ms(model, None), step_cost_ms(model, dv.DraftVocab(model, torch.arange(50)))
    assert full > 0 and cut > 0
    table = json.loads((tmp_path / costs.DRAFT_STEP_FILE).read_text())
    assert sorted(k.rsplit("|", 1)[1] for k in table) == ["vocab=0", "vocab=50"]
    costs.DRAFT_STEPS.pop(model, None)  # a new process: read back, not timed again

    def no_clock() -> float:
        raise AssertionError("timed again")

    monkeypatch.setattr(costs.time, "perf_counter", no_clock)
    assert step_cost_ms(model, None) == round(full, 3)
