#!/usr/bin/env python3
"""Replays a table of bad inputs against the shipped programs and checks how each is refused.

Usage: bad_inputs.py [--bench TWOBP_BENCH] [--example LLAMA_PIPELINE]

Numeric options: each program's --help (one per command) must show every option of the table below with the one
check all of them use (twobp::cli::number_in, examples/common/twobp_cli.h: "in [lo, hi]"), its lower bound as the
table says (above 0 where 0 is refused, -1 where -1 means something, else 0 or more); twobp_cli_test shows
in-process that this check refuses every kind of bad value (-1, 0, nan, inf, 1e300, text). Then every option gets
one bad value on the command line, the next kind for the next option (so that every kind runs end to end). Every
output option gets a path that cannot be written; a few other inputs (unknown names, missing files, rules between
options, a mistyped command) too; and situations that need files made first (SITUATIONS): a FIFO given as any input
file (an output may be a FIFO: tests/programs/special_outputs.py), one path given to two outputs (every pair of each command's output files) or to an output and an
input, a checkpoint resumed at or past the run's end, an edited manifest step, more rank threads than a process
runs, a plan in another precision than its measured costs, an output directory of a refused command (which must not be
left behind). Each run must: exit with status 2 (a usage error's),
within 30 s, print a message naming the option (for a mistyped command: the closest command), never print "wrote" or
"written", and show no backtrace (c10's "Exception raised from" / "frame #", "terminate called"). Fails listing
every case that did not.
"""
import argparse
import concurrent.futures
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ALWAYS_BAD = ["-1", "nan", "inf", "1e300"]

