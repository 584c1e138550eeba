"""The layer map: one row per pipeline stage, one cell per layer (colour = tp/sp degree, stripes = Ulysses,
dot = ZeRO-2/ZeRO-3, bar = activation checkpointing), with its legend."""

from __future__ import annotations

from html import escape

from galva_schema import DataParallelType, Strategy
from galva_search.report.plan import PlanFacts
from galva_search.report.style import WIDTH, tp_colour
from galva_search.report.svg import legend_swatch


def layer_map(plan: PlanFacts) -> str:
    s = plan.strategy
    width, left, row_h, gap, top = WIDTH, 70, 40, 8, 10
    per_row = max(len(s.stage_layers(stage)) for stage in range(s.pp))
    cell_w = (width - left - 20) / per_row
    height = top + s.pp * (row_h + gap) + 10
    parts = [f'<svg id="layer-map" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="layer map">'
             '<defs><pattern id="ulysses" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#fff" fill-opacity="0.7"/>'
             '</pattern></defs>']
    for stage in range(s.pp):
        y = top + stage * (row_h + gap)
        runs = ", ".join(f"{r.start}–{r.stop - 1}" for r in (s.chunk_layers(c) for c in s.stage_chunks(stage)))
        parts.append(f'<text x="{left - 8}" y="{y + row_h / 2 - 2:.1f}" font-size="12" text-anchor="end">'
                     f'stage {stage}</text><text x="{left - 8}" y="{y + row_h / 2 + 12:.1f}" font-size="10" '
                     f'text-anchor="end" fill="#777">{runs}</text>')
        for k, index in enumerate(s.stage_layers(stage)):
            parts.append(_layer_cell(s, index, left + k * cell_w, y, cell_w, row_h))
    parts.append("</svg>")
    return "".join(parts) + _layer_legend(s)


def _layer_cell(s: Strategy, index: int, x: float, y: float, w: float, h: float) -> str:
    layer = s.layers[index]
    dp_type = s.layer_dp_type(index)
    label = s.layer_summary(index)
    parts = [
        f'<g class="layer-cell" data-layer="{index}" data-label="{escape(label)}" data-tp="{layer.tp}" '
        f'data-ulysses="{int(layer.ulysses)}" data-dp-type="{dp_type.value}" data-checkpoint="{int(layer.checkpoint)}">'
        f'<title>layer {index}: {escape(label)}</title>'
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{tp_colour(layer.tp)}" '
        f'stroke="#fff" stroke-width="1"/>'
    ]
    if layer.ulysses:
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="url(#ulysses)"/>')
    r = min(w * 0.4, h * 0.16)  # narrow cells (many layers per stage) still show a visible marker
    if dp_type is DataParallelType.ZERO3:
        parts.append(f'<circle cx="{x + w / 2:.1f}" cy="{y + h * 0.32:.1f}" r="{r:.1f}" fill="#222"/>')
    elif dp_type is DataParallelType.ZERO2:
        parts.append(f'<circle cx="{x + w / 2:.1f}" cy="{y + h * 0.32:.1f}" r="{r:.1f}" fill="#fff" stroke="#222" '
                     f'stroke-width="1.5"/>')
    if layer.checkpoint:
        parts.append(f'<rect x="{x + 2:.1f}" y="{y + h - 7:.1f}" width="{max(w - 4, 1):.1f}" height="4" '
                     f'fill="#222"/>')
    if w >= 22:
        parts.append(f'<text x="{x + w / 2:.1f}" y="{y + h * 0.72:.1f}" font-size="10" text-anchor="middle" '
                     f'fill="#222">{index}</text>')
    parts.append("</g>")
    return "".join(parts)


def _layer_legend(s: Strategy) -> str:
    degrees = sorted({layer.tp for layer in s.layers})
    items = [legend_swatch(f'<rect width="22" height="18" fill="{tp_colour(d)}"/>', f"tp/sp {d}", f"tp-{d}")
             for d in degrees]
    stripes = ('<defs><pattern id="ulysses-legend" width="6" height="6" patternUnits="userSpaceOnUse" '
               'patternTransform="rotate(45)"><rect width="2.5" height="6" fill="#fff" fill-opacity="0.7"/>'
               '</pattern></defs><rect width="22" height="18" fill="#999"/>'
               '<rect width="22" height="18" fill="url(#ulysses-legend)"/>')
    items += [
        legend_swatch(stripes, "Ulysses sp (stripes)", "ulysses"),
        legend_swatch('<rect width="22" height="18" fill="#ddd"/><circle cx="11" cy="9" r="4" fill="#fff" '
                       'stroke="#222" stroke-width="1.5"/>', "ZeRO-2", "zero2"),
        legend_swatch('<rect width="22" height="18" fill="#ddd"/><circle cx="11" cy="9" r="4" fill="#222"/>',
                       "ZeRO-3 (FSDP)", "zero3"),
        legend_swatch('<rect width="22" height="18" fill="#ddd"/><rect x="2" y="12" width="18" height="4" '
                       'fill="#222"/>', "activation checkpointing", "checkpoint"),
    ]
    note = "no marker: DDP; hover a cell for its compact plan"
    return f'<div class="legend" id="layer-legend">{"".join(items)}<span>{escape(note)}</span></div>'
