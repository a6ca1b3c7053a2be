"""Benchmarks (never timed tests): speed belongs here, measured side by side in one run."""

from __future__ import annotations

import base64
import re
from html import escape
from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out a matplotlib figure, write it as a PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


STYLE = """body{font:15px/1.5 system-ui,sans-serif;color:#1b1b1f;max-width:72rem;margin:1rem auto;padding:0 1rem}
table{border-collapse:collapse;margin:.75rem 0;font-size:.9rem}th,td{border-bottom:1px solid #d9d9e0;
padding:.2rem .6rem;text-align:right}th:first-child,td:first-child{text-align:left}img{max-width:100%}
code{background:#f4f4f7;padding:0 .2rem;border-radius:.2rem}pre{overflow-x:auto;background:#f4f4f7;padding:.6rem}
pre code{padding:0}"""


def html(text: str, out_dir: Path) -> str:
    """Markdown (a report) as one self-contained page: its tables as tables, its plots inside it
    (data URIs), nothing fetched from elsewhere: a file to open or to send."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(text)

    def inline(m: re.Match[str]) -> str:
        png = out_dir / m.group(1)
        return (
            f'src="data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}"' if png.exists() else m.group(0)
        )

    body = re.sub(r'src="([^"/]+\.png)"', inline, body)
    title = text.splitlines()[0].lstrip("# ") if text else "specdec benchmark"
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
        f"<body>\n{body}</body></html>\n"
    )


def write_page(out_dir: Path, name: str, title: str, table: str, png: Path) -> Path:
    """`out_dir/name`: a benchmark's printed table and its plot as one self-contained page, for the
    benchmarks whose output is a table and a PNG (`bench serve`, `bench batch`, `bench trace`)."""
    text = f"# {title}\n\n```\n{table}\n```\n\n![{png.stem}]({png.name})\n"
    path = out_dir / name
    path.write_text(html(text, out_dir))
    return path