# program -> command (None: the program has none) -> [(option, 0 refused?, -1 allowed?)]
NUMERIC = {
    "bench": {
        "pipeline": [("--ranks", True), ("--dp", True), ("--microbatches", True), ("--chunks-per-rank", False),
                     ("--dim", True), ("--layers", True), ("--heads", True), ("--kv-heads", True), ("--ffn", True),
                     ("--vocab", True), ("--seq", True), ("--channels", True), ("--image-size", True),
                     ("--in-channels", True), ("--classes", True), ("--micro-batch-size", True), ("--steps", True),
                     ("--warmup", False), ("--threads", True), ("--timeout", True), ("--memory-limit-mb", True)],
        "simulate": [("--f", False), ("--i", False), ("--w", False), ("--b", False), ("--comm", False),
                     ("--ranks", True), ("--microbatches", True), ("--chunks-per-rank", False), ("--dp", True),
                     ("--link-gbps", True), ("--link-latency-us", False), ("--model-params", True),
                     ("--grad-bytes", True), ("--dp-buckets", True), ("--action-ms", False)],
        "split": [("--dim", True), ("--ffn", True), ("--heads", True), ("--kv-heads", True), ("--layers", True),
                  ("--seq", True), ("--batch", True), ("--repeats", True), ("--warmup", False), ("--threads", True),
                  ("--microbatches", True), ("--conv-channels", True), ("--conv-size", True),
                  ("--conv-layers", True)],
        "plan": [("--dim", True), ("--layers", True), ("--heads", True), ("--kv-heads", True), ("--ffn", True),
                 ("--vocab", True), ("--ranks", True), ("--gpu-memory-gb", False), ("--seq", True),
                 ("--micro-batch-size", True), ("--global-batch", True), ("--tflops", True), ("--link-gbps", True),
                 ("--link-latency-us", False), ("--top", True), ("--max-dp", True), ("--action-ms", False)],
        "check-schedules": [("--ranks", True)],
    },
    "example": {
        None: [("--dim", False), ("--layers", False), ("--heads", False), ("--kv-heads", False), ("--ffn", False),
               ("--vocab", False), ("--seed", False), ("--ranks", True), ("--dp", True),
               ("--chunks-per-rank", False), ("--microbatches", True), ("--micro-batch-size", True),
               ("--max-pending-w", False), ("--memory-limit-gb", False), ("--timeout", True), ("--steps", False),
               ("--stop-after", False), ("--warmup-steps", False, True), ("--lr", True), ("--weight-decay", False),
               ("--clip", False), ("--zero", False), ("--seq-len", False), ("--doc-separator", False),
               ("--seq-len-warmup", False), ("--eval-every", False), ("--eval-batches", True),
               ("--eval-fraction", True), ("--checkpoint-every", False), ("--gpu-memory-gb", False),
               ("--auto-steps", True), ("--auto-memory-limit-gb", False),
               ("--auto-candidates", True)],
    },
}
UNWRITABLE = "/proc/twobp-nonexistent/out"  # not even root can create it
OUTPUTS = {
    "bench": {
        "pipeline": ["--json", "--csv", "--chart", "--trace-dir"],
        "simulate": ["--json", "--dump-schedules"],
        "split": ["--json"],
        "plan": ["--json"],
        "check-schedules": ["--json"],
    },
    "example": {None: ["--json", "--trace", "--dump-schedule", "--checkpoint-dir", "--costs-json", "--export-hf"]},
}
# Other bad inputs: (program, arguments, the option the message must name).
OTHER = [
    ("example", ["--model", "huge"], "--model"),
    ("example", ["--schedule", "2f2b"], "--schedule"),
    ("example", ["--schedule", "auto", "--auto-start", "2f2b"], "--auto-start"),
    ("example", ["--schedule", "auto", "--memory-limit-gb", "1"], "--schedule auto"),
    ("example", ["--device", "tpu"], "--device"),
    ("example", ["--dtype", "fp16"], "--dtype"),
    ("example", ["--on-nonfinite", "ignore"], "--on-nonfinite"),
    ("example", ["--data", "/nonexistent/tokens.tok"], "--data"),
    ("example", ["--schedule-file", "/nonexistent/schedule.txt"], "--schedule-file"),
    ("example", ["--resume"], "--resume"),
    # --steps 0 exports a loaded model only (tests/programs/hf_finetune_test.py covers --init-from's refusals).
    ("example", ["--steps", "0"], "--steps 0"),
    ("example", ["--init-from", "/nonexistent/hf"], "--init-from"),
    ("example", ["--export-dtype", "f16"], "--export-dtype"),
    ("example", ["--vocab", "100"], "--vocab"),
    ("example", ["--seq-len", "100000"], "--seq-len"),
    ("example", ["--microbatches", "4096", "--micro-batch-size", "4096"], "--microbatches"),
    ("example", ["--dim", "1000000", "--heads", "1", "--kv-heads", "1"], "--dim"),
    ("bench", ["plan", "--dtype", "fp16"], "--dtype"),
    # Issue 69: costs that are not costs. B cheaper than I (a fused backward does I's work and W's), and a NaN F.
    ("bench", ["simulate", "--b", "0.5", "--i", "1", "--w", "1"], "--b"),
    ("bench", ["simulate", "--f", "nan"], "--f"),
    # Issue 69, smaller items: a set of numbers names its members; a mistyped option is told the closest one (as a
    # mistyped command is); an empty output path is refused, not taken as "no output".
    ("example", ["--zero", "on"], "--zero: must be 0 (no sharding), 1 (ZeRO-1) or 2"),
    ("example", ["--stpes", "3"], "did you mean '--steps'?"),
    ("bench", ["simulate", "--rnaks", "4"], "did you mean '--ranks'?"),
    ("example", ["--checkpoint-dir", ""], "--checkpoint-dir: an empty path"),
    ("bench", ["simulate", "--json", ""], "--json: an empty path"),
    ("bench", ["splt", "--json", "s.json"], "did you mean 'split'?"),
    ("bench", ["simualte"], "did you mean 'simulate'?"),
    ("bench", ["benchmark"], "the commands are split, pipeline, simulate, check-schedules, plan"),
]
BACKTRACE = ("Exception raised from", "frame #", "terminate called")

# Input files of each program (option -> what a valid one is made of: see make_inputs).
INPUTS = {
    "bench": {"pipeline": ["--schedule-file"], "simulate": ["--schedule-file", "--from-json"],
              "plan": ["--costs-json", "--ratios-json"]},
    "example": {None: ["--schedule-file", "--data"]},
}
# Output directories (not files) among OUTPUTS.
DIRECTORIES = {"--trace-dir", "--dump-schedules", "--checkpoint-dir", "--export-hf"}


def make_checkpoint(example, work):
    """A 2-step run of the example: its checkpoint (step 2) and its measured costs (fp32)."""
    ck, costs = os.path.join(work, "ck"), os.path.join(work, "costs_fp32.json")
    subprocess.run([example, "--steps", "2", "--checkpoint-dir", ck, "--costs-json", costs], check=True,
                   capture_output=True, timeout=300)
    return ck, costs


