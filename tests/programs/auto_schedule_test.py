#!/usr/bin/env python3
"""llama_pipeline --schedule auto (twobp::AutoSchedule) as a user runs it, on threads and under mpirun.

Each run must print its decisions and record them in --json; then the same job started with the schedule auto
ended on (--schedule NAME, --2bp or --no-2bp, --recompute --recompute-on RANKS) must give the same loss at every
step, within 1e-6 relative: a switch changes the order of the work, not what is computed. With --auto-recompute the
starting schedule is measured with every stage recomputing too, and the candidates include every form with 1 .. p
ranks recomputing. With --auto-placements forms of other placements (chunks per rank, stage order) are measured too,
the weights and optimizer state moving through a checkpoint; the rerun then starts on the placement it ended on
(--chunks-per-rank, --partition). Which schedule it picks depends on this machine's timings; any pick must keep the
losses.
Recomputing on one rank alone (either) keeps them too. Refused combinations say why.

With --timing (the opt-in ctest programs_auto_schedule_timing, label timing): a 30-step auto run on threads (4 x 4
sequences of 256 tokens per step), then
every candidate it ranked run on its own for 30 steps, in 3 interleaved rounds (A B C ... A B C ...); the schedule
auto ended on must measure within 5 % of the fastest candidate's tokens/s (each candidate's best round, the median
over its steps after the first 5).

Usage: auto_schedule_test.py LLAMA_PIPELINE WORK_DIR [MPIEXEC] [--timing]
"""
import json
import os
import statistics
import sys

from program_runs import MPI_FLAGS, run

STEPS, AUTO_STEPS = 15, 3
# The tiny model at a size where the stages' costs are not all noise, fp32, 2 pipeline ranks.
JOB = ["--steps", str(STEPS), "--microbatches", "4", "--micro-batch-size", "2", "--seq-len", "32"]
def losses(path):
    with open(path) as f:
        return [s["loss"] for s in json.load(f)["steps"]]


def recompute_args(ranks):
    """The example's flags for the stages of the pipeline ranks listed recomputing (none for an empty list)."""
    return ["--recompute", "--recompute-on", ",".join(map(str, ranks))] if ranks else []


def check(launch, example, work, name, extra=(), job=()):
    """`extra`: the auto run's options; `job`: options of both runs (the job's shape)."""
    auto_json = os.path.join(work, f"{name}_auto.json")
    out = run(launch + [example, *JOB, *job, "--schedule", "auto", "--auto-steps", str(AUTO_STEPS), *extra,
                        "--json", auto_json])
    with open(auto_json) as f:
        doc = json.load(f)
    decisions = doc["auto_schedule"]["decisions"]
    assert decisions, f"{name}: no decision recorded"
    assert decisions[0]["step"] == AUTO_STEPS - 1, f"{name}: first decision at step {decisions[0]['step']}"
    for d in decisions:
        assert d["decision"] in out, f"{name}: decision not printed: {d['decision']}"
    final = doc["auto_schedule"]["final"]
    if "--auto-recompute" in extra:
        assert "with every stage recomputing too" in decisions[1]["decision"], decisions[1]
        settings = {len(c["recompute_ranks"]) for c in doc["auto_schedule"]["ranking"]}
        assert settings == {0, 1, 2}, f"{name}: the ranking holds {settings} recomputing ranks (2 ranks)"
    if "--auto-weight-sizes" in extra:  # 1f1b 2BP batches its W's: probed again with them one by one, never chosen
        assert "its W's one micro-batch at a time too" in decisions[0]["decision"], decisions[0]
        assert "per W" not in final["schedule"], final
    if "--auto-placements" in extra:  # the planner's forms of other placements: at least one measured
        said = [d["decision"] for d in decisions if d["decision"].startswith("auto placement:")]
        assert len(said) >= 2 and "moving to" in said[0], f"{name}: no other placement measured: {said}"
        changes = sum(line.count(verb) for line in said for verb in ("moving to", "switching to", "back to"))
        print(f"{name}: {changes} change(s) of placement or schedule; {said[-1]}")
    again_json = os.path.join(work, f"{name}_{final['schedule']}.json")
    placement = ["--chunks-per-rank", str(final["chunks_per_rank"]), "--partition", final["partition"]]
    run(launch + [example, *JOB, *job, "--schedule", final["schedule"], *placement,
                  "--2bp" if final["2bp"] else "--no-2bp", *recompute_args(final["recompute_ranks"]),
                  "--json", again_json])
    a, b = losses(auto_json), losses(again_json)
    assert len(a) == len(b) == STEPS, f"{name}: {len(a)} and {len(b)} steps"
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst <= 1e-6, f"{name}: losses differ by {worst:.3g} relative from a run started with {final}:\n{a}\n{b}"
    mode = ("2BP" if final["2bp"] else "standard") + (
        f" with recomputation on ranks {final['recompute_ranks']}" if final["recompute_ranks"] else "")
    print(f"{name}: {len(decisions)} decision(s), ended on {final['schedule']} {mode}; losses of {STEPS} steps "
          f"within {worst:.2g} relative of a run started with it")


def tokens_per_s(path, skip=5):
    with open(path) as f:
        return statistics.median(s["tokens_per_s"] for s in json.load(f)["steps"][skip:])


