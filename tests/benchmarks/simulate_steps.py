"""Shared by the `twobp_bench simulate` checks: one run of the command and its step time per schedule and mode."""
import json
import subprocess


def simulate(bench, path, args):
    """Runs `twobp_bench simulate ARGS --json PATH`; returns the JSON and {(schedule, mode): sim_step_ms}."""
    subprocess.run([bench, "simulate", *args, "--json", path], check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        doc = json.load(f)
    return doc, {(r["schedule"], r["mode"]): r["sim_step_ms"] for r in doc["results"]}