def edited_checkpoint(ck, work, name, step):
    """A copy of checkpoint `ck` whose manifest says `step`."""
    copy = os.path.join(work, name)
    shutil.copytree(ck, copy)
    path = os.path.join(copy, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["step"] = step
    with open(path, "w") as f:
        json.dump(manifest, f)
    return copy


def situations(programs, work):
    """(program, arguments, the option the message must name) of the situations above, their files made in `work`."""
    fifo = os.path.join(work, "fifo")
    os.mkfifo(fifo)
    for program in programs:
        for command in set(INPUTS[program]) | set(OUTPUTS[program]):
            prefix = [command] if command else []
            for option in INPUTS[program].get(command, []):  # a FIFO read would wait for a writer forever
                yield program, prefix + [option, fifo], option
            files = [o for o in OUTPUTS[program].get(command, []) if o not in DIRECTORIES]
            for first, second in itertools.combinations(files, 2):  # one file, two outputs
                same = os.path.join(work, f"same_{program}_{command}.out")
                yield program, prefix + [first, same, second, same], first
    example, bench = programs.get("example"), programs.get("bench")
    if example:  # a command refused after parsing leaves no directory it was given behind (the 4th element)
        fresh = os.path.join(work, "fresh_ck", "deeper")
        yield "example", ["--checkpoint-dir", fresh, "--dp", "1000"], "--dp", fresh
    if bench:
        fresh = os.path.join(work, "fresh_dump")
        yield "bench", ["simulate", "--dump-schedules", fresh, "--schedule", "2f2b"], "--schedule", fresh
    if example:
        schedule = os.path.join(work, "schedule.txt")
        subprocess.run([example, "--dry-run", "--dump-schedule", schedule], check=True, capture_output=True,
                       timeout=60)
        yield "example", ["--schedule-file", schedule, "--json", schedule], "--json"  # the output over the input
        yield "example", ["--dp", "1000"], "--dp"
        ck, costs = make_checkpoint(example, work)
        for args in (["--steps", "2"], ["--steps", "1"], ["--steps", "5", "--stop-after", "2"]):
            yield "example", ["--checkpoint-dir", ck, "--resume"] + args, "--resume"  # nothing left to train
        for name, step in (("ck_earlier", 1), ("ck_later", 3), ("ck_negative", -1)):
            yield "example", ["--checkpoint-dir", edited_checkpoint(ck, work, name, step), "--resume", "--steps",
                              "5"], "--resume"
        if bench:
            yield "bench", ["plan", "--costs-json", costs, "--dtype", "bf16", "--ranks", "2"], "--dtype"
            bf16 = os.path.join(work, "costs_bf16.json")
            with open(costs) as f:
                doc = json.load(f)
            doc["config"]["dtype"] = "bf16"
            with open(bf16, "w") as f:
                json.dump(doc, f)
            yield "bench", ["plan", "--costs-json", costs, bf16, "--ranks", "2"], "--costs-json"
            yield "bench", ["plan", "--costs-json", costs, "--json", costs, "--ranks", "2"], "--json"
    if bench:
        for args in (["--dp", "1000"], ["--dp", "300", "--ranks", "4"]):
            yield "bench", ["pipeline"] + args, "--dp"
        # Issue 69: measured costs that are not costs -- a W of 1e308 ms (finite, but it planned a finite step), a
        # NaN (not JSON), a negative one -- refused naming the option (and the file, result and field).
        for name, w in (("huge", "1e308"), ("nan", "NaN"), ("negative", "-1")):
            path = os.path.join(work, f"costs_{name}_w.json")
            with open(path, "w") as f:
                f.write('{"results": [{"schedule": "1f1b", "mode": "2bp", "p": 2, "m": 4, "v": 1, '
                        '"communication_ms": 0, "costs_ms": {"F": [1, 1], "I": [1, 1], "W": [1, %s]}}]}' % w)
            yield "bench", ["plan", "--costs-json", path, "--ranks", "2"], "--costs-json"
            yield "bench", ["simulate", "--from-json", path], "--from-json"


def cases(programs):
    turn = 0
    for program in programs:
        for command, options in NUMERIC[program].items():
            prefix = [command] if command else []
            for option, zero_refused, *minus_one_ok in options:
                values = [v for v in ALWAYS_BAD if not (v == "-1" and minus_one_ok)] + (["0"] if zero_refused else [])
                yield program, prefix + [option, values[turn % len(values)]], option
                turn += 1
        for command, options in OUTPUTS[program].items():
            for option in options:
                yield program, ([command] if command else []) + [option, UNWRITABLE], option
    for program, args, option in OTHER:
        if program in programs:
            yield program, args, option


# CLI11's help line of an option checked by number_in, "--dim INT:in [1, 1e+06]=64", or by a set of numbers,
# "--zero INT:{0,1}=0" (which refuses every other value); its aliases come before it.
DECLARED = re.compile(r"^\s*((?:-[\w-]+,)*--[\w-]+)\s+\S+?:(?:in \[([^,\]]+), [^\]]+\]|\{([-\d.,]+)\})", re.M)


# One vocabulary: a command that takes the first spelling takes the second too (README, "one vocabulary").
SPELLINGS = {"--microbatches": "--micro-batches"}


def declared_problems(programs):
    """Problems of the table's numeric options as each program's --help declares them."""
    problems = []
    for program in programs:
        for command, options in NUMERIC[program].items():
            args = ([command] if command else []) + ["--help"]
            out = subprocess.run([programs[program]] + args, capture_output=True, text=True, timeout=30).stdout
            bounds = {}
            for names, lo, members in DECLARED.findall(out):
                for name in names.split(","):
                    bounds[name] = float(lo) if lo else min(float(m) for m in members.split(","))
            for name, other in SPELLINGS.items():
                if name in bounds and other not in bounds:
                    problems.append(f"{program} {' '.join(args[:-1])}: takes {name} but not {other}")
            for option, zero_refused, *minus_one_ok in options:
                what = f"{program} {' '.join(args[:-1])} {option}".replace("  ", " ")
                if option not in bounds:
                    problems.append(f"{what}: --help shows no 'in [lo, hi]' check (twobp::cli::number_in) nor a set")
                    continue
                lo = bounds[option]
                if zero_refused and lo <= 0:
                    problems.append(f"{what}: 0 should be refused, but the lower bound is {lo:g}")
                if not zero_refused and lo > 0:
                    problems.append(f"{what}: 0 should be allowed, but the lower bound is {lo:g}")
                if minus_one_ok and lo > -1:
                    problems.append(f"{what}: -1 should be allowed, but the lower bound is {lo:g}")
                if not minus_one_ok and lo < 0:
                    problems.append(f"{what}: -1 should be refused, but the lower bound is {lo:g}")
    return problems


def run(programs, case):
    program, args, option, *absent = case  # absent: a path the refused command must not have created
    what = f"{program} {' '.join(args)}"
    try:
        p = subprocess.run([programs[program]] + args, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"{what}: no answer within 30 s"
    out = p.stdout + p.stderr
    problems = []
    if p.returncode < 0 or p.returncode >= 128:
        problems.append(f"killed or crashed (status {p.returncode})")
    elif p.returncode != 2:
        problems.append(f"exit status {p.returncode}, not 2 (a usage error's)")
    if option not in out:
        problems.append("the message does not name the option")
    if "wrote" in out or "written" in out:
        problems.append('printed "wrote" or "written"')
    if any(b in out for b in BACKTRACE):
        problems.append("printed a backtrace")
    if absent and os.path.exists(absent[0]):
        problems.append(f"left {absent[0]} behind")
    if problems:
        first = out.strip().splitlines()[0] if out.strip() else "(no output)"
        return f"{what}: {', '.join(problems)}; output: {first[:200]}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", help="twobp_bench")
    parser.add_argument("--example", help="llama_pipeline")
    given = vars(parser.parse_args())
    programs = {name: path for name, path in given.items() if path}
    if not programs:
        parser.error("give --bench and/or --example")
    work = tempfile.mkdtemp(prefix="twobp_bad_inputs_")
    try:
        # Two programs at a time. The --help checks and the situations' files (a 2-step training run for its
        # checkpoint and costs, a schedule) are made on the workers too, ahead of the table, instead of before it.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            made = pool.submit(lambda: list(situations(programs, work)))
            declared = pool.submit(declared_problems, programs)
            table = list(cases(programs))
            checks = [pool.submit(run, programs, c) for c in table]
            table += made.result()
            checks += [pool.submit(run, programs, c) for c in table[len(checks):]]
            failures = declared.result() + [f for f in (c.result() for c in checks) if f]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} of {len(table)} bad inputs were not refused cleanly:")
        for f in failures:
            print("  " + f)
        sys.exit(1)
    print(f"{len(table)} bad inputs over {', '.join(programs)}: each refused, naming the option")


if __name__ == "__main__":
    main()
