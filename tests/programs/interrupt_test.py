#!/usr/bin/env python3
"""llama_pipeline interrupted (rank threads): SIGINT, then SIGTERM, sent after a few steps of a long run.

Each run must end within 60 s of the signal with the shell's status for it (130, 143) and a line saying so and what
was written; its --json holds exactly the steps done (as many as that line says, numbered from 0), its --trace is
there, its checkpoint is of the last step done, and no .tmp file is left in the work directory or the checkpoint.
A signal during a long evaluation stops it between batches.
With --bench: `twobp_bench pipeline` interrupted as its third configuration starts keeps the configurations it
finished (its --json has as many results as its line says, at least 2 of 6) and exits 130; `twobp_bench split`
interrupted after its first two hundred repetitions reports the medians of those done (its line says how many, its
--json config too) and exits 130. With --mpiexec: the
same run as 2 MPI processes, SIGINT sent to mpiexec (which forwards SIGTERM to the ranks): the outputs and the line
as above; the exit status is mpiexec's own and not checked. Then a launcher that kills the ranks right after its
signal (mpirun does 1-2 s later, which a long step outlasts): the example and `twobp_bench pipeline` (under mpiexec
when given) acknowledge the signal at once on their output, and the --json they wrote as they went is on disk after
the SIGKILL: the steps done so far (at least 3, "complete": false) and the configurations finished (at least 2).

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


def interrupted_evaluation(example, work):
    """A signal during a long evaluation (4096 held-out batches, tens of seconds) stops it between batches: the run
    ends within 60 s with 130 and says after how many batches."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # stdbuf: the example's stdout is line-buffered, so its first line arrives as it is printed.
    out = signalled("evaluation", ["stdbuf", "-oL", example, "--steps", "10", "--eval-every", "1", "--eval-batches",
                                   "4096"],
                    # the guard is made just after this line is printed: a second for it, then the signal
                    lambda line: line.startswith("llama_pipeline: model") and (time.sleep(1) or True), 60)
    line = re.search(r"evaluation stopped by the interrupt after (\d+) of 4096 batches", out)
    assert line and int(line.group(1)) < 4096, f"evaluation: no line saying it stopped early:\n{out}"
    print(f"evaluation: stopped after {line.group(1)} of 4096 batches, exit 130")


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


def read_json_or_none(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def session_members(sid):
    """The processes of session `sid` (mpiexec may give its ranks process groups of their own, not sessions)."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
        except (OSError, IndexError, ValueError):
            continue
        if entry.isdigit() and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def kill_session(sid):
    """SIGKILLs every process of session `sid` and waits (10 s at most) until none is left running."""
    deadline = time.time() + 10
    while True:
        members = session_members(sid)
        alive = []
        for pid in members:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if not alive:
            return
        assert time.time() < deadline, f"processes of session {sid} still running after SIGKILL: {alive}"
        time.sleep(0.05)


def killed(what, cmd, out_json, ready, work, signal_first):
    """A launcher that kills its ranks (mpirun does 1-2 s after forwarding a signal, which a long step outlasts; a
    scheduler's time limit does so at once): runs cmd in a session of its own, waits until ready(--json so far)
    holds, then, with signal_first, sends SIGINT and waits for the acknowledgement line ("interrupt: SIG...
    received: finishing ..."), and SIGKILLs the whole session. Returns the --json left on disk."""
    log_path = os.path.join(work, what + ".log")
    if os.path.exists(out_json):
        os.remove(out_json)
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not ready(read_json_or_none(out_json)):
            assert p.poll() is None, f"{what}: ended before the signal:\n{open(log_path).read()}"
            assert time.time() < deadline, f"{what}: --json not written as the run went (240 s)"
            time.sleep(0.05)
        if signal_first:
            p.send_signal(signal.SIGINT)
            deadline = time.time() + 10
            while not re.search(r"interrupt: SIG(INT|TERM) received: finishing \S+ \d+ of \d+", open(log_path).read()):
                assert time.time() < deadline, f"{what}: no acknowledgement within 10 s:\n{open(log_path).read()}"
                time.sleep(0.05)
    finally:
        kill_session(p.pid)
        p.wait()
    left = read_json_or_none(out_json)
    assert left is not None, f"{what}: no readable --json after the kill"
    return left


def killed_runs(example, bench, work, mpiexec):
    """The example and the bench killed by their launcher: what finished is on disk, and a signal before the kill is
    acknowledged at once."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    launcher = [mpiexec, "-n", "2", *MPI_FLAGS] if mpiexec else []
    where = " under mpiexec" if mpiexec else ""
    for signal_first in (False, True):
        out_json = os.path.join(work, f"run{int(signal_first)}.json")
        doc = killed(f"example{int(signal_first)}", [*launcher, example, "--steps", "100000", "--json", out_json],
                     out_json, lambda d: d is not None and len(d["steps"]) >= 3, work, signal_first)
        steps = [s["step"] for s in doc["steps"]]
        assert steps == list(range(len(steps))) and len(steps) >= 3, steps
        # Killed without a signal, the file is one written as the run went; after one, the final write may win.
        assert signal_first or doc["complete"] is False, doc["complete"]
        print(f"example{where}: killed{' after SIGINT (acknowledged)' if signal_first else ''}, "
              f"{len(steps)} steps on disk")
    if not bench:
        return
    out_json = os.path.join(work, "pipeline.json")
    doc = killed("bench", [*launcher, bench, "pipeline", "--schedule", "1f1b,gpipe,zb-h1", "--mode", "both",
                           "--steps", "30", "--warmup", "1", "--dim", "64", "--layers", "4", "--seq", "32",
                           "--json", out_json], out_json, lambda d: d is not None and len(d["results"]) >= 2, work,
                 signal_first=True)
    finished = doc["config"]["configurations"]["finished"]
    assert len(doc["results"]) == finished >= 2 and doc["config"]["configurations"]["of"] == 6, doc["config"]
    print(f"bench{where}: killed after SIGINT (acknowledged), {finished} of 6 configurations on disk")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("example")
    parser.add_argument("work")
    parser.add_argument("--bench")
    parser.add_argument("--mpiexec")
    args = parser.parse_args()
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        interrupted_run(args.example, os.path.join(args.work, sig.name.lower()), sig, status)
    interrupted_evaluation(args.example, os.path.join(args.work, "evaluation"))
    if args.bench:
        interrupted_bench(args.bench, os.path.join(args.work, "bench"))
        interrupted_split(args.bench, os.path.join(args.work, "split"))
    if args.mpiexec:
        interrupted_run(args.example, os.path.join(args.work, "mpi"), signal.SIGINT, None, args.mpiexec)
    killed_runs(args.example, args.bench, os.path.join(args.work, "killed"), args.mpiexec)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
