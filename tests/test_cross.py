"""A draft model of another tokenizer (`specdec.drafters.cross`): the shared vocabulary, the
committed text carried into the draft's tokens, greedy identity (string-level matching) on tiny
models and on real pairs, the sampling law of the token-level intersection with a negative
control that forgets the renormalisation, and the clear line for a pair that cannot draft across."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ALPHA, PROMPT_IDS, V_SMALL, chi2_pvalue
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import specdec
from specdec.api import encode_prompt
from specdec.config import SamplingParams
from specdec.drafters import cross
from specdec.drafters.base import describe
from specdec.drafters.cross import Bridge, CrossDraftModelDrafter, DraftText
from specdec.drafters.vocab import DEFAULT_VOCAB
from specdec.testing import make_tiny_model
from specdec.tokenizer import Tokenizer

LETTERS = "abcdefgh"  # the law tests' 8-token vocabularies, one letter each


def _bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]] = (), byte_level: bool = False
) -> PreTrainedTokenizerFast:
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _letters(order: str, merges: list[tuple[str, str]] = ()) -> Tokenizer:
    """A tokenizer over `order`'s letters (id = position) and the merged pairs after them."""
    vocab = {c: i for i, c in enumerate(order)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return Tokenizer(_bpe(vocab, merges), frozenset())


def _byte_level(order: list[str], merges: list[tuple[str, str]], specials: tuple[str, ...] = ("<eos>", "<bos>")):
    """A byte-level BPE tokenizer: the 256 byte characters in `order`, then the merges, then
    the specials."""
    vocab = {c: i for i, c in enumerate(order)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for s in specials:
        vocab[s] = len(vocab)
    fast = _bpe(vocab, merges, byte_level=True)
    fast.add_special_tokens({"eos_token": specials[0], "bos_token": specials[1]})
    return fast


# -- the shared vocabulary and the carried text (no model) ---------------------------------------
def test_the_bridge_pairs_the_tokens_both_vocabularies_spell_the_same():
    target = _letters(LETTERS)
    draft = _letters("hgfedcba"[:6], merges=[("h", "g")])  # 6 letters (reversed) and "hg"
    b = Bridge(target, draft, 8, 8)
    cover = b.coverage()
    assert (cover["shared_tokens"], cover["of_draft"], cover["of_target"]) == (6, round(6 / 7, 4), 0.75)
    for d in range(6):  # each shared draft token maps to the target token of its letter
        assert LETTERS[int(b.to_target[d])] == "hgfedcba"[d]
    assert int(b.to_target[6]) == -1 and not b.mask[6]  # "hg" is the draft's alone
    assert int(b.to_target[7]) == -1  # a row of the draft's head with no token


def test_the_draft_reads_the_committed_text_in_its_own_tokens_and_waits_for_a_whole_character():
    from specdec.testing import byte_tokenizer

    target = Tokenizer(byte_tokenizer(), frozenset())
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("h", "e"), ("l", "l"), ("he", "ll")]
    draft = Tokenizer(_byte_level(alphabet[::-1], merges), frozenset())
    b = Bridge(target, draft, 264, len(draft.hf))
    text = DraftText(b, target.encode_text("he"))
    assert [draft.token_bytes(t) for t in text.tokens] == [b"he"]
    text.extend(target.encode_text("ll"))  # "he" + "ll": read again as one token
    assert [draft.token_bytes(t) for t in text.tokens] == [b"hell"] and text.pending == b""
    snow = "\u00e9".encode()  # a two-byte character, committed one byte at a time
    of_byte = {target.token_bytes(i): i for i in range(256)}
    text.extend([of_byte[snow[:1]]])
    assert text.pending == snow[:1] and [draft.token_bytes(t) for t in text.tokens] == [b"hell"]
    text.extend([of_byte[snow[1:]]])
    assert text.pending == b"" and b"".join(draft.token_bytes(t) for t in text.tokens) == "hell\u00e9".encode()


# -- greedy identity on tiny models -----------------------------------------------------------
@pytest.fixture(scope="module")
def cross_pair(tiny_dir, tmp_path_factory):
    """The tiny byte-level target; a draft that is the target itself with its byte tokens
    numbered in reverse (every greedy draft must be accepted: the maps are checked); and a
    noisy draft whose tokenizer also merges pairs (drafts that end mid-token)."""
    root = tmp_path_factory.mktemp("cross")
    target_dir = tiny_dir("llama")
    state = load_file(str(target_dir / "model.safetensors"))
    config = json.loads((target_dir / "config.json").read_text())
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())

    def write(name: str, order: list[int], merges: list[tuple[str, str]], noise: float) -> specdec.LoadedModel:
        out = root / name
        out.mkdir()
        gen = torch.Generator().manual_seed(3)
        new = {}
        for key, w in state.items():
            if key in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = w[:256][order]  # draft id i is the target's byte order[i]
                extra = w[[order[len(order) // 2]] * len(merges)]  # merged tokens: a row of one byte
                w = torch.cat([rows, extra, w[256:258]])
            new[key] = w + noise * w.std() * torch.randn(w.shape, generator=gen)
        save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = dict(
            config, vocab_size=256 + len(merges) + 2, eos_token_id=256 + len(merges), bos_token_id=257 + len(merges)
        )
        cfg["pad_token_id"] = cfg["eos_token_id"]
        (out / "config.json").write_text(json.dumps(cfg))
        _byte_level([alphabet[i] for i in order], merges).save_pretrained(out)
        return specdec.load(out, dtype="fp32", device="cpu")

    reverse = list(range(255, -1, -1))
    mirror = write("mirror", reverse, [], 0.0)
    merged = write("merged", reverse, [(alphabet[ord("e")], alphabet[ord(" ")]), ("d", "e")], 0.05)
    return specdec.load(target_dir, dtype="fp32", device="cpu"), mirror, merged


PROMPTS = ["hello world", "caf\u00e9 na\u00efve \u4e2d\u6587", "def f(x):\n    return x"]


@pytest.mark.parametrize("drafter", ["draft-model", "auto"])
def test_greedy_identity_across_tokenizers(cross_pair, drafter):
    target, mirror, merged = cross_pair
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=24, chat=False, ignore_eos=True)
        for draft in (mirror, merged):
            out = specdec.generate(
                target, prompt, assistant_model=draft, drafter=drafter, max_new_tokens=24, chat=False, ignore_eos=True
            )
            assert out.token_ids == plain.token_ids, (prompt, draft.name)
        if drafter == "draft-model":  # the mirror is the target: whatever it drafts is kept
            m = specdec.generate(
                target, prompt, assistant_model=mirror, max_new_tokens=24, chat=False, ignore_eos=True, adaptive_k=False
            ).metrics
            assert m.proposed > 10 and m.accepted == m.proposed, (prompt, m.accepted, m.proposed)


TARGET_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DRAFT_CHAT = "{% for m in messages %}[{{ m.role }}]: {{ m.content }}\n{% endfor %}[assistant]: "


def test_a_chat_is_read_by_the_draft_in_its_own_template(cross_pair, monkeypatch):
    """The draft renders the conversation the target's template rendered with its own template
    (the target's markup is not its text); the rest of the text follows as the target commits
    it. A prompt that was no conversation (raw text) is read as the target's text. Greedy stays
    identical either way."""
    target, _, merged = cross_pair
    monkeypatch.setattr(target.tokenizer.hf, "chat_template", TARGET_CHAT, raising=False)
    monkeypatch.setattr(merged.tokenizer.hf, "chat_template", DRAFT_CHAT, raising=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "caf\u00e9 hello"}]
    for prompt, chat in ((messages, None), ("caf\u00e9 hello", False)):
        plain = specdec.generate(target, prompt, max_new_tokens=24, chat=chat, ignore_eos=True)
        d = specdec.build_drafter(target, merged, "draft-model")
        out = specdec.generate(
            target, prompt, drafter=d, max_new_tokens=24, chat=chat, ignore_eos=True, adaptive_k=False, k=4
        )
        assert out.token_ids == plain.token_ids and out.metrics.proposed > 0
        text, b = d.text, d.bridge  # the draft's text: its own prompt, then the target's text
        own = merged.tokenizer.encode_chat(messages) if chat is None else b.draft_start
        assert text.tokens[: text.floor] == own
        ids = encode_prompt(target.tokenizer, prompt, chat)
        rest = ids[len(ids) if chat is None else b.target_start :] + plain.token_ids
        head, expected = b.spell(merged.tokenizer, own), b.spell(target.tokenizer, rest)
        assert bytes(text.data[: len(head)]) == head
        followed = bytes(text.data[len(head) :])  # (all but the last step's tokens, at least)
        assert expected.startswith(followed) and len(followed) > len(expected) // 2


def test_sampled_decoding_across_tokenizers_is_reproducible(cross_pair):
    target, _, merged = cross_pair
    runs = [
        specdec.generate(
            target,
            "hello",
            assistant_model=merged,
            max_new_tokens=16,
            temperature=1.0,
            seed=5,
            chat=False,
            adaptive_k=False,
        )
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].metrics.proposed > 0


# -- the sampling law (token-level intersection) ---------------------------------------------
@pytest.fixture(scope="module")
def letters_pair(small_vocab):
    """The law tests' 8-token target and draft, read as letters: the target's a..h, the draft's
    6 of them in another order and 2 merged pairs (a quarter of its mass off the shared tokens)."""
    target, draft = small_vocab
    b = Bridge(_letters(LETTERS), _letters("fedcba", merges=[("a", "b"), ("c", "d")]), V_SMALL, V_SMALL)
    return target, draft, b


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["law", "control"])
def test_sampling_law_across_tokenizers(kind, letters_pair, exact_joint, sample_joint, monkeypatch):
    """The target's joint law of 4 tokens against 3,000 draws with the draft drawing over the
    shared vocabulary, its whole head's q restricted and renormalised; the control forgets to
    renormalise q and must be caught. (The default head, cut to the shared rows, draws from the
    same q': `test_the_cut_head_draws_what_the_renormalised_whole_head_draws`.)"""
    target, draft, b = letters_pair
    if kind == "control":
        monkeypatch.setattr(CrossDraftModelDrafter, "_restrict", lambda self, q: q * self._mask)
    sampling = SamplingParams(temperature=1.0)
    counts = sample_joint(target, lambda: CrossDraftModelDrafter(draft, b, vocab=0, confidence=0), sampling, runs=3000)
    p = chi2_pvalue(counts, exact_joint(target, sampling, 4, PROMPT_IDS))
    print(f"cross {kind}: p = {p:.3g}")
    assert (p > ALPHA) if kind == "law" else (p <= ALPHA), p


