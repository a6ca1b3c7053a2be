"""Medusa and Hydra heads: extra next-next-token heads on the target's last hidden state.

Medusa (Cai et al., 2024, Medusa-1: the target frozen): head d (d = 1..K) reads h_t, the
target's final-normed hidden state at position t, and guesses token t + 1 + d — the token
*after* the one the target itself predicts at t. Each head is one residual block,
z_d = h_t + SiLU(W_d h_t + b_d), followed by an LM head. Field names follow vLLM's Medusa
model (`blocks.{d}.layers.0.weight/bias`).

Hydra (Ankner et al., 2024): sequentially dependent heads. Head d also reads the tokens
guessed before it — y_1 (the target's own next token, known when drafting starts), then the
draft tokens of heads < d — through a running state: z_0 = h_t and
z_d = z_{d-1} + W2_d SiLU(W1_d [z_{d-1}; e(y_d)] + b_d), with e the target's own (frozen)
embedding table. Drafting a tree then takes one call per depth (each frontier node carries
its own state), where Medusa's heads all run in one call.

Both keep the LM cost small the way EAGLE-3 does: logits over a *draft vocabulary* of the N
target tokens the target most often predicts in the training data (`d2t`/`t2d` as EAGLE-3's),
through the target's own output rows for those tokens (tied: nothing stored; every head
shares them, so all K heads' logits are one matrix product over K rows).

Training (`specdec train medusa|hydra`, below):
The recipe and trainer are EAGLE-3's (`training.recipe`, `training.loop`): the
same data modes (teacher: the data's answers; self: the target's own), the same feature
cache — here the residual after the target's last layer, which the target's final norm turns
into h_t, the state the LM head reads — the same draft vocabulary, seeded resumable training
with progress, checkpoints and torchrun/DDP.

Loss: head d at anchor t predicts token t + 1 + d; its label is the target's own distribution
there (top-k, mapped into the draft vocabulary), a soft cross-entropy weighted 0.8^(d-1)
(Medusa's λ_d), counted where the predicted token belongs to an answer. Hydra's heads read
the true tokens y_1..y_d (teacher forcing: the accepted path is what they follow when
drafting).

After training, the validation sequences give each head's top-k accuracy — how often its
(j+1)-th choice is the target's own next token there — the table Medusa's tree is built from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .vocabulary import DraftVocabulary

CONFIG_NAME = "specdec_medusa.json"
WEIGHTS_NAME = "model.safetensors"
KINDS = ("medusa", "hydra")


@dataclass(frozen=True)
class MedusaConfig:
    """Shape and provenance of a set of heads (written beside their weights)."""

    kind: str  # "medusa" | "hydra"
    target: str  # the target's registered name or directory
    target_vocab_size: int
    hidden_size: int
    num_heads: int  # K: head d guesses token t + 1 + d
    draft_vocab_size: int
    hydra_inner: int = 512  # Hydra: width of each head's MLP
    medusa_fc_bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.num_heads < 1 or self.draft_vocab_size < 1 or self.hydra_inner < 1:
            raise ValueError("num_heads, draft_vocab_size and hydra_inner must be at least 1")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MedusaConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class _ResBlock(nn.Module):
    """Medusa's block: x + SiLU(W x + b) (vLLM: `ResidualBlock.layers[0]`)."""

    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim, bias=bias)])


