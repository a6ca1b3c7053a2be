"""EAGLE-3 heads against training minutes and data mode: learning curves and held-out agreement.

For each trained head directory (`specdec train eagle3 --out DIR`): its learning curve from
`DIR/history.json` (top-1 agreement with the target on the training batches by unrolled draft
step, a moving average, against training minutes; during the first epoch every batch is
unseen data), and its held-out agreement on one common validation set — the last 1/50 of the
sequences of a feature cache, the split `specdec train eagle3` holds out. Pass the
self-distilled cache to compare heads on the target's own text, which is what they draft at
inference. Prints a table, writes JSON and a PNG.

    python benchmarks/eagle3_training.py --heads teacher=DIR1 self=DIR2 \\
        --validation ~/.cache/specdec/e3feat-self --out bench-out/eagle3-training
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import specdec
from specdec import store
from specdec.networks.eagle3 import Eagle3Head
from specdec.networks.vocabulary import attach as attach_target
from specdec.training import features as fe
from specdec.training.loop import evaluate, moving_average


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True, metavar="LABEL=DIR", help="trained head directories")
    ap.add_argument("--validation", type=Path, required=True, help="feature cache whose held-out split to score")
    ap.add_argument("--steps", type=int, default=3, help="unrolled draft steps to score")
    ap.add_argument("--window", type=int, default=40, help="moving average over this many optimizer steps")
    ap.add_argument("--out", type=Path, default=Path("bench-out/eagle3-training"))
    ns = ap.parse_args()

    manifest, examples = fe.load_examples(ns.validation)
    val = examples[-max(1, len(examples) // 50) :]
    rows = []
    targets: dict[str, specdec.LoadedModel] = {}
    for spec in ns.heads:
        label, _, d = spec.partition("=")
        head = Eagle3Head.load(d)
        rec = Eagle3Head.training_record(d)
        name = head.cfg.target
        if name not in targets:
            targets[name] = specdec.load(name)
        attach_target(head, targets[name].model, store.resolve(name))
        history = json.loads((Path(d) / "history.json").read_text())
        acc = evaluate(head, val, ns.steps, 1024)
        rows.append(
            {
                "label": label,
                "dir": d,
                "data_mode": rec.get("data_mode"),
                "feature_tokens": rec.get("feature_tokens"),
                "conversations": rec.get("feature_conversations"),
                "feature_cpu_minutes": round(rec.get("feature_cpu_seconds", 0) / 60, 1),
                "train_minutes": rec.get("wall_minutes"),
                "optimizer_steps": rec.get("optimizer_steps"),
                "heldout_top1_by_step": acc,
                "own_validation_top1_by_step": rec.get("validation_top1_by_step"),
                "command": rec.get("command"),
                "cpu": rec.get("cpu"),
                "history": history,
            }
        )
    print(f"held-out: {len(val)} sequences of {ns.validation} ({manifest.get('data_mode')} data)")
    print(
        f"{'head':10s} {'mode':8s} {'tokens':>8s} {'feat min':>8s} {'train min':>9s} {'steps':>6s}  top-1 by draft step"
    )
    for r in rows:
        print(
            f"{r['label']:10s} {r['data_mode'] or '?':8s} {r['feature_tokens'] or 0:8d} "
            f"{r['feature_cpu_minutes']:8.1f} "
            f"{r['train_minutes'] or 0:9.1f} {r['optimizer_steps'] or 0:6d}  "
            + " / ".join(f"{a:.3f}" for a in r["heldout_top1_by_step"])
        )
    ns.out.mkdir(parents=True, exist_ok=True)
    data = {"validation": str(ns.validation), "validation_sequences": len(val), "runs": rows}
    (ns.out / "eagle3-training.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(rows, ns.window, ns.out / "eagle3-training.png", len(val))
    print(f"wrote {ns.out / 'eagle3-training.json'} and {ns.out / 'eagle3-training.png'}")
    return 0


def plot(rows: list[dict], window: int, path: Path, n_val: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "--", ":"]
    for c, r in enumerate(rows):
        h = r["history"]
        minutes = [e["minutes"] for e in h]
        color = f"C{c}"
        for j in range(min(3, len(h[0]["acc"]) if h else 0)):
            smooth = moving_average([e["acc"][j] for e in h], window)
            ax.plot(minutes, smooth, styles[j], color=color, label=f"{r['label']}: training batches, step {j + 1}")
        if minutes:
            for j, a in enumerate(r["heldout_top1_by_step"][:3]):
                ax.scatter([minutes[-1]], [a], color=color, marker="os^"[j], zorder=3)
    ax.scatter([], [], color="gray", marker="o", label=f"held-out ({n_val} sequences), steps 1/2/3: o s ^")
    ax.set_xlabel("training minutes (2-core CPU)")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_title("EAGLE-3 head for qwen2.5-coder-1.5b: agreement vs training minutes and data mode", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