def timing(example, work, rounds=3, steps=30):
    """The choice against every candidate it ranked, measured here (steps of ~0.1 s: less noise than JOB's)."""
    job = ["--steps", str(steps), "--microbatches", "4", "--micro-batch-size", "4", "--seq-len", "256"]
    auto_json = os.path.join(work, "timing_auto.json")
    run([example, *job, "--schedule", "auto", "--json", auto_json])
    with open(auto_json) as f:
        auto = json.load(f)["auto_schedule"]
    final = (auto["final"]["schedule"], auto["final"]["2bp"])
    candidates = [(c["schedule"], c["2bp"]) for c in auto["ranking"]]
    assert final in candidates, f"final {final} not among the ranked candidates {candidates}"
    best = {c: 0.0 for c in candidates}
    for r in range(rounds):
        for name, two_bp in candidates:
            out = os.path.join(work, f"timing_{name}_{int(two_bp)}_{r}.json")
            run([example, *job, "--schedule", name, "--2bp" if two_bp else "--no-2bp", "--json", out])
            best[(name, two_bp)] = max(best[(name, two_bp)], tokens_per_s(out))
    fastest = max(best, key=best.get)
    for c in candidates:
        print(f"  {c[0]} {'2BP' if c[1] else 'standard'}: {best[c]:.0f} tokens/s"
              f"{'  <- auto' if c == final else ''}{'  <- fastest' if c == fastest else ''}")
    ratio = best[final] / best[fastest]
    print(f"timing: auto ended on {final[0]} {'2BP' if final[1] else 'standard'}, {ratio:.3f} of the fastest "
          f"({fastest[0]} {'2BP' if fastest[1] else 'standard'})")
    assert ratio >= 0.95, f"the choice measured {ratio:.3f} of the fastest candidate"


def main():
    args = [a for a in sys.argv[1:] if a != "--timing"]
    example, work = args[0], args[1]
    mpiexec = args[2] if len(args) > 2 else None
    os.makedirs(work, exist_ok=True)
    if "--timing" in sys.argv:
        timing(example, work)
        return
    check([], example, work, "threads")
    # Four probes (each mode, with and without recomputation) and one candidate fit the 15 steps.
    check([], example, work, "threads_recompute", ["--auto-recompute", "--auto-candidates", "1"])
    check([], example, work, "threads_weight_sizes", ["--auto-weight-sizes", "--auto-candidates", "1"])
    # Other placements: whatever the predictions, --auto-within 100 measures the fastest predicted one (the state
    # moves there through a checkpoint, and back when it measures slower); from v = 1 (costs by FLOP shares) and
    # from v = 2 (costs fitted per chunk); with data parallelism and a sharded optimizer, whose replicas must agree.
    placements = ["--auto-placements", "--auto-within", "100", "--auto-candidates", "1"]
    check([], example, work, "threads_placements", [*placements, "--checkpoint-dir", os.path.join(work, "ck_v1")])
    check([], example, work, "threads_placements_v2",
          [*placements, "--auto-start", "interleaved-1f1b", "--checkpoint-dir", os.path.join(work, "ck_v2")])
    check([], example, work, "threads_placements_dp",
          [*placements, "--checkpoint-dir", os.path.join(work, "ck_dp")], ["--dp", "2", "--zero", "1"])
    if mpiexec:
        check([mpiexec, "-n", "2", *MPI_FLAGS], example, work, "mpi")
        check([mpiexec, "-n", "2", *MPI_FLAGS], example, work, "mpi_placements",
              [*placements, "--checkpoint-dir", os.path.join(work, "ck_mpi")])
    # Refused before any step, saying why.
    run([example, "--schedule", "auto", "--max-pending-w", "1"], ok=False,
        must_say="cannot keep --memory-limit-gb or --max-pending-w")
    run([example, "--schedule", "auto", "--steps", "14", "--auto-steps", "3"], ok=False, must_say="--steps >= 15")
    run([example, "--schedule", "auto", "--steps", "20", "--auto-steps", "3", "--auto-recompute"], ok=False,
        must_say="--steps >= 21")
    run([example, "--schedule", "auto", "--steps", "40", "--auto-placements"], ok=False,
        must_say="give --checkpoint-dir")
    run([example, "--schedule", "auto", "--steps", "23", "--auto-steps", "3", "--auto-placements", "--checkpoint-dir",
         os.path.join(work, "ck_refused")], ok=False, must_say="--steps >= 24")
    run([example, "--schedule", "auto", "--auto-recompute", "--recompute"], ok=False,
        must_say="the stages recompute already")
    # Recomputing on one rank only (--recompute-ranks 1: rank 0; --recompute-on 1: rank 1) computes what no
    # recomputation does.
    plain = os.path.join(work, "plain.json")
    run([example, *JOB, "--schedule", "1f1b", "--json", plain])
    for flags in (["--recompute-ranks", "1"], ["--recompute-on", "1"]):
        partial = os.path.join(work, f"recomputing_{flags[0][2:]}.json")
        run([example, *JOB, "--schedule", "1f1b", "--recompute", *flags, "--json", partial])
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses(partial), losses(plain)))
        assert worst <= 1e-6, f"--recompute {' '.join(flags)} changed the losses by {worst:.3g} relative"
        print(f"threads: --recompute {' '.join(flags)}, losses within {worst:.2g} relative of no recomputation")
    run([example, "--recompute", "--recompute-on", "2"], ok=False,
        must_say="--recompute-on: ranks '2': no rank 2 in a pipeline of 2")
    # A memory bound on the candidates that nothing fits: the starting schedule is kept, and said so.
    out = run([example, *JOB, "--schedule", "auto", "--auto-steps", str(AUTO_STEPS), "--auto-memory-limit-gb",
               "1e-9"])
    assert "back to 1f1b 2bp" in out and "within" in out, f"a limit nothing fits: {out}"
    print("threads: --auto-memory-limit-gb 1e-9 keeps the starting schedule")


if __name__ == "__main__":
    main()
