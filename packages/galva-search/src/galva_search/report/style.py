"""The report page's look: its style sheet, colours and figure sizes (one look for the search, training and run
pages)."""

from __future__ import annotations

# Colour-blind-friendly palette (Okabe-Ito), one colour per tp/sp degree; degrees beyond it cycle.
TP_COLOURS = ("#56B4E9", "#009E73", "#E69F00", "#CC79A7", "#0072B2", "#D55E00", "#F0E442", "#999999")
OK, NEAR, OVER = "#2E9E5B", "#E69F00", "#D1495B"  # memory within usable, in the reserve, over budget
PREDICTED, MEASURED = "#8FB8DE", "#0072B2"
TIME_PARTS = {  # kind of TimeBreakdown: (label, colour)
    "compute": ("compute", "#0072B2"),
    "tp": ("tp / sp collectives", "#E69F00"),
    "dp": ("dp: gradient sync, ZeRO-3 gathers", "#009E73"),
    "p2p": ("pipeline p2p", "#CC79A7"),
    "redistribution": ("re-sharding between layers", "#F0E442"),
    "bubble": ("pipeline bubble", "#BBBBBB"),
    "optimizer": ("optimizer step", "#56B4E9"),
}
WIDTH = 960  # every plan figure; training charts are 640 wide, two per row

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1040px;
color:#222;background:#fafafa;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.sub{color:#666;font-size:13px;margin-bottom:14px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:8px;padding:8px 12px;min-width:110px}
.card .k{font-size:11px;color:#777;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:18px;font-weight:600}
.card.main{border-color:#0072B2}.card.main .v{color:#0072B2;font-size:22px}
svg{background:#fff;border:1px solid #ddd;border-radius:8px;display:block;max-width:100%;height:auto}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
table{border-collapse:collapse;background:#fff;font-size:14px;margin:8px 0}
td,th{border:1px solid #ddd;padding:4px 12px;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.legend{display:flex;flex-wrap:wrap;gap:14px;align-items:center;font-size:13px;margin:8px 0}
.legend span{display:inline-flex;align-items:center;gap:5px}
.legend svg{border:0;background:none}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 16px;margin:0 0 16px}
dl.facts dt{color:#666}dl.facts dd{margin:0;font-variant-numeric:tabular-nums}
.grid-charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:16px}
figure.chart{margin:0;border:1px solid #ddd;border-radius:8px;padding:8px;background:#fff}
figure.chart svg{border:0;width:100%}
figcaption{font-weight:600;margin:0 0 4px}figcaption small{font-weight:400;color:#666}
.plot{fill:#fafafa}.grid{stroke:#e4e4e4;stroke-width:1}.axis{stroke:#555;stroke-width:1}
.tick{font-size:11px;fill:#444}.label{font-size:12px;fill:#222}
.line{fill:none;stroke-width:1.5}.line.raw{stroke-opacity:.35}.line.smooth{stroke-width:2.2}
.pt{stroke:#fff;stroke-width:.5}.pt.hidden{fill-opacity:0;stroke:none}.pt:hover{fill-opacity:1;r:5}
p.empty,p.note{color:#666}
"""


def tp_colour(degree: int) -> str:
    """Fill colour of a layer cell for a tp (or Ulysses) degree: 1, 2, 4, 8, ... take successive palette entries."""
    if degree < 1 or degree & (degree - 1):
        return TP_COLOURS[-1]
    return TP_COLOURS[min(degree.bit_length() - 1, len(TP_COLOURS) - 1)]