def test_the_cut_head_draws_what_the_renormalised_whole_head_draws(cross_pair):
    """The head cut to the shared rows (the default) gives q' = the whole head's q restricted to
    them and renormalised: seeded sampled runs of the two draw the same drafts and accept the same."""
    target, _, merged = cross_pair
    b = cross.bridge(target.tokenizer, merged.tokenizer, target.model.args.vocab_size, merged.model.args.vocab_size)
    cut = CrossDraftModelDrafter(merged.model, b, vocab=DEFAULT_VOCAB)
    assert cut.vocab is not None and cut.vocab.ids.tolist() == sorted(b.shared_draft.tolist())
    runs = [
        specdec.generate(
            target,
            prompt,
            drafter=CrossDraftModelDrafter(merged.model, b, vocab=vocab, confidence=0),
            max_new_tokens=24,
            temperature=1.0,
            seed=11,
            chat=False,
            adaptive_k=False,
            k=4,
        )
        for prompt in PROMPTS
        for vocab in (DEFAULT_VOCAB, 0)
    ]
    for cut_run, whole in zip(runs[::2], runs[1::2], strict=True):
        assert cut_run.token_ids == whole.token_ids and cut_run.metrics.proposed > 0
        assert (cut_run.metrics.accepted, cut_run.metrics.proposed) == (whole.metrics.accepted, whole.metrics.proposed)


