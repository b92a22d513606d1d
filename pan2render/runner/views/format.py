"""How the views write times and tables for a terminal."""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def duration(seconds: float) -> str:
    """Seconds as people read them: 42s, 3m05s, 2h10m. Never negative: a span between stamps of
    two clocks (a clock stepped back, another host's) shows as 0s."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` safe to show: control and bidi characters as escapes (\\x1b, \\u202e), so a name
    cannot move the cursor, recolour a terminal or reorder what follows it; ``lines``: line feeds
    and tabs kept (a traceback)."""
    return "".join(c if (c.isprintable() and not _bidi(c)) or (lines and c in "\n\t") else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in text)


def _bidi(c: str) -> bool:
    return c in "\u061c\u200e\u200f" or "\u202a" <= c <= "\u202e" or "\u2066" <= c <= "\u2069"
