"""The EAGLE-3 draft head: one decoder layer that reads the target's own features.

EAGLE-3 (Li et al., 2025, "Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") drafts with a single transformer layer whose input at position i is

* the embedding of token x_{i+1} (the target's own embedding table, frozen), and
* g_i: at the first draft step, fc(concat(f_low_i, f_mid_i, f_high_i)), the target's residual
  stream after a low, a middle and a high layer; at later steps, the head's own output at the
  previous step (the "training-time test" trains it to read its own outputs).

The layer normalises both halves separately (`input_layernorm` for the embedding, `hidden_norm`
for g), concatenates them (2H) as the input of q/k/v, adds attention to g (the residual), then
an MLP; `norm` and a *draft vocabulary* LM head (the N most frequent target tokens; `d2t`
maps draft id j to target id j + d2t[j], `t2d` marks target ids in the draft vocabulary)
give the next token's draft distribution. Field and weight names follow the EAGLE-3
checkpoints vLLM and SGLang load (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`), so
export is a renaming-free copy (see `specdec.training.export`).

Our head may *tie* its LM head to the target's own output rows for the draft vocabulary
(`tie_lm_head`): it then stores no LM head (the shipped head stays small) and reads
the target's rows through d2t at load time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .vocabulary import DraftVocabulary

CONFIG_NAME = "specdec_eagle3.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    """Shape and provenance of a head (written beside its weights)."""

    target: str  # the target model's registered name or directory it was trained for
    target_vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, int, int]  # target layers whose output residuals feed fc (0-based)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_lm_head: bool = True  # LM head = the target's output rows of the draft vocabulary (not stored)

    def __post_init__(self) -> None:
        if len(self.feature_layers) != 3:
            raise ValueError("an EAGLE-3 head reads exactly three target layers (low, middle, high)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError("the draft vocabulary must be a non-empty subset of the target's")

    @staticmethod
    def default_feature_layers(n_layers: int) -> tuple[int, int, int]:
        """EAGLE-3's choice: the outputs of layers 1, n/2 - 1 and n - 4 (0-based; the
        reference indexes hidden_states (2, n//2, n-3) with the embeddings at index 0)."""
        if n_layers < 4:
            return (0, max(0, n_layers // 2 - 1), n_layers - 1)
        return (1, n_layers // 2 - 1, n_layers - 4)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HeadConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["feature_layers"] = tuple(kw["feature_layers"])
        return cls(**kw)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # in float32 whatever autocast made of x (bf16 training), back in x's dtype
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., T, 1, D] for rotate-half RoPE at the given positions [..., T]."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = positions.float()[..., None] * inv  # [..., T, D/2]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat((cos, cos), -1).unsqueeze(-2), torch.cat((-sin, sin), -1).unsqueeze(-2)


def _rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = tables
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), -1) * sin


# Applies the head's named linear layers ("fc", "q", "k", "v", "o", "gate", "up", "down", "lm")
# to one input: the head's own float weights by default, specdec's q4k kernels when drafting.
Linears = Callable[[tuple[str, ...], torch.Tensor], list[torch.Tensor]]


class Eagle3Head(DraftVocabulary, nn.Module):
    """The head's parameters and its three stages: `project` (target features -> g),
    `qkv` (token embedding + g -> rotated queries, keys, values), `finish` (attention output
    -> next g and draft logits). Training (`loop.py`) and drafting (`drafters/eagle3.py`)
    arrange the attention between them; both call these same stages (drafting passes its
    quantized kernels as `linears`)."""

    kind = "eagle3"

    @property
    def needs_output_rows(self) -> bool:
        return self.cfg.tie_lm_head

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, D, FF = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm = _Norm(H)
        m.hidden_norm = _Norm(H)
        m.post_attention_layernorm = _Norm(H)
        m.self_attn = nn.Module()
        m.self_attn.q_proj = nn.Linear(2 * H, nh * D, bias=False)
        m.self_attn.k_proj = nn.Linear(2 * H, nkv * D, bias=False)
        m.self_attn.v_proj = nn.Linear(2 * H, nkv * D, bias=False)
        m.self_attn.o_proj = nn.Linear(nh * D, H, bias=False)
        m.mlp = nn.Module()
        m.mlp.gate_proj = nn.Linear(H, FF, bias=False)
        m.mlp.up_proj = nn.Linear(H, FF, bias=False)
        m.mlp.down_proj = nn.Linear(FF, H, bias=False)
        self.norm = _Norm(H)
        # draft LM head [N, H]; a buffer when tied (filled from the target, never trained or saved)
        if cfg.tie_lm_head:
            self.register_buffer("lm_head_weight", torch.zeros(cfg.draft_vocab_size, H), persistent=False)
        else:
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))
        # frozen target embedding table [V, H], set by `attach`
        self.register_buffer("embed_weight", torch.zeros(0, H), persistent=False)

    # -- set-up ---------------------------------------------------------------------------
    def attach(self, embed: torch.Tensor, output_rows: torch.Tensor | None) -> None:
        """Use the target's embedding table [V, H] (and, for a tied head, its output rows
        [V, H], the LM head weight) — frozen, shared, never saved."""
        self.embed_weight = embed.detach().float()
        if self.cfg.tie_lm_head:
            if output_rows is None:
                raise ValueError("a tied head needs the target's LM head rows")
            self.lm_head_weight = output_rows.detach().float()[self.draft_ids].contiguous()

    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded initialisation (Llama-style normal(0, 0.02), norms at 1)."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)

    # -- stages ---------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight)

    def weights(self) -> dict[str, torch.Tensor]:
        """The linear layers' weights by the names `Linears` uses."""
        m = self.midlayer
        return {
            "fc": self.fc.weight,
            "q": m.self_attn.q_proj.weight,
            "k": m.self_attn.k_proj.weight,
            "v": m.self_attn.v_proj.weight,
            "o": m.self_attn.o_proj.weight,
            "gate": m.mlp.gate_proj.weight,
            "up": m.mlp.up_proj.weight,
            "down": m.mlp.down_proj.weight,
            "lm": self.lm_head_weight if self.cfg.tie_lm_head else self.lm_head.weight,
        }

    def linears(self, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """The default `Linears`: the head's own weights."""
        w = self.weights()
        return [F.linear(x, w[n]) for n in names]

    def project(self, features: torch.Tensor, linears: Linears | None = None) -> torch.Tensor:
        """[..., 3H] target features -> g [..., H]."""
        return (linears or self.linears)(("fc",), features)[0]

    def qkv(
        self, emb: torch.Tensor, g: torch.Tensor, positions: torch.Tensor, linears: Linears | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """emb, g [..., T, H], positions [..., T] -> q [..., T, nh, D], k, v [..., T, nkv, D] (rotated)."""
        c, m = self.cfg, self.midlayer
        x = torch.cat(
            (_rms(emb, m.input_layernorm.weight, c.rms_norm_eps), _rms(g, m.hidden_norm.weight, c.rms_norm_eps)), -1
        )
        q, k, v = (linears or self.linears)(("q", "k", "v"), x)
        lead = x.shape[:-1]
        q = q.view(*lead, c.num_attention_heads, c.head_dim)
        k = k.view(*lead, c.num_key_value_heads, c.head_dim)
        v = v.view(*lead, c.num_key_value_heads, c.head_dim)
        tables = rope_tables(positions, c.head_dim, c.rope_theta)
        return _rotate(q, tables), _rotate(k, tables), v

    def finish(
        self, g: torch.Tensor, attn: torch.Tensor, *, logits: bool = True, linears: Linears | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """g [..., T, H] (the residual), attn [..., T, nh, D] -> (next g [..., T, H], draft
        logits [..., T, N], or None without `logits`)."""
        c, m = self.cfg, self.midlayer
        lin = linears or self.linears
        h = g + lin(("o",), attn.flatten(-2))[0]
        gate, up = lin(("gate", "up"), _rms(h, m.post_attention_layernorm.weight, c.rms_norm_eps))
        h = h + lin(("down",), F.silu(gate) * up)[0]
        return h, (self.logits(h, lin) if logits else None)

    def logits(self, h: torch.Tensor, linears: Linears | None = None) -> torch.Tensor:
        return (linears or self.linears)(("lm",), _rms(h, self.norm.weight, self.cfg.rms_norm_eps))[0]

    # -- files ----------------------------------------------------------------------------
    def save(self, directory: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """config + weights (float16; d2t/t2d as the EAGLE-3 format has them); `extra` is
        recorded beside them (training command, data, seed, CPU time)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt", "specdec": "eagle3"})
        (out / CONFIG_NAME).write_text(json.dumps({**self.cfg.to_json(), "training": extra or {}}, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> Eagle3Head:
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / CONFIG_NAME).exists() and (d / "config.json").exists():
            return load_eagle3(d)  # a checkpoint in the vLLM/SGLang layout
        if not (d / CONFIG_NAME).exists() or not (d / WEIGHTS_NAME).exists():
            raise FileNotFoundError(f"{d} is not an EAGLE-3 head directory ({CONFIG_NAME} and {WEIGHTS_NAME} expected)")
        cfg = HeadConfig.from_json(json.loads((d / CONFIG_NAME).read_text()))
        head = cls(cfg)
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(d / WEIGHTS_NAME)).items()}
        missing, unexpected = head.load_state_dict(state, strict=False)
        if unexpected or any(m not in ("lm_head_weight", "embed_weight") for m in missing):
            raise ValueError(f"{d}: weights do not match the config (missing {missing}, unexpected {unexpected})")
        return head

    @staticmethod
    def training_record(directory: str | Path) -> dict[str, Any]:
        return json.loads((Path(directory) / CONFIG_NAME).read_text()).get("training", {})


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def config_for_target(
    target: Any, name: str, *, draft_vocab_size: int, intermediate_size: int | None = None
) -> HeadConfig:
    """A head shaped for a target Transformer: its hidden size, heads and RoPE; the MLP width
    defaults to the target's."""
    a = target.args
    return HeadConfig(
        target=name,
        target_vocab_size=a.vocab_size,
        hidden_size=a.dim,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        intermediate_size=intermediate_size or a.intermediate_size,
        draft_vocab_size=min(draft_vocab_size, a.vocab_size),
        feature_layers=HeadConfig.default_feature_layers(a.n_layers),
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_seq_len,
    )


# -- the engines' layout (`training.export`) ----------------------------------------------
ARCHITECTURE = "LlamaForCausalLMEagle3"


def load_eagle3(directory: str | Path) -> Eagle3Head:
    """A head from an engine checkpoint (ours or another trainer's in this layout)."""
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = json.loads((d / "config.json").read_text())
    if ARCHITECTURE not in cfg.get("architectures", []) and "Eagle3LlamaForCausalLM" not in cfg.get(
        "architectures", []
    ):
        raise ValueError(f"{d}/config.json is not an EAGLE-3 head (architectures {cfg.get('architectures')})")
    layer_ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    feature_layers = tuple((cfg.get("specdec") or {}).get("feature_layers") or [i - 1 for i in layer_ids])
    hc = HeadConfig(
        target=(cfg.get("specdec") or {}).get("target", str(d)),
        target_vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
        feature_layers=feature_layers,
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", 10000.0),
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_lm_head=False,
    )
    head = Eagle3Head(hc)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(d / "model.safetensors")).items()}
    state.pop("embed_tokens.weight", None)
    if "t2d" not in state:
        t2d = torch.zeros(hc.target_vocab_size, dtype=torch.bool)
        t2d[state["d2t"] + torch.arange(state["d2t"].numel())] = True
        state["t2d"] = t2d
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or any(m != "embed_weight" for m in missing):
        raise ValueError(f"{d}: weights do not match an EAGLE-3 head (missing {missing}, unexpected {unexpected})")
    return head
