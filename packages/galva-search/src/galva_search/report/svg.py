"""Small pieces of the page's HTML and SVG: round axis ticks, compact numbers, cards and colour swatches."""

from __future__ import annotations

import math
from html import escape


def nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5 or 5 times a power of ten that is >= ``raw`` (grid spacing with round labels)."""
    if raw <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k) covering ``[lo, hi]``."""
    if hi <= lo:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step((hi - lo) / max(1, count))
    ticks, t = [], math.floor(lo / step) * step
    while t <= hi + step * 1e-9:
        ticks.append(round(t / step) * step)
        t += step
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def fmt(v: float) -> str:
    """Compact number for ticks and hover titles."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.3g}"
    if a >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def card(key: str, value: str, main: bool = False) -> str:
    cls = "card main" if main else "card"
    return f'<div class="{cls}"><div class="k">{escape(key)}</div><div class="v">{escape(value)}</div></div>'


def swatch(colour: str) -> str:
    return f'<svg width="14" height="14"><rect width="14" height="14" fill="{colour}"/></svg>'


def legend_swatch(body: str, text: str, kind: str) -> str:
    return (f'<span class="legend-item" data-kind="{kind}"><svg width="22" height="18" viewBox="0 0 22 18">{body}'
            f'</svg>{escape(text)}</span>')
