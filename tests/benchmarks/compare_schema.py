#!/usr/bin/env python3
"""Two JSON outputs of the same benchmark command have the same form: what a refactoring of the benchmark must keep.

usage: compare_schema.py BEFORE.json AFTER.json

The same keys in the same order at every level, the same types (int and float count as one: a measured 0 may be
written either way), lists of the same length where they hold objects or strings, and the same value for every
string and for the fields that name a configuration (schedule, mode, p, m, v, dp, ...). Measured numbers may
differ: two runs never time alike. The CSV and the tables are written from the same values (pipeline.cpp's
report()), so their form follows the JSON's. Prints one line per difference and exits 1 when there is any.
"""

import json
import re
import sys

# Fields of "config" and of each result whose value names the configuration, not a measurement: equal in both.
NAMES = {"schedule", "mode", "p", "m", "v", "dp", "dp_overlap", "shapes", "model", "dim", "layers", "heads",
         "kv_heads", "ffn", "vocab", "seq", "micro_batch_size", "steps", "warmup", "transport", "recompute",
         "memory_limit_bytes"}
NAMED_LEVEL = re.compile(r"^\$(\.config|\.results\[\d+\])$")


def kind(x):
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)):
        return "number"
    if x is None:
        return "null"
    return type(x).__name__


def compare(a, b, where, out):
    if kind(a) != kind(b):
        out.append(f"{where}: {kind(a)} before, {kind(b)} after")
        return
    if isinstance(a, dict):
        if list(a.keys()) != list(b.keys()):
            out.append(f"{where}: keys {list(a.keys())} before, {list(b.keys())} after")
        for k in a.keys() & b.keys():
            if k in NAMES and NAMED_LEVEL.match(where) and not isinstance(a[k], str) and a[k] != b[k]:
                out.append(f"{where}.{k}: {a[k]!r} before, {b[k]!r} after")
            compare(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, list):
        structured = any(isinstance(x, (dict, str, list)) for x in a + b)
        if structured and len(a) != len(b):
            out.append(f"{where}: {len(a)} entries before, {len(b)} after")
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{where}[{i}]", out)
    elif isinstance(a, str) and a != b and not where.endswith(("load_average", "energy_note")):
        out.append(f"{where}: {a!r} before, {b!r} after")


def main():
    with open(sys.argv[1]) as f:
        before = json.load(f)
    with open(sys.argv[2]) as f:
        after = json.load(f)
    problems = []
    compare(before, after, "$", problems)
    for p in problems:
        print(p)
    print(f"compare_schema: {sys.argv[1]} vs {sys.argv[2]}: {len(problems)} difference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
