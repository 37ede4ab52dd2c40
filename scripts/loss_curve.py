#!/usr/bin/env python3
"""Loss curve of a llama_pipeline run as SVG: the training loss per step, and the held-out loss where evaluated.

  build/examples/llama_pipeline --steps 150 --eval-every 25 --json run.json
  scripts/loss_curve.py run.json loss.svg [--title TEXT]

Reads the example's --json output ("steps": [{"step", "loss", "eval_loss"?, "skipped"?}, ...]); steps whose update
was skipped (non-finite) are marked. Standard library only.
"""
import argparse
import json
import math
import sys


def fail(message):
    sys.exit(f"loss_curve.py: error: {message}")


def nice_step(span, ticks=6):
    raw = span / ticks if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * power >= raw:
            return m * power


def escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def svg_of(steps, title):
    width, height, left, right, top, bottom = 760, 420, 70, 20, 50, 50
    xs = [s["step"] + 1 for s in steps]  # the example's steps are 0-based, its progress lines 1-based
    train = [s["loss"] for s in steps]
    evals = [(s["step"] + 1, s["eval_loss"]) for s in steps if s.get("eval_loss") is not None]
    finite = [v for v in train + [v for _, v in evals] if math.isfinite(v)]
    if not finite:
        fail("no finite loss in the run")
    lo, hi = min(finite), max(finite)
    ystep = nice_step(hi - lo or 1.0)
    y0, y1 = math.floor(lo / ystep) * ystep, math.ceil(hi / ystep) * ystep
    if y1 == y0:
        y1 = y0 + ystep
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    pw, ph = width - left - right, height - top - bottom

    def px(x):
        return left + pw * (x - x0) / (x1 - x0)

    def py(y):
        return top + ph * (1 - (y - y0) / (y1 - y0))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="24" font-size="15">{escape(title)}</text>']
    y = y0
    while y <= y1 + ystep / 2:
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{width - right}" y2="{py(y):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
        y += ystep
    xstep = max(1, int(nice_step(x1 - x0)))
    x = (x0 // xstep) * xstep or xstep
    while x <= x1:
        if x >= x0:
            out.append(f'<line x1="{px(x):.1f}" y1="{top + ph}" x2="{px(x):.1f}" y2="{top + ph + 5}" stroke="#555"/>'
                       f'<text x="{px(x):.1f}" y="{top + ph + 18}" text-anchor="middle">{x}</text>')
        x += xstep
    out.append(f'<line x1="{left}" y1="{top + ph}" x2="{width - right}" y2="{top + ph}" stroke="#555"/>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{height - 12}" text-anchor="middle">step</text>')
    out.append(f'<text transform="translate(16,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle">loss</text>')
    points = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, train) if math.isfinite(v))
    out.append(f'<polyline id="train" points="{points}" fill="none" stroke="#2e86de" stroke-width="1.5"/>')
    for s in steps:
        if s.get("skipped"):
            out.append(f'<line x1="{px(s["step"] + 1):.1f}" y1="{top}" x2="{px(s["step"] + 1):.1f}" '
                       f'y2="{top + ph}" stroke="#e15759" stroke-dasharray="3,3"><title>step {s["step"] + 1}: '
                       f'update skipped (non-finite)</title></line>')
    for x, v in evals:
        out.append(f'<circle class="eval" cx="{px(x):.1f}" cy="{py(v):.1f}" r="4" fill="#e67e22">'
                   f'<title>step {x}: held-out loss {v:.4f}</title></circle>')
    legend = [("#2e86de", "training loss")] + ([("#e67e22", "held-out loss")] if evals else [])
    lx = width - right - 130 * len(legend)
    for colour, name in legend:
        out.append(f'<rect x="{lx}" y="34" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{lx + 16}" y="45">{name}</text>')
        lx += 130
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="llama_pipeline --json output")
    parser.add_argument("svg", help="the picture to write")
    parser.add_argument("--title", help="default: model, schedule and mode from the JSON")
    a = parser.parse_args()
    try:
        with open(a.json) as f:
            run = json.load(f)
    except OSError as e:
        fail(f"cannot read {a.json}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"{a.json} is not JSON: {e}")
    steps = run.get("steps") if isinstance(run, dict) else None
    if not steps or not all(isinstance(s, dict) and "step" in s and "loss" in s for s in steps):
        fail(f"{a.json} has no \"steps\" with step and loss (is it llama_pipeline --json output of a training run?)")
    title = a.title or "{} {} {}: loss over {} steps".format(
        run.get("model", "?"), run.get("schedule", ""), "2BP" if run.get("2bp", True) else "standard",
        len(steps))
    try:
        with open(a.svg, "w") as f:
            f.write(svg_of(steps, title))
    except OSError as e:
        fail(f"cannot write {a.svg}: {e.strerror}")
    print(f"{a.svg}: {len(steps)} steps")


if __name__ == "__main__":
    main()