# -- bad input ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory):
    """A draft whose tokens for ordinary text are mostly merges the byte-level target lacks."""
    from tokenizers import trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [cross.PROBE] * 20,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    other = make_tiny_model(tmp_path_factory.mktemp("poor"), "llama", seed=5, vocab_size=len(hf), tokenizer=False)
    hf.save_pretrained(other)
    return specdec.load(other)


def test_a_pair_that_shares_too_little_is_refused_with_one_line(tiny, poor_draft):
    with pytest.raises(ValueError, match=r"spell only \d+% of the draft's tokens for a text the same"):
        specdec.generate(tiny("llama"), "hello", assistant_model=poor_draft)


def test_a_draft_whose_tokenizer_cannot_be_read_gets_one_line(tiny_dir, tmp_path, specdec_cli):
    bare = make_tiny_model(tmp_path / "bare", "llama", seed=5, tokenizer=False)
    run = specdec_cli(
        "generate", "--target", str(tiny_dir("llama")), "--prompt", "hi", "--draft", str(bare), "--max-new-tokens", "2"
    )
    assert run.returncode == 2 and "cannot be read (no tokenizer.json)" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_a_tree_is_not_grown_across_tokenizers(cross_pair):
    target, _, merged = cross_pair
    with pytest.raises(ValueError, match="drafts chains"):
        specdec.generate(target, "hi", assistant_model=merged, tree=1)


