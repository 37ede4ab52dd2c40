#!/usr/bin/env python3
"""twobp_bench simulate --dump-schedules writes every schedule it simulated so that it reads back: each .txt and .csv
file, simulated again through --schedule-file, gives the same step time as the run that wrote it.

Usage: check_dump_schedules.py TWOBP_BENCH WORK_DIR
"""
import json
import os
import subprocess
import sys


def simulate(bench, args, out):
    subprocess.run([bench, "simulate", *args, "--json", out], check=True, capture_output=True, timeout=120)
    with open(out) as f:
        return json.load(f)["results"]


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)  # --json's directory must exist (--dump-schedules makes its own when it writes)
    dumps = os.path.join(work, "schedules")
    results = simulate(bench, ["--schedule", "all", "--ranks", "4", "--microbatches", "8", "--dump-schedules", dumps],
                       os.path.join(work, "all.json"))
    checked = 0
    for r in results:
        base = os.path.join(dumps, f"{r['schedule']}_{r['mode']}_p{r['p']}_m{r['m']}_v{r['v']}")
        for ext in (".txt", ".csv"):
            again = simulate(bench, ["--schedule-file", base + ext], os.path.join(work, "again.json"))
            if len(again) != 1 or again[0]["sim_step_ms"] != r["sim_step_ms"] or again[0]["mode"] != r["mode"]:
                sys.exit(f"{base}{ext}: simulated {again}, the run that wrote it {r}")
            checked += 1
    if checked < 20:
        sys.exit(f"only {checked} schedule files checked")
    print(f"{checked} dumped schedule files read back with the same step time")


if __name__ == "__main__":
    main()
