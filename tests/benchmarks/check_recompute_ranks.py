#!/usr/bin/env python3
"""Recomputation on some pipeline ranks only, from the planner to a measured run.

usage: check_recompute_ranks.py TWOBP_BENCH WORK_DIR

`twobp_bench plan --recompute on` plans each form once per number of recomputing ranks j = 1 .. pp: the first j
ranks by the form's estimated peak without recomputation (twobp::recompute_order), listed in recompute_ranks. A
candidate short of pp says so in its example command and its `pipeline` arguments: --recompute --recompute-ranks N
when its ranks are 0 .. N-1, else --recompute --recompute-on RANKS; one of pp says --recompute alone. Running the
partial candidate's arguments recomputes on the stages of its ranks only: the run's config names them and its
measured recomputation R is positive on those ranks' stages and 0 on the others. And `pipeline --recompute
--recompute-on 1` recomputes on rank 1 alone, whatever the planner chose.
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


def check_run(args, ranks, config_key, config_value):
    """Runs `pipeline` ARGS and checks that the stages of `ranks` (one stage per rank) and no others recompute."""
    run_json = os.path.join(WORK, "run.json")
    run(args + ["--steps", "2", "--warmup", "1", "--json", run_json])
    with open(run_json) as f:
        doc = json.load(f)
    if doc["config"].get(config_key) != config_value:
        problems.append(f"{' '.join(args)}: config {config_key} {doc['config'].get(config_key)!r}, "
                        f"expected {config_value!r}")
    for r in doc["results"]:
        recompute = r["costs_ms"].get("R")
        if (recompute is None or len(recompute) != 2
                or any((recompute[s] > 0) != (s in ranks) for s in range(2))):
            problems.append(f"{r['schedule']} {r['mode']}: R per stage {recompute}, expected > 0 on the stages "
                            f"of ranks {ranks} only")


plan_json = os.path.join(WORK, "plan.json")
run(["plan", "--model", "tiny"] + MODEL + ["--ranks", "2", "--global-batch", "4", "--precision", "fp32",
     "--schedule", "1f1b", "--mode", "2bp", "--recompute", "on", "--max-dp", "1", "--json", plan_json])
with open(plan_json) as f:
    candidates = json.load(f)["candidates"]
by_count = {len(c["recompute_ranks"]): c for c in candidates}
if sorted(by_count) != [1, 2] or len(candidates) != 2:
    problems.append(f"plan --recompute on, pp = 2: recompute_ranks {[c['recompute_ranks'] for c in candidates]}, "
                    "expected one and two ranks")
else:
    partial, full = by_count[1], by_count[2]
    ranks = partial["recompute_ranks"]
    if full["recompute_ranks"] != [0, 1]:
        problems.append(f"every rank recomputing: recompute_ranks {full['recompute_ranks']}")
    want = ["--recompute-ranks", "1"] if ranks == [0] else ["--recompute-on", str(ranks[0])]
    if "--recompute " + " ".join(want) not in partial["command"]:
        problems.append(f"partial candidate {ranks}: command {partial['command']}")
    if "--recompute" not in full["command"] or "--recompute-ranks" in full["command"] \
            or "--recompute-on" in full["command"]:
        problems.append(f"every rank recomputing: {full['command']}")
    args = partial["bench_args"]
    if want[0] not in args or args[args.index(want[0]) + 1] != want[1]:
        problems.append(f"partial candidate's bench_args: {args}")
    check_run(args, ranks, "recompute_ranks" if ranks == [0] else "recompute_on", 1 if ranks == [0] else "1")

# The last rank alone, named on the command line.
check_run(["pipeline"] + MODEL + ["--ranks", "2", "--schedule", "1f1b", "--mode", "2bp", "--microbatches", "4",
                                  "--recompute", "--recompute-on", "1"], [1], "recompute_on", "1")

for p in problems:
    print("check_recompute_ranks:", p)
print(f"check_recompute_ranks: {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
