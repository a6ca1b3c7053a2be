"""`specdec bench --tune`: store the cost model's best k where `generate` finds it.

One JSON file in the specdec cache (`tuned.json`), keyed by target, method, draft and
precision mode. `generate` (API and CLI) uses the stored k when the caller gives none, and
says so (`k_source`: "tuned" or "default"; an explicit k is "given").
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from . import store


def tuned_path() -> Path:
    return store.cache_root() / "tuned.json"


def key(target: str, method: str, draft: str | None, mode: str) -> str:
    return f"{target}|{method}|{draft if method == 'draft-model' else '-'}|{mode}"


_READ: dict[tuple[str, int], dict[str, Any]] = {}  # (path, mtime) -> its table: a server's every request asks


def _read() -> dict[str, Any]:
    path = tuned_path()
    try:
        at = (str(path), path.stat().st_mtime_ns)
        if at not in _READ:
            _READ.clear()
            _READ[at] = json.loads(path.read_text())
        return dict(_READ[at])
    except (OSError, json.JSONDecodeError):
        return {}


def save(result: Any) -> dict[str, Any]:
    """Best k per method from a bench result (greedy if it ran, else its first temperature;
    category "all"), with the per-category choices. Returns what was written."""
    s = result.settings
    temp = 0.0 if 0.0 in s.temperatures else s.temperatures[0]
    recs = [r for r in result.recommendations() if r.temperature == temp]
    table = _read()
    written = {}
    for r in recs:
        if r.category != "all":
            continue
        entry = {
            "k": r.best_k,
            "predicted_speedup": round(r.best_predicted, 3),
            "temperature": temp,
            "by_category": {c.category: c.best_k for c in recs if c.method == r.method and c.category != "all"},
            "measured_k": r.measured_k,
            "measured_speedup": r.measured_speedup,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        written[key(s.target, r.method, s.draft, result.mode)] = entry
    table.update(written)
    store.write_json(tuned_path(), table)
    return written


def lookup(target: str, method: str, draft: str | None, mode: str) -> int | None:
    entry = _read().get(key(target, method, draft, mode))
    k = entry.get("k") if isinstance(entry, dict) else None
    return k if isinstance(k, int) and k >= 1 else None
