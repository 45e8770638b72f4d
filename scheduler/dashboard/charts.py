"""Inline SVG charts, drawn on the server (pure functions: numbers in, markup out).

Why server-side SVG: the page needs no chart library, no JavaScript build and no
second request, scales to any width (``viewBox`` + CSS ``width: 100%``), and is
readable with scripts off. Every text in the SVG is escaped here; values are numbers.
Two shapes are enough for the overview: bars (completions per minute) and lines (lag
percentiles per minute), both over "minutes ago" with now on the right.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape

from markupsafe import Markup

__all__ = ["bar_chart", "line_chart"]

WIDTH, HEIGHT = 600, 160
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 44, 8, 10, 22
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea")


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 10 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.2g}"


def _nice_max(value: float) -> float:
    """A round axis maximum at or above ``value`` (1, 2 or 5 x 10^n)."""
    if value <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(value))
    return next(step * base for step in (1, 2, 5, 10) if step * base >= value)


def _frame(title: str, y_max: float, unit: str, minutes: int) -> list[str]:
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]
    for frac in (0.0, 0.5, 1.0):
        y = PAD_TOP + plot_h * (1 - frac)
        parts.append(
            f'<line x1="{PAD_LEFT}" y1="{y:.1f}" x2="{WIDTH - PAD_RIGHT}" y2="{y:.1f}" '
            'class="grid"/>'
        )
        label = escape(_fmt(y_max * frac) + unit)
        parts.append(
            f'<text x="{PAD_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" class="axis">'
            f"{label}</text>"
        )
    for ago in (minutes, minutes // 2, 0):
        x = _x(ago, minutes)
        text = "now" if ago == 0 else f"-{ago}m"
        parts.append(
            f'<text x="{x:.1f}" y="{HEIGHT - 6}" text-anchor="middle" class="axis">{text}</text>'
        )
    return parts


def _x(minutes_ago: float, minutes: int) -> float:
    plot_w = WIDTH - PAD_LEFT - PAD_RIGHT
    return PAD_LEFT + plot_w * (1 - minutes_ago / max(minutes, 1))


def _y(value: float, y_max: float) -> float:
    plot_h = HEIGHT - PAD_TOP - PAD_BOTTOM
    return PAD_TOP + plot_h * (1 - min(value, y_max) / y_max)


def bar_chart(values: Mapping[int, float], *, minutes: int, title: str, unit: str = "") -> Markup:
    """Bars for ``{minutes_ago: value}`` over the last ``minutes`` minutes."""
    y_max = _nice_max(max(values.values(), default=0.0))
    parts = _frame(title, y_max, unit, minutes)
    bar_w = (WIDTH - PAD_LEFT - PAD_RIGHT) / max(minutes, 1)
    for ago in range(minutes):
        value = values.get(ago, 0)
        if value <= 0:
            continue
        x = _x(ago + 1, minutes)
        y = _y(value, y_max)
        parts.append(
            f'<rect x="{x + 0.5:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 1):.1f}" '
            f'height="{HEIGHT - PAD_BOTTOM - y:.1f}" class="bar">'
            f"<title>-{ago}m: {escape(_fmt(value))}{escape(unit)}</title></rect>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def line_chart(
    series: Mapping[str, Sequence[tuple[int, float]]],
    *,
    minutes: int,
    title: str,
    unit: str = "",
) -> Markup:
    """One polyline per named series of ``(minutes_ago, value)`` points, with a legend."""
    y_max = _nice_max(max((v for pts in series.values() for _, v in pts), default=0.0))
    parts = _frame(title, y_max, unit, minutes)
    for index, (name, points) in enumerate(series.items()):
        color = COLORS[index % len(COLORS)]
        ordered = sorted(points, key=lambda p: -p[0])
        coords = " ".join(
            f"{_x(ago + 0.5, minutes):.1f},{_y(value, y_max):.1f}" for ago, value in ordered
        )
        if len(ordered) == 1:
            x, y = coords.split(",")
            parts.append(f'<circle cx="{x}" cy="{y}" r="2.5" fill="{color}"/>')
        elif ordered:
            parts.append(
                f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>'
            )
        parts.append(
            f'<text x="{PAD_LEFT + 6 + index * 70}" y="{PAD_TOP + 10}" fill="{color}" '
            f'class="legend">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
