#!/usr/bin/env python3
"""Draws the CSV of scripts/instructions.sh as an SVG bar chart: instructions per call of
each qag command beside its floor (the plain commands doing its data work), the
token-bucket script and redis-cell, one bar per server. Python 3 standard library only.
Usage: instructions-chart.py instructions.csv out.svg"""
import importlib.util
import os
import sys
from xml.sax.saxutils import escape

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]
FLOOR_COLOURS = ["#a0bcd8", "#f8c594", "#a8d5a2", "#f0a9aa"]


def load_table_module():
    """instructions-table.py, whose CSV reader this chart shares."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "instructions-table.py")
    spec = importlib.util.spec_from_file_location("instructions_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    src, dst = sys.argv[1], sys.argv[2]
    figures, floors, servers, versions = load_table_module().load(src)

    # Groups: each non-floor row, then its floor drawn lighter right below it.
    groups = []
    for key in figures:
        if floors[key] == "floor":
            continue
        fk = (floors[key], key[1]) if (floors[key], key[1]) in figures else (floors[key], "existing")
        groups.append((key, fk if fk in figures else None))

    bar, gap, left, width = 9, 10, 330, 560
    per_group = len(servers) * bar * 2 + gap
    top = 70
    height = top + per_group * len(groups) + 60
    peak = max(v for k in figures for v in figures[k].values())
    scale = width / (peak * 1.05)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="11">' % (left + width + 90, height),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="10" y="20" font-size="14" font-weight="bold">Instructions per call, '
           'whole server, serverCron excluded (callgrind)</text>',
           '<text x="10" y="38">Each command (dark) above its floor, the plain commands '
           'doing its data work (light); 20,000 calls, 100,000 warm keys.</text>']
    x = 10
    for i, s in enumerate(servers):
        out.append('<rect x="%d" y="48" width="10" height="10" fill="%s"/>' % (x, COLOURS[i % 4]))
        out.append('<text x="%d" y="57">%s (%s)</text>' % (x + 14, escape(s), escape(versions[s])))
        x += 150
    out.append('<rect x="%d" y="48" width="10" height="10" fill="%s"/><text x="%d" y="57">'
               'its floor</text>' % (x, FLOOR_COLOURS[0], x + 14))
    y = top
    for key, fk in groups:
        label = "%s, %s keys" % key
        out.append('<text x="%d" y="%d" text-anchor="end">%s</text>' %
                   (left - 6, y + len(servers) * bar - 2, escape(label)))
        if fk:
            out.append('<text x="%d" y="%d" text-anchor="end" fill="#777">floor: %s</text>' %
                       (left - 6, y + 2 * len(servers) * bar - 2, escape(fk[0])))
        for rows, colours in ((key, COLOURS), (fk, FLOOR_COLOURS)):
            for i, s in enumerate(servers):
                if rows and s in figures[rows]:
                    v = figures[rows][s]
                    out.append('<rect x="%d" y="%d" width="%.1f" height="%d" fill="%s"/>' %
                               (left, y, v * scale, bar - 1, colours[i % 4]))
                    out.append('<text x="%.1f" y="%d" font-size="9">%s</text>' %
                               (left + v * scale + 3, y + bar - 2, "{:,.0f}".format(v)))
                y += bar
        y += gap
    # Axis.
    step = 10 ** (len(str(int(peak))) - 1)
    tick, grid = 0, []
    while tick <= peak * 1.05:
        xx = left + tick * scale
        grid.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>' % (xx, top - 4, xx, y))
        out.append('<text x="%.1f" y="%d" text-anchor="middle" font-size="9">%s</text>' %
                   (xx, y + 12, "{:,}".format(tick)))
        tick += step
    out[2:2] = grid  # under the bars
    out.append("</svg>")
    with open(dst, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
