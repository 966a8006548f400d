"""Output that stays whole when it is piped into a file or a CI log."""

from __future__ import annotations

from rich.console import Console

# Wider than any line aotc prints: a table takes its natural width, and a path or a
# command is never cut to fit.
_PIPED_WIDTH = 1 << 15


def print_whole_when_piped(*consoles: Console) -> None:
    """On a terminal, rich wraps to its width; anywhere else (a file, a pipe, a CI log)
    nothing is wrapped or truncated: text is soft-wrapped (one line stays one line) and
    tables are as wide as their cells. Call it when a command starts: the stream a
    console writes to is decided then (sys.stdout may be replaced, as tests do)."""
    for console in consoles:
        if not console.is_terminal:
            console.soft_wrap = True
            console.width = _PIPED_WIDTH
