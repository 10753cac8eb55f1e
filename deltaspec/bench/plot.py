"""A dependency-free SVG line chart for benchmark reports (one x axis, several named series)."""

from __future__ import annotations

from html import escape

WIDTH, HEIGHT, MARGIN = 640, 400, 60
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")


def line_chart(title: str, x_label: str, y_label: str, x: list[float], series: dict[str, list[float | None]]) -> str:
    """SVG text of `series` (name -> y values, None where missing) over `x`."""
    ys = [v for values in series.values() for v in values if v is not None]
    y_max = max(ys, default=1.0) * 1.1 or 1.0
    x_min, x_max = min(x), max(x)

    def px(value: float) -> float:
        return MARGIN + (value - x_min) / ((x_max - x_min) or 1) * (WIDTH - 2 * MARGIN)

    def py(value: float) -> float:
        return HEIGHT - MARGIN - value / y_max * (HEIGHT - 2 * MARGIN)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
        f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
        f'<line x1="{MARGIN}" y1="{HEIGHT - MARGIN}" x2="{WIDTH - MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
        f'<line x1="{MARGIN}" y1="{MARGIN}" x2="{MARGIN}" y2="{HEIGHT - MARGIN}" stroke="black"/>',
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 15}" text-anchor="middle">{escape(x_label)}</text>',
        f'<text x="15" y="{HEIGHT / 2}" text-anchor="middle" transform="rotate(-90 15 {HEIGHT / 2})">'
        f"{escape(y_label)}</text>",
    ]
    for value in x:
        parts.append(f'<text x="{px(value):.1f}" y="{HEIGHT - MARGIN + 16}" text-anchor="middle">{value:g}</text>')
    for i in range(5):
        value = y_max * i / 4
        parts.append(f'<text x="{MARGIN - 6}" y="{py(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
    for k, (name, values) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        points = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(x, values) if b is not None)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(
            f'<text x="{WIDTH - MARGIN}" y="{MARGIN + 16 * k}" text-anchor="end" fill="{color}">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)
