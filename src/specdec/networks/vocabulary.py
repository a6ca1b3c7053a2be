"""What a trained head shares with its target's vocabulary: the draft vocabulary (a subset of
the target's ids, in the EAGLE-3 format's d2t/t2d maps), and the target's embedding table and
output rows that a head borrows, frozen, instead of learning its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..model.transformer import Transformer


def vocab_maps(draft_to_target: torch.Tensor, size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-3 format's draft-vocabulary maps for `size` distinct target ids: d2t [size]
    (draft id j is target id j + d2t[j]; draft ids follow target ids in increasing order) and
    t2d [vocab_size] (whether a target id is in the draft vocabulary)."""
    ids = draft_to_target.long().sort().values
    if ids.shape != (size,) or len(set(ids.tolist())) != ids.numel():
        raise ValueError(f"the draft vocabulary needs {size} distinct target ids")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


class DraftVocabulary:
    """The draft vocabulary of a head module whose config has `draft_vocab_size` and
    `target_vocab_size` and which holds `d2t`/`t2d` buffers (EAGLE-3, Medusa and Hydra heads)."""

    cfg: Any
    d2t: torch.Tensor
    t2d: torch.Tensor

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """The draft vocabulary: a set of N target ids. Draft ids follow target ids in
        increasing order (as the EAGLE-3 format's d2t offsets assume)."""
        d2t, t2d = vocab_maps(draft_to_target, self.cfg.draft_vocab_size, self.cfg.target_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id, [N]."""
        return self.d2t + torch.arange(self.d2t.numel())


def target_output_rows(target: Any, model_dir: str | Path | None = None) -> torch.Tensor:
    """The target's LM head weight [V, H] as floats: its embedding table when tied, else the
    loaded weight, or (packed q4k weights) the float weight in the model directory."""
    a = target.args
    if a.tie_embeddings:
        return target.model.embed_tokens.weight.detach().float()
    w = target.lm_head.weight
    if w.numel():
        return w.detach().float()
    from safetensors import safe_open

    for f in sorted(Path(model_dir or "").glob("*.safetensors")) if model_dir else []:
        with safe_open(str(f), "pt") as st:
            if "lm_head.weight" in st.keys():
                return st.get_tensor("lm_head.weight").float()
    from ..model.convert import gguf_source
    from ..model.gguf_file import float_tensor
    from ..model.gguf_reader import open_gguf

    gguf = gguf_source(Path(model_dir)) if model_dir else None
    if gguf is not None:  # installed without float weights: the output rows straight from the GGUF
        return torch.from_numpy(float_tensor(open_gguf(gguf), "output.weight", a))
    raise ValueError("the target's LM head weights are packed and its model directory has no lm_head.weight")


def attach(head: Any, target: Transformer, model_dir: str | Path | None = None) -> Any:
    """Give a head the target's frozen embedding table (scaled as the target scales it) and its
    LM head rows (heads that read them: `head.needs_output_rows`), checked against the sizes it
    was trained for."""
    c = head.cfg
    if c.hidden_size != target.args.dim or c.target_vocab_size != target.args.vocab_size:
        raise ValueError(
            f"this {head.kind} head was trained for {c.target!r} (hidden {c.hidden_size}, vocabulary "
            f"{c.target_vocab_size}); the target has hidden {target.args.dim}, vocabulary "
            f"{target.args.vocab_size}"
        )
    embed = target.model.embed_tokens.weight.detach().float()
    if target.args.embed_scale != 1.0:
        embed = embed * target.args.embed_scale
    rows = target_output_rows(target, model_dir or target.source_dir) if head.needs_output_rows else None
    head.attach(embed, rows)
    return head
