#!/usr/bin/env python3
"""Recomputation on the first pipeline ranks only, from the planner to a measured run.

usage: check_recompute_ranks.py TWOBP_BENCH WORK_DIR

`twobp_bench plan --recompute on` plans every prefix recompute_ranks = 1 .. pp of each form; a candidate short of
pp says so in its example command and its `pipeline` arguments (--recompute --recompute-ranks N), one of pp says
--recompute alone. Running the partial candidate's arguments recomputes on the stages of those ranks only: the
run's config names recompute_ranks and its measured recomputation R is positive on rank 0's stage and 0 on
rank 1's.
"""

import json
import os
import subprocess
import sys

BENCH, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
MODEL = ["--dim", "32", "--layers", "4", "--heads", "2", "--kv-heads", "2", "--ffn", "64", "--vocab", "64",
         "--seq", "8"]
problems = []


def run(args):
    done = subprocess.run([BENCH] + args, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        sys.exit(f"twobp_bench {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


plan_json = os.path.join(WORK, "plan.json")
run(["plan", "--model", "tiny"] + MODEL + ["--ranks", "2", "--global-batch", "4", "--precision", "fp32",
     "--schedule", "1f1b", "--mode", "2bp", "--recompute", "on", "--max-dp", "1", "--json", plan_json])
with open(plan_json) as f:
    candidates = json.load(f)["candidates"]
by_ranks = {c["recompute_ranks"]: c for c in candidates}
if sorted(by_ranks) != [1, 2] or len(candidates) != 2:
    problems.append(f"plan --recompute on, pp = 2: recompute_ranks {[c['recompute_ranks'] for c in candidates]}, "
                    "expected 1 and 2")
else:
    partial, full = by_ranks[1], by_ranks[2]
    if "--recompute --recompute-ranks 1" not in partial["command"]:
        problems.append(f"partial candidate's command: {partial['command']}")
    if "--recompute" not in full["command"] or "--recompute-ranks" in full["command"]:
        problems.append(f"every rank recomputing: {full['command']}")
    args = partial["bench_args"]
    if "--recompute-ranks" not in args or args[args.index("--recompute-ranks") + 1] != "1":
        problems.append(f"partial candidate's bench_args: {args}")
    run_json = os.path.join(WORK, "run.json")
    run(args + ["--steps", "2", "--warmup", "1", "--json", run_json])
    with open(run_json) as f:
        doc = json.load(f)
    if doc["config"].get("recompute_ranks") != 1:
        problems.append(f"run config: recompute_ranks {doc['config'].get('recompute_ranks')}, expected 1")
    for r in doc["results"]:
        recompute = r["costs_ms"].get("R")
        if recompute is None or len(recompute) != 2 or not recompute[0] > 0 or recompute[1] != 0:
            problems.append(f"{r['schedule']} {r['mode']}: R per stage {recompute}, expected > 0 on stage 0 only")

for p in problems:
    print("check_recompute_ranks:", p)
print(f"check_recompute_ranks: {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
