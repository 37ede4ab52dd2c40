#!/usr/bin/env python3
"""Where each rank's step went, in `twobp_bench pipeline --json` output (the "attribution" of every result).

usage: check_attribution.py JSON [MAX_ERROR]

For every result: one entry per pipeline rank 0..p-1; every part a finite number >= 0; the parts sum to the
rank's step_ms within MAX_ERROR (default 0.02) of it, and unaccounted_ms says the same; the waits by peer name
other ranks of the pipeline and add up to the "wait F" and "wait B" parts; a rank that computes had F time.
Prints one line per violation and exits 1 when there is any.
"""

import json
import math
import sys

path = sys.argv[1]
max_error = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
with open(path) as f:
    doc = json.load(f)
problems, checked = [], 0


def close(a, b, tol):
    return abs(a - b) <= tol


for i, r in enumerate(doc.get("results", [])):
    name = f"results[{i}] ({r.get('schedule')} {r.get('mode')})"
    ranks = r.get("attribution")
    if not isinstance(ranks, list):
        problems.append(f"{name}: attribution missing")
        continue
    p = r.get("p", 0)
    if [a.get("rank") for a in ranks] != list(range(p)):
        problems.append(f"{name}: attribution ranks {[a.get('rank') for a in ranks]}, expected 0..{p - 1}")
    for a in ranks:
        where = f"{name} rank {a.get('rank')}"
        step, parts = a.get("step_ms", -1), a.get("parts_ms", {})
        values = list(parts.values())
        if not (isinstance(step, (int, float)) and step > 0 and math.isfinite(step)):
            problems.append(f"{where}: step_ms {step}")
            continue
        bad = {k: v for k, v in parts.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)}
        if bad or not values:
            problems.append(f"{where}: parts not finite and >= 0: {bad or 'none'}")
            continue
        total = sum(values)
        if not close(total, step, max_error * step):
            problems.append(f"{where}: parts sum to {total:.4f} ms, step {step:.4f} ms "
                            f"({100 * (total / step - 1):+.2f} %, allowed {100 * max_error:.0f} %)")
        if not close(a.get("unaccounted_ms", math.nan), step - total, 1e-6 * step + 1e-9):
            problems.append(f"{where}: unaccounted_ms {a.get('unaccounted_ms')} is not step - sum {step - total}")
        waits = a.get("wait_ms_by_peer", {})
        for peer in waits:
            if not (peer.isdigit() and int(peer) < p and int(peer) != a.get("rank")):
                problems.append(f"{where}: waited for rank {peer}, not another rank of the pipeline")
        for kind, part in (("F", "wait F"), ("B", "wait B")):
            by_peer = sum(w.get(kind, 0) for w in waits.values())
            if not close(by_peer, parts.get(part, 0), 1e-6 * step + 1e-9):
                problems.append(f"{where}: waits by peer ({kind}) sum to {by_peer}, the part '{part}' is "
                                f"{parts.get(part)}")
        if parts.get("F", 0) + parts.get("F&B pair", 0) <= 0:
            problems.append(f"{where}: no forward time")
        checked += 1

if not doc.get("results"):
    problems.append("no results")
for line in problems:
    print(f"{path}: {line}")
if problems:
    sys.exit(1)
print(f"{path}: attribution of {checked} ranks consistent (parts within {100 * max_error:.0f} % of the step)")
