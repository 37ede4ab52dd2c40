#!/usr/bin/env python3
"""llama_pipeline --costs-json: a training job's own per-stage costs, planned from by `twobp_bench plan`.

A 2BP run writes one "2bp" result (F, I, W per stage, all measured, and the message time) for its placement and
partition; a --schedule auto run, which measures both modes, a "standard" one too (F and B, no I or W). The model's
sizes are the config's, so `twobp_bench plan --costs-json` plans the same model on any placement from them (one
chunk shape: by FLOP shares) and prints the example's command for the same model. A run under mpirun (MPI transport:
the message time is a round trip between processes) writes the same form. A run too short to measure is refused
before it trains. Two jobs' files (v = 1 and v = 2) are fitted together, every term; files of different sizes are
refused. The loop closes: a job that wrote its costs and a checkpoint resumes on the placement the plan
ranks first (checkpoints load in any layout).

Usage: costs_json_test.py LLAMA_PIPELINE TWOBP_BENCH WORK_DIR [MPIEXEC]
"""
import json
import os
import sys

from program_runs import MPI_FLAGS, run

JOB = ["--microbatches", "4", "--micro-batch-size", "2", "--seq-len", "32"]
def written(launch, example, path, *extra):
    run(launch + [example, *JOB, *extra, "--costs-json", path])
    with open(path) as f:
        return json.load(f)


def check_result(name, r, mode, partition, both=False):
    costs = r["costs_ms"]
    assert r["mode"] == mode and r["p"] == 2 and r["v"] == len(partition.split(",")) // 2, f"{name}: {r}"
    assert r["partition"] == partition, f"{name}: partition {r['partition']}, expected {partition}"
    assert r["communication_ms"] > 0, f"{name}: message time {r['communication_ms']}"
    stages = len(partition.split(","))
    measured = ("F", "I", "W", "B") if both else ("F", "I", "W") if mode == "2bp" else ("F", "B")
    for k in measured:
        assert len(costs[k]) == stages and all(x > 0 for x in costs[k]), f"{name}: {mode} {k} = {costs[k]}"
    if mode == "standard":
        assert not any(costs["I"]) and not any(costs["W"]) and "W0" not in costs, f"{name}: standard has I/W: {costs}"


def plan(bench, costs_path, out_path):
    """`costs_path`: one file, or a list of files fitted together."""
    paths = costs_path if isinstance(costs_path, list) else [costs_path]
    run([bench, "plan", "--costs-json", *paths, "--ranks", "2", "--global-batch", "8", "--micro-batch-size",
         "2", "--precision", "fp32", "--recompute", "off", "--max-dp", "1", "--json", out_path])
    with open(out_path) as f:
        return json.load(f)


def main(args):
    example, bench, work = args[0], args[1], args[2]
    mpiexec = args[3] if len(args) > 3 else None
    os.makedirs(work, exist_ok=True)

    checkpoint = os.path.join(work, "checkpoint")
    two_bp = written([], example, os.path.join(work, "2bp.json"), "--steps", "4", "--checkpoint-dir", checkpoint)
    cfg = two_bp["config"]
    assert (cfg["model"], cfg["dim"], cfg["layers"], cfg["seq"], cfg["micro_batch_size"]) == ("llama", 64, 4, 32, 2), \
        cfg
    assert cfg["steps_measured"] == 3, f"the first step is warm-up: {cfg['steps_measured']} measured of 4"
    assert [r["mode"] for r in two_bp["results"]] == ["2bp"], two_bp["results"]
    check_result("2bp run", two_bp["results"][0], "2bp", "2,2")
    planned = plan(bench, os.path.join(work, "2bp.json"), os.path.join(work, "2bp_plan.json"))
    assert planned["config"]["cost_model"]["kind"] == "flop_shares", planned["config"]["cost_model"]
    assert "--model tiny" in planned["best"]["command"], planned["best"]["command"]
    assert {c["v"] for c in planned["candidates"]} >= {1, 2}, "the plan should hold other placements"
    best = planned["best"]
    out = run([example, *JOB, "--steps", "6", "--schedule", best["schedule"], "--chunks-per-rank", str(best["v"]),
               "--2bp" if best["mode"] == "2bp" else "--no-2bp", "--checkpoint-dir", checkpoint, "--resume"],
              must_say="resuming from step 4")
    assert "step     6/6" in out, out

    # --schedule auto measures both modes: one record holds the B's beside the I's and W's (no copied standard
    # result); a custom partition is recorded.
    auto = written([], example, os.path.join(work, "auto.json"), "--steps", "12", "--schedule", "auto",
                   "--auto-steps", "2", "--auto-candidates", "1", "--partition", "3,1")
    assert [r["mode"] for r in auto["results"]] == ["2bp"], auto["results"]
    check_result("auto run", auto["results"][0], "2bp", "3,1", both=True)
    plan(bench, os.path.join(work, "auto.json"), os.path.join(work, "auto_plan.json"))

    # Two jobs' files, v = 1 and v = 2: chunks of two shapes, so every term is fitted (not FLOP shares); both jobs'
    # results are used. A file of another sequence length is refused, naming both files.
    v2 = written([], example, os.path.join(work, "v2.json"), "--steps", "4", "--schedule", "interleaved-1f1b",
                 "--chunks-per-rank", "2")
    check_result("v = 2 run", v2["results"][0], "2bp", "1,1,1,1")
    both = plan(bench, [os.path.join(work, "2bp.json"), os.path.join(work, "v2.json")],
                os.path.join(work, "both_plan.json"))
    assert both["config"]["cost_model"]["kind"] == "fitted", both["config"]["cost_model"]
    run([example, "--microbatches", "4", "--micro-batch-size", "2", "--seq-len", "16", "--steps", "3",
         "--costs-json", os.path.join(work, "seq16.json")])
    run([bench, "plan", "--costs-json", os.path.join(work, "2bp.json"), os.path.join(work, "seq16.json"), "--ranks",
         "2", "--global-batch", "8", "--micro-batch-size", "2"], ok=False,
        must_say="must measure the same model, sequence length and micro-batch size")

    # Too short to measure: refused before training, naming the option.
    run([example, *JOB, "--steps", "1", "--costs-json", os.path.join(work, "short.json")], ok=False,
        must_say="--costs-json measures the steps after this run's first")

    if mpiexec:
        mpi = written([mpiexec, "-n", "2", *MPI_FLAGS], example, os.path.join(work, "mpi.json"), "--steps", "4")
        check_result("mpirun", mpi["results"][0], "2bp", "2,2")
        plan(bench, os.path.join(work, "mpi.json"), os.path.join(work, "mpi_plan.json"))
    print(f"costs json: 2bp F {two_bp['results'][0]['costs_ms']['F']} ms, message "
          f"{two_bp['results'][0]['communication_ms']:.3g} ms; best plan: {planned['best']['schedule']} "
          f"v={planned['best']['v']}")


if __name__ == "__main__":
    main(sys.argv[1:])
