#!/usr/bin/env python3
"""Replays a table of bad inputs against the shipped programs and checks how each is refused.

Usage: bad_inputs.py [--bench TWOBP_BENCH] [--example LLAMA_PIPELINE]

Every numeric option of every command gets -1, nan, inf and 1e300 (and 0 where 0 is not allowed); every output
option gets a path that cannot be written; a few other inputs (unknown names, missing files, rules between options)
too. Each run must: exit with a non-zero status (not a signal), within 30 s, print a message naming the option,
never print "wrote" or "written", and show no backtrace (c10's "Exception raised from" / "frame #", "terminate
called"). Fails listing every case that did not.
"""
import argparse
import concurrent.futures
import subprocess
import sys

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
                     ("--grad-bytes", True), ("--dp-buckets", True)],
        "split": [("--dim", True), ("--ffn", True), ("--heads", True), ("--kv-heads", True), ("--layers", True),
                  ("--seq", True), ("--batch", True), ("--repeats", True), ("--warmup", False), ("--threads", True),
                  ("--microbatches", True), ("--conv-channels", True), ("--conv-size", True),
                  ("--conv-layers", True)],
        "plan": [("--dim", True), ("--layers", True), ("--heads", True), ("--kv-heads", True), ("--ffn", True),
                 ("--vocab", True), ("--ranks", True), ("--gpu-memory-gb", False), ("--seq", True),
                 ("--micro-batch-size", True), ("--global-batch", True), ("--tflops", True), ("--link-gbps", True),
                 ("--link-latency-us", False), ("--top", True), ("--max-dp", True)],
        "check-schedules": [("--ranks", True)],
    },
    "example": {
        None: [("--dim", False), ("--layers", False), ("--heads", False), ("--kv-heads", False), ("--ffn", False),
               ("--vocab", False), ("--seed", False), ("--ranks", True), ("--dp", True),
               ("--chunks-per-rank", False), ("--microbatches", True), ("--micro-batch-size", True),
               ("--max-pending-w", False), ("--memory-limit-gb", False), ("--timeout", True), ("--steps", True),
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
    "example": {None: ["--json", "--trace", "--dump-schedule", "--checkpoint-dir", "--costs-json"]},
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
    ("example", ["--vocab", "100"], "--vocab"),
    ("example", ["--seq-len", "100000"], "--seq-len"),
    ("example", ["--microbatches", "4096", "--micro-batch-size", "4096"], "--microbatches"),
    ("example", ["--dim", "1000000", "--heads", "1", "--kv-heads", "1"], "--dim"),
    ("bench", ["plan", "--dtype", "fp16"], "--dtype"),
]
BACKTRACE = ("Exception raised from", "frame #", "terminate called")


def cases(programs):
    for program in programs:
        for command, options in NUMERIC[program].items():
            prefix = [command] if command else []
            for option, zero_refused, *minus_one_ok in options:
                values = [v for v in ALWAYS_BAD if not (v == "-1" and minus_one_ok)]
                for value in values + (["0"] if zero_refused else []):
                    yield program, prefix + [option, value], option
        for command, options in OUTPUTS[program].items():
            for option in options:
                yield program, ([command] if command else []) + [option, UNWRITABLE], option
    for program, args, option in OTHER:
        if program in programs:
            yield program, args, option


def run(programs, case):
    program, args, option = case
    what = f"{program} {' '.join(args)}"
    try:
        p = subprocess.run([programs[program]] + args, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"{what}: no answer within 30 s"
    out = p.stdout + p.stderr
    problems = []
    if p.returncode == 0:
        problems.append("exit status 0")
    elif p.returncode < 0 or p.returncode >= 128:
        problems.append(f"killed or crashed (status {p.returncode})")
    if option not in out:
        problems.append("the message does not name the option")
    if "wrote" in out or "written" in out:
        problems.append('printed "wrote" or "written"')
    if any(b in out for b in BACKTRACE):
        problems.append("printed a backtrace")
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
    table = list(cases(programs))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(lambda c: run(programs, c), table) if f]
    if failures:
        print(f"{len(failures)} of {len(table)} bad inputs were not refused cleanly:")
        for f in failures:
            print("  " + f)
        sys.exit(1)
    print(f"{len(table)} bad inputs over {', '.join(programs)}: each refused, naming the option")


if __name__ == "__main__":
    main()
