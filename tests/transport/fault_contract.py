#!/usr/bin/env python3
"""The fault contract over every transport: each fault x transport cell either gives the fault-free result or ends
every rank in time with an error naming the fault's rank and message -- never a hang, never a different result.

    fault_contract.py --probe BIN [--mpiexec PATH [--mpiexec-flag F ...]] [--markdown FILE] [--jobs N]

A corrupted message gives a different result unless PipelineOptions::verify_messages is on (the "corrupt" row
expects exactly that, so the table also proves the suite detects a wrong result); with it, a clear error.

Each cell runs fault_contract_probe (2 steps of 1F1B with 2BP on 4 ranks, each step followed by a reduce-scatter and
all-gather of the ranks' flat gradients -- blocking, then async -- through the same fault and checksum wrappers,
which pass collectives untouched; the gradients, losses and gathered sums checked against one process):
  local-by-tag, local-in-order  4 rank threads in one process (Local transport, both pairing rules)
  store                         4 processes meeting at a c10d TCPStore (torchrun-like environment)
  mpi                           mpiexec -n 4 (when --mpiexec is given)
Cells run --jobs at a time (default 2: most of a cell is processes starting and waits for timeouts). Prints the
table (markdown with --markdown) and exits 1 when a cell breaks the contract.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "gpucheck"))
from launch import free_port  # noqa: E402  (the store's port: below the kernel's ephemeral range)

RANKS = 4
LIMIT_S = 60       # a cell still running after this is a hang
ERROR_LIMIT_S = 30  # an error cell must end every rank within this

# "+verify": with PipelineOptions::verify_messages (per-message checksums).
FAULTS = ["none", "delay", "reorder", "duplicate", "drop", "fail-send", "die", "corrupt", "corrupt+verify",
          "none+verify"]
# What each error must name (every fault is injected as in fault_contract_probe.cpp).
NAMES = {
    "drop": ["rank 1", "micro-batch", "timed out"],
    "fail-send": ["rank 2: send of", "failed (injected fault)"],
    "die": ["rank 3 died after 4 messages"],
    "duplicate": ["expected tag"],
    "corrupt+verify": ["checksum mismatch", "from rank 1", "corrupted in transit"],
}


def expected(transport, fault):
    if fault in ("none", "delay", "reorder", "none+verify"):
        return "same"
    if fault == "corrupt":
        # Without checksums a flipped bit is a different result: what verify_messages exists for. The row also
        # shows that this suite tells a different result from the right one.
        return "different"
    if fault == "duplicate":
        # By tag the copy is never matched; in order it takes the next message's place and is refused.
        return "error" if transport == "local-in-order" else "same"
    return "error"


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def launch(a, transport, fault):
    """Starts the cell's processes; returns them (stdout+stderr piped)."""
    env = clean_env()
    if transport.startswith("local"):
        return [subprocess.Popen([a.probe, transport, fault], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=env)]
    if transport == "store":
        port = str(free_port())
        procs = []
        for r in range(RANKS):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(RANKS),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            procs.append(subprocess.Popen([a.probe, "store", fault], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, env=e))
        return procs
    return [subprocess.Popen([a.mpiexec, "-n", str(RANKS)] + a.mpiexec_flag + [a.probe, "mpi", fault],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)]


def run_cell(a, transport, fault):
    """Returns (outcome, seconds, output): outcome is "same", "error", "different" or "hang"."""
    t0 = time.monotonic()
    procs = launch(a, transport, fault)
    outputs, hung = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, LIMIT_S - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
    seconds = time.monotonic() - t0
    output = "\n".join(outputs)
    if hung:
        return "hang", seconds, output
    codes = [p.returncode for p in procs]
    if any(c == 3 for c in codes) or "DIFFERENT result" in output:
        return "different", seconds, output
    if all(c == 0 for c in codes) and output.count(": same result") == RANKS:
        return "same", seconds, output
    return "error", seconds, output


def check(transport, fault, outcome, seconds, output):
    """None when the cell keeps the contract, else why not."""
    want = expected(transport, fault)
    if outcome != want:
        return f"expected {dict(same='the fault-free result', error='a clear error').get(want, want)}, got {outcome}"
    if outcome == "error":
        if seconds > ERROR_LIMIT_S:
            return f"the error took {seconds:.0f} s (limit {ERROR_LIMIT_S} s)"
        missing = [n for n in NAMES.get(fault, []) if n not in output]
        if missing:
            return f"the errors do not name {missing}"
        if transport != "mpi" and output.count(": error after") != RANKS:
            # MPI_Abort ends the job from the first failing rank; elsewhere every rank must report.
            return f"{output.count(': error after')} of {RANKS} ranks reported an error"
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--probe", required=True)
    p.add_argument("--mpiexec")
    p.add_argument("--mpiexec-flag", action="append", default=[])
    p.add_argument("--markdown")
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    transports = ["local-by-tag", "local-in-order", "store"] + (["mpi"] if a.mpiexec else [])

    cells = [(fault, transport) for fault in FAULTS for transport in transports]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        results = dict(zip(cells, pool.map(lambda cell: run_cell(a, cell[1], cell[0]), cells)))
    rows, failures = [], []
    for fault in FAULTS:
        row = []
        for transport in transports:
            outcome, seconds, output = results[(fault, transport)]
            problem = check(transport, fault, outcome, seconds, output)
            text = {"same": "same result", "error": "clear error", "different": "DIFFERENT RESULT",
                    "hang": "HANG"}[outcome] + f" ({seconds:.1f} s)"
            if problem:
                text = "FAIL: " + text
                failures.append(f"{fault} over {transport}: {problem}\n{output[-3000:]}")
            row.append(text)
            print(f"{fault:>10} over {transport:<15} {text}", flush=True)
        rows.append((fault, row))

    table = ["| fault | " + " | ".join(transports) + " |", "| --- |" + " --- |" * len(transports)]
    table += [f"| {fault} | " + " | ".join(row) + " |" for fault, row in rows]
    print("\n".join(table))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(table) + "\n")
    for f in failures:
        print("\nFAIL: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
