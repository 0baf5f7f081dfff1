"""The profile report: one self-contained HTML file (no network: CSS, script and data inline).

    html = render_report(inspector, title="model.pte", sections=[("Execute", "forward")])
    write_report("report.html", html)

Per section (a block of the trace: "Execute", or "Prefill" and "Decode" for an LLM) it shows
a bar chart of the time per operator, a timeline of the last run and the per-operator
table. The charts are drawn by the page's own script from the JSON embedded in it, as SVG,
so a browser is all it takes to look at one; the table is plain HTML, readable without script.
"""
from __future__ import annotations

import html
import json
import os
from typing import Optional, Sequence, Union

from ..fileio import atomic_write
from .inspector import Inspector, OperatorRow

MAX_BARS = 25  # operators in the bar chart; the table lists all of them

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ccc; }
.facts { color: #555; } svg { display: block; margin: .5em 0 1em; }
.bar { fill: #3b7dd8; } .bar.delegated { fill: #e08a1e; } .label { font-size: 12px; fill: #222; }
table { border-collapse: collapse; font-size: 12px; width: 100%; }
th, td { padding: 2px 8px; text-align: right; border-bottom: 1px solid #eee; }
th:first-child, td:first-child, td.text { text-align: left; }
"""

# Draws every chart the page holds; each SVG element names its data in data-chart.
_SCRIPT = """
(function () {
  var NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    parent.appendChild(e);
    return e;
  }
  function text(parent, x, y, s, anchor) {
    var t = el("text", {x: x, y: y, "class": "label", "text-anchor": anchor || "start"}, parent);
    t.textContent = s;
  }
  function bars(svg, rows) {  // one horizontal bar per operator, its total ms per run
    var width = 1000, left = 260, h = 18, max = Math.max.apply(null, rows.map(function (r) { return r.ms; }));
    svg.setAttribute("width", width); svg.setAttribute("height", rows.length * h + 10);
    rows.forEach(function (r, i) {
      var w = max > 0 ? Math.max(1, (width - left - 180) * r.ms / max) : 1;
      el("rect", {x: left, y: i * h + 2, width: w, height: h - 4, "class": "bar"}, svg);
      text(svg, left - 6, i * h + 14, r.op, "end");
      text(svg, left + w + 6, i * h + 14, r.ms.toFixed(3) + " ms (" + (100 * r.share).toFixed(1) + "%)");
    });
  }
  var PALETTE = ["#3b7dd8", "#2a9d8f", "#8e5ad8", "#d8a03b", "#d8573b", "#5a8e3b", "#3bb4d8", "#b43b8e"];
  function timeline(svg, events) {  // one run: each operator at its start, as wide as it took, coloured by op
    var width = 1000, h = 40, end = Math.max.apply(null, events.map(function (e) { return e.start + e.ms; }));
    var colour = {}, used = 0;
    svg.setAttribute("width", width); svg.setAttribute("height", h + 20);
    events.forEach(function (e) {
      var x = end > 0 ? width * e.start / end : 0, w = end > 0 ? Math.max(1, width * e.ms / end) : 1;
      var r = el("rect", {x: x, y: e.delegated ? h / 2 : 0, width: w, height: e.delegated ? h / 2 : h,
                          "class": e.delegated ? "bar delegated" : "bar"}, svg);
      if (!(e.op in colour)) colour[e.op] = PALETTE[used++ % PALETTE.length];
      if (!e.delegated) r.style.fill = colour[e.op];
      el("title", {}, r).textContent = e.op + ": " + e.ms.toFixed(4) + " ms at " + e.start.toFixed(4) + " ms";
    });
    text(svg, 0, h + 15, "0 ms"); text(svg, width, h + 15, end.toFixed(3) + " ms", "end");
  }
  var draw = {bars: bars, timeline: timeline};
  document.querySelectorAll("svg[data-chart]").forEach(function (svg) {
    var spec = JSON.parse(document.getElementById(svg.getAttribute("data-chart")).textContent);
    draw[spec.kind](svg, spec.data);
    // what the browser laid out, so a test can read it back from the rendered page
    svg.querySelectorAll("rect").forEach(function (r) {
      r.setAttribute("data-drawn-width", r.getBoundingClientRect().width.toFixed(2));
    });
  });
})();
"""


def _json_script(element_id: str, kind: str, data) -> str:
    text = json.dumps({"kind": kind, "data": data}).replace("</", "<\\/")  # no early </script>
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def _bar_data(rows: list[OperatorRow]) -> list[dict]:
    """Time per operator (all its places in the source together), the largest MAX_BARS."""
    per_op: dict[str, list[float]] = {}
    for r in rows:
        ms_share = per_op.setdefault(r.op, [0.0, 0.0])
        ms_share[0] += r.total_ms
        ms_share[1] += r.share
    top = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:MAX_BARS]
    return [{"op": op, "ms": ms, "share": share} for op, (ms, share) in top]


def _table(rows: list[OperatorRow]) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("operator", "calls/run", "mean ms", "p50 ms", "p90 ms",
                                             "total ms/run", "share", "module", "source"))
    body = "".join(
        f"<tr><td>{html.escape(r.op)}</td><td>{r.count:g}</td><td>{r.mean_ms:.4f}</td><td>{r.p50_ms:.4f}</td>"
        f"<td>{r.p90_ms:.4f}</td><td>{r.total_ms:.4f}</td><td>{100 * r.share:.1f}%</td>"
        f'<td class="text">{html.escape(r.module_path or "")}</td>'
        f'<td class="text" title="{html.escape(r.source or "")}">{html.escape(r.source_short)}</td></tr>'
        for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _section(inspector: Inspector, block: str, heading: str, k: int) -> str:
    rows = inspector.operator_table(block)
    runs = inspector.execute_block(block).runs
    timeline = [{"op": e.name, "start": e.start_ms, "ms": e.duration_ms, "delegated": e.delegated}
                for e in inspector.timeline(block_name=block)]
    return "\n".join([
        f"<h2>{html.escape(heading)}</h2>",
        f'<p class="facts">{runs} run(s), {inspector.execute_ms(block):.3f} ms per run; '
        f"{len(rows)} operator rows</p>",
        "<h3>Time per operator (per run)</h3>",
        _json_script(f"bars{k}", "bars", _bar_data(rows)),
        f'<svg class="chart" id="chart-bars{k}" data-chart="bars{k}"></svg>',
        "<h3>Timeline of the last run</h3>",
        _json_script(f"timeline{k}", "timeline", timeline),
        f'<svg class="chart" id="chart-timeline{k}" data-chart="timeline{k}"></svg>',
        "<h3>Operators</h3>",
        _table(rows),
    ])


def render_report(inspector: Inspector, title: str, sections: Sequence[tuple[str, str]] = (("Execute", "forward"),),
                  facts: Optional[list[str]] = None) -> str:
    """The report's HTML. `sections` are (block name, heading) pairs; `facts` lines go under the title."""
    parts = [_section(inspector, block, heading, k) for k, (block, heading) in enumerate(sections)]
    lines = "".join(f"<div>{html.escape(f)}</div>" for f in facts or [])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head>\n<body><h1>Profile of {html.escape(title)}</h1>"
            f'<div class="facts">{lines}</div>\n' + "\n".join(parts) + f"\n<script>{_SCRIPT}</script></body></html>\n")


def write_report(path: Union[str, os.PathLike], html_text: str) -> None:
    atomic_write(path, html_text)
