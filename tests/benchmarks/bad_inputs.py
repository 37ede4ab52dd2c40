#!/usr/bin/env python3
"""Replays a table of bad inputs against twobp_bench and checks how each is refused.

Usage: bad_inputs.py TWOBP_BENCH

Every numeric option of every command gets -1, nan, inf and 1e300 (and 0 where 0 is not allowed); every output
option gets a path that cannot be written. Each run must: exit with a non-zero status (not a signal), within 30 s,
print a message naming the option, never print "wrote", and show no backtrace (c10's "Exception raised from" /
"frame #", "terminate called"). Fails listing every case that did not.
"""
import concurrent.futures
import subprocess
import sys

ALWAYS_BAD = ["-1", "nan", "inf", "1e300"]

# command -> [(option, 0 refused?)]
NUMERIC = {
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
              ("--micro-batches", True), ("--conv-channels", True), ("--conv-size", True), ("--conv-layers", True)],
    "plan": [("--dim", True), ("--layers", True), ("--heads", True), ("--kv-heads", True), ("--ffn", True),
             ("--vocab", True), ("--ranks", True), ("--gpu-memory-gb", False), ("--seq", True),
             ("--micro-batch-size", True), ("--global-batch", True), ("--tflops", True), ("--link-gbps", True),
             ("--link-latency-us", False), ("--top", True), ("--max-dp", True)],
    "check-schedules": [("--ranks", True)],
}
UNWRITABLE = "/proc/twobp-nonexistent/out"  # not even root can create it
OUTPUTS = {
    "pipeline": ["--json", "--csv", "--chart", "--trace-dir"],
    "simulate": ["--json"],
    "split": ["--json"],
    "plan": ["--json"],
    "check-schedules": ["--json"],
}
BACKTRACE = ("Exception raised from", "frame #", "terminate called")


def cases():
    for command, options in NUMERIC.items():
        for option, zero_refused in options:
            for value in ALWAYS_BAD + (["0"] if zero_refused else []):
                yield command, option, value
    for command, options in OUTPUTS.items():
        for option in options:
            yield command, option, UNWRITABLE


def run(bench, case):
    command, option, value = case
    what = f"{command} {option} {value}"
    try:
        p = subprocess.run([bench, command, option, value], capture_output=True, text=True, timeout=30)
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
    if "wrote" in out:
        problems.append('printed "wrote"')
    if any(b in out for b in BACKTRACE):
        problems.append("printed a backtrace")
    if problems:
        first = out.strip().splitlines()[0] if out.strip() else "(no output)"
        return f"{what}: {', '.join(problems)}; output: {first[:200]}"
    return None


def main():
    bench = sys.argv[1]
    table = list(cases())
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(lambda c: run(bench, c), table) if f]
    if failures:
        print(f"{len(failures)} of {len(table)} bad inputs were not refused cleanly:")
        for f in failures:
            print("  " + f)
        sys.exit(1)
    print(f"{len(table)} bad inputs over {len(NUMERIC)} commands: each refused in one line naming the option")


if __name__ == "__main__":
    main()