def test_the_bridge_is_built_once_per_pair(cross_pair):
    target, mirror, _ = cross_pair
    first = cross.bridge(target.tokenizer, mirror.tokenizer, 264, 258)
    assert cross.bridge(target.tokenizer, mirror.tokenizer, 264, 258) is first


# -- real pairs -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    return specdec.load("qwen2.5-coder-1.5b")


REAL_PROMPTS = ["Write a Python function that checks whether a string is a palindrome.", "Explain what a hash map is."]


@pytest.mark.real
@pytest.mark.parametrize("draft_name", ["smollm2-135m", "gemma3-270m"])
def test_real_pairs_across_tokenizers_are_greedy_identical(draft_name, qwen, plain_outputs):
    draft = specdec.load(draft_name)
    plains = plain_outputs(qwen, REAL_PROMPTS, 32)
    for prompt, plain in zip(REAL_PROMPTS, plains, strict=True):
        # (draft-model drafting on every step, k = 4; auto as it chooses)
        for drafter in ("draft-model", "auto") if prompt == REAL_PROMPTS[0] else ("draft-model",):
            fixed = {"adaptive_k": False, "k": 4} if drafter == "draft-model" else {}
            out = specdec.generate(qwen, prompt, assistant_model=draft, drafter=drafter, max_new_tokens=32, **fixed)
            assert out.token_ids == plain.token_ids, (draft_name, drafter, prompt)
            if fixed:
                assert out.metrics.accepted > 0, (draft_name, prompt)


def test_info_pair_reports_how_a_draft_drafts(cross_pair, specdec_cli):
    target, mirror, merged = cross_pair
    run = specdec_cli("info", "--pair", str(target.path), str(merged.path), "--json")
    rep = json.loads(run.stdout)
    assert run.returncode == 0 and rep["tokenizer"] == "across" and rep["drafts"] is True
    assert rep["shared_tokens"] == 256 and rep["of_text"] > 0.5
    same = specdec_cli("info", "--pair", str(target.path), str(target.path))
    assert same.returncode == 0 and "the same tokenizer" in same.stdout


def test_auto_leaves_out_a_draft_that_cannot_draft_across_and_says_so(tiny, poor_draft):
    out = specdec.generate(tiny("llama"), "hello", assistant_model=poor_draft, drafter="auto", max_new_tokens=8)
    left = out.metrics.drafter_info["schedule"]["left_out"]
    assert list(left) == ["draft-model"] and "spell only" in left["draft-model"]
    assert "draft-model" not in out.metrics.drafter_info["schedule"]["methods"]
    assert any("auto left out draft-model" in line for line in describe("auto", out.metrics.drafter_info, brief=True))