class _HydraBlock(nn.Module):
    """z + W2 SiLU(W1 [z; e(y)] + b1)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2 * dim, inner, bias=True)
        self.fc2 = nn.Linear(inner, dim, bias=False)


class MedusaHeads(DraftVocabulary, nn.Module):
    """K Medusa or Hydra heads over a frozen target (see the module doc)."""

    needs_output_rows = True

    @property
    def kind(self) -> str:
        return self.cfg.kind

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        if cfg.kind == "medusa":
            self.blocks = nn.ModuleList([_ResBlock(H, cfg.medusa_fc_bias) for _ in range(cfg.num_heads)])
        else:
            self.blocks = nn.ModuleList([_HydraBlock(H, cfg.hydra_inner) for _ in range(cfg.num_heads)])
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        # frozen target parts, set by `attach` and never saved: output rows of the draft
        # vocabulary [N, H] (the shared LM head) and the embedding table [V, H] (Hydra)
        self.register_buffer("lm_weight", torch.zeros(0, H), persistent=False)
        self.register_buffer("embed_weight", torch.zeros(0, H), persistent=False)
        self.record: dict[str, Any] = {}  # the training record (of loaded heads)

    # -- set-up ---------------------------------------------------------------------------
    def attach(self, embed: torch.Tensor, output_rows: torch.Tensor | None) -> None:
        """The target's embedding table [V, H] and LM head rows [V, H] (frozen, shared)."""
        if output_rows is None:
            raise ValueError("Medusa/Hydra heads need the target's LM head rows")
        self.embed_weight = embed.detach().float()
        self.lm_weight = output_rows.detach().float()[self.draft_ids].contiguous()

    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded; the last layer of every block at zero, so each head starts as the target's
        own LM head on h_t (Medusa's initialisation)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layers.0.weight") or name.endswith("fc2.weight") or name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=generator)

    # -- the heads ------------------------------------------------------------------------
    def block(self, d: int, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Head d's (0-based) state from the previous one (Medusa: h_t itself; Hydra: z_{d-1}),
        [..., H]; Hydra also reads the guessed token y [...] before it."""
        b = self.blocks[d]
        if self.cfg.kind == "medusa":
            return z + F.silu(b.layers[0](z))
        if y is None:
            raise ValueError("a Hydra head reads the token guessed before it")
        e = F.embedding(y, self.embed_weight).to(z.dtype)
        return z + b.fc2(F.silu(b.fc1(torch.cat([z, e], -1))))

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """[..., H] -> draft-vocabulary logits [..., N] (the target's rows, shared by all heads)."""
        return F.linear(z, self.lm_weight.to(z.dtype))

    def states(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every head's state for hidden states h [A, H]; Hydra reads `tokens` [A, K] (y_1..y_K
        per row: the target's next token, then the tokens guessed or, in training, the true ones)."""
        out, z = [], h
        for d in range(self.cfg.num_heads):
            if self.cfg.kind == "medusa":
                out.append(self.block(d, h))
            else:
                assert tokens is not None
                z = self.block(d, z, tokens[:, d])
                out.append(z)
        return out

    # -- files ----------------------------------------------------------------------------
    def save(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """config + float16 weights; `extra` (the training record: command, data, seed, CPU
        time, per-head accuracies) beside them."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt", "specdec": self.cfg.kind})
        (out / CONFIG_NAME).write_text(json.dumps({**self.cfg.to_json(), "training": extra or {}}, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> MedusaHeads:
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / CONFIG_NAME).exists() or not (d / WEIGHTS_NAME).exists():
            raise FileNotFoundError(
                f"{d} is not a Medusa/Hydra head directory ({CONFIG_NAME} and {WEIGHTS_NAME} "
                "expected; train one with `specdec train medusa|hydra`)"
            )
        heads = cls(MedusaConfig.from_json(json.loads((d / CONFIG_NAME).read_text())))
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(d / WEIGHTS_NAME)).items()}
        missing, unexpected = heads.load_state_dict(state, strict=False)
        if unexpected or any(m not in ("lm_weight", "embed_weight") for m in missing):
            raise ValueError(f"{d}: weights do not match the config (missing {missing}, unexpected {unexpected})")
        heads.record = json.loads((d / CONFIG_NAME).read_text()).get("training", {})
        return heads


def config_for_target(
    target: Any, name: str, kind: str, *, num_heads: int, draft_vocab_size: int, hydra_inner: int = 512
) -> MedusaConfig:
    a = target.args
    return MedusaConfig(
        kind=kind,
        target=name,
        target_vocab_size=a.vocab_size,
        hidden_size=a.dim,
        num_heads=num_heads,
        draft_vocab_size=min(draft_vocab_size, a.vocab_size),
        hydra_inner=hydra_inner,
    )


def greedy_tree(accuracy: list[list[float]], size: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Medusa's tree construction: `accuracy[d][j]` is how often head d's (j+1)-th choice is
    the right token; a node is a path of choice ranks (j_1, ..., j_d), expected to be accepted
    with the product of its ranks' accuracies (heads taken as independent). Adds the most
    likely node whose parent is in the tree, `size` times. Returns the paths in the order they
    were added — best first, so every prefix is a tree of its own (a node's parent comes
    before it, a node's siblings of better rank too) — and their expected acceptance."""
    import heapq

    heap: list[tuple[float, tuple[int, ...], float]] = []  # (-value, path, its parent's value)
    if accuracy and accuracy[0]:
        heapq.heappush(heap, (-accuracy[0][0], (0,), 1.0))
    paths: list[tuple[int, ...]] = []
    probs: list[float] = []
    while heap and len(paths) < size:
        neg, path, parent = heapq.heappop(heap)
        paths.append(path)
        probs.append(-neg)
        d, j = len(path) - 1, path[-1]
        if j + 1 < len(accuracy[d]):  # its next sibling
            heapq.heappush(heap, (-parent * accuracy[d][j + 1], path[:-1] + (j + 1,), parent))
        if d + 1 < len(accuracy) and accuracy[d + 1]:  # its first child
            heapq.heappush(heap, (neg * accuracy[d + 1][0], path + (0,), -neg))
    return paths, probs


# -- training (`specdec train medusa|hydra`) --------------------------------------------
