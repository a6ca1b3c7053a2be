"""How a draft model reads a long context (`--draft-window`): the option the draft-model drafter
and auto share."""

from __future__ import annotations

from .base import Option

# The draft may read a long context through a window: the first SINK tokens and the last
# `window` (StreamingLLM's attention sink), at their own positions; exactness does not depend
# on it. It would make the draft's prefill of a long prompt cheaper, but it is off by default:
# the prompts that are long (a document to summarise, retrieved passages) are the ones whose
# answers copy from their middle, which a window hides from the draft (measured in
# docs/results.md).
SINK = 4
DEFAULT_WINDOW = 0
WINDOW_OPTION = Option(
    "window",
    "the draft reads a long prompt through its first 4 and last N tokens "
    "(a cheaper prefill; exact whatever N, only acceptance changes; 0 = all of it)",
    "--draft-window",
)
