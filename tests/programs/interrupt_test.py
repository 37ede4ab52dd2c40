#!/usr/bin/env python3
"""llama_pipeline interrupted (rank threads): SIGINT, then SIGTERM, sent after a few steps of a long run.

Each run must end within 60 s of the signal with the shell's status for it (130, 143) and a line saying so and what
was written; its --json holds exactly the steps done (as many as that line says, numbered from 0), its --trace is
there, its checkpoint is of the last step done, and no .tmp file is left in the work directory or the checkpoint.
With --bench: `twobp_bench pipeline` interrupted as its third configuration starts keeps the configurations it
finished (its --json has as many results as its line says, at least 2 of 6) and exits 130; `twobp_bench split`
interrupted after its first two hundred repetitions reports the medians of those done (its line says how many, its
--json config too) and exits 130. With --mpiexec: the
same run as 2 MPI processes, SIGINT sent to mpiexec (which forwards SIGTERM to the ranks): the outputs and the line
as above; the exit status is mpiexec's own and not checked.

Usage: interrupt_test.py LLAMA_PIPELINE WORK_DIR [--bench TWOBP_BENCH] [--mpiexec MPIEXEC]
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import time

from program_runs import MPI_FLAGS

STEPS_BEFORE = 3  # the signal goes once the checkpoint of this step is there


def manifest_step(ck):
    try:
        with open(os.path.join(ck, "manifest.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return -1


def interrupted_run(example, work, sig, status, mpiexec=None):
    """status None: under mpiexec, whose own exit status it is; the ranks get the SIGTERM mpiexec forwards."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out_json, trace, ck = (os.path.join(work, name) for name in ("run.json", "trace.json", "ck"))
    launcher = [mpiexec, "-n", "2", *MPI_FLAGS] if mpiexec else []
    p = subprocess.Popen([*launcher, example, "--steps", "100000", "--checkpoint-dir", ck, "--checkpoint-every", "1",
                          "--json", out_json, "--trace", trace], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    deadline = time.time() + 240
    while manifest_step(ck) < STEPS_BEFORE:
        assert p.poll() is None, f"the run ended before it was interrupted: {p.stdout.read()}"
        assert time.time() < deadline, "no checkpoint of step 3 within 240 s"
        time.sleep(0.05)
    p.send_signal(sig)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"{sig.name}: the run did not end within 60 s")
    name = sig.name + (" under mpiexec" if mpiexec else "")
    if status is None:
        said = r"(?:SIGINT|SIGTERM)"
        status_said = r"(?:130|143)"
    else:
        assert p.returncode == status, f"{name}: exit status {p.returncode}, expected {status}:\n{out}"
        said, status_said = sig.name, str(status)
    line = re.search(rf"interrupted by {said} after step (\d+) of 100000: wrote (.*); exit status {status_said}", out)
    assert line, f"{name}: no line saying what was written:\n{out}"
    done = int(line.group(1))
    assert done >= STEPS_BEFORE, f"{name}: stopped after step {done}"
    for path in (out_json, trace, ck):
        assert path in line.group(2), f"{name}: '{path}' not said written: {line.group(0)}"
    with open(out_json) as f:
        steps = [s["step"] for s in json.load(f)["steps"]]
    assert steps == list(range(done)), f"{name}: --json has steps {steps}, expected 0 .. {done - 1}"
    with open(trace) as f:
        assert json.load(f), f"{name}: empty trace"
    assert manifest_step(ck) == done, f"{name}: checkpoint of step {manifest_step(ck)}, expected {done}"
    left = glob.glob(os.path.join(work, "**", "*.tmp"), recursive=True)
    assert not left, f"{name}: temporary files left: {left}"
    print(f"{name}: stopped after step {done}, exit {p.returncode}, outputs complete")


def signalled(what, cmd, ready, timeout):
    """Runs cmd, sends SIGINT once a line of its output satisfies ready(line), and returns (exit status, output).
    Fails when no line did or it did not end within `timeout` seconds of the signal."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if ready(line):
            p.send_signal(signal.SIGINT)
            break
    else:
        raise AssertionError(f"{what}: no line to send the signal on:\n" + "".join(lines))
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"{what}: did not end within {timeout} s of SIGINT")
    out = "".join(lines) + out
    assert p.returncode == 130, f"{what}: exit status {p.returncode}, expected 130:\n{out}"
    return out


def interrupted_bench(bench, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out_json = os.path.join(work, "pipeline.json")
    # The progress lines come as each configuration starts.
    out = signalled("bench", [bench, "pipeline", "--schedule", "1f1b,gpipe,zb-h1", "--mode", "both", "--steps", "30",
                              "--warmup", "1", "--dim", "64", "--layers", "4", "--seq", "32", "--json", out_json],
                    lambda line: "configuration 3/6" in line, 120)
    line = re.search(r"interrupted by SIGINT: (\d+) of 6 configurations finished", out)
    assert line, f"bench: no line saying what was kept:\n{out}"
    done = int(line.group(1))
    assert 2 <= done < 6, f"bench: {done} configurations finished, expected 2 to 5:\n{out}"
    with open(out_json) as f:
        results = json.load(f)["results"]
    assert len(results) == done, f"bench: --json has {len(results)} results, expected {done}"
    print(f"bench: kept {done} of 6 configurations, exit 130")


def interrupted_split(bench, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out_json = os.path.join(work, "split.json")
    # A progress line every tenth of the run: the signal goes once 200 repetitions are timed.
    past = lambda line: int((re.search(r"repetition (\d+)/", line) or [0, 0])[1]) > 101  # noqa: E731
    out = signalled("split", [bench, "split", "--repeats", "2000", "--warmup", "1", "--dim", "32", "--layers", "1",
                              "--seq", "8", "--batch", "1", "--threads", "1", "--no-conv", "--paths", "fast",
                              "--json", out_json], past, 60)
    line = re.search(r"interrupted by SIGINT after (\d+) of 2000 timed repetitions; reporting those", out)
    assert line, f"split: no line saying what was kept:\n{out}"
    done = int(line.group(1))
    assert 100 <= done < 2000, f"split: {done} repetitions, expected 100 to 1999:\n{out}"
    with open(out_json) as f:
        result = json.load(f)
    assert result["config"]["repeats"] == done and result["config"]["interrupted"] == "SIGINT", result["config"]
    assert result["fast"]["spread"]["fused_ms"]["n"] == done, result["fast"]["spread"]["fused_ms"]
    print(f"split: kept {done} of 2000 repetitions, exit 130")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("example")
    parser.add_argument("work")
    parser.add_argument("--bench")
    parser.add_argument("--mpiexec")
    args = parser.parse_args()
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        interrupted_run(args.example, os.path.join(args.work, sig.name.lower()), sig, status)
    if args.bench:
        interrupted_bench(args.bench, os.path.join(args.work, "bench"))
        interrupted_split(args.bench, os.path.join(args.work, "split"))
    if args.mpiexec:
        interrupted_run(args.example, os.path.join(args.work, "mpi"), signal.SIGINT, None, args.mpiexec)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
