#!/usr/bin/env python3
"""Starts N processes of one command as torchrun would, without MPI or torch: each gets RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, where rank 0 serves the TCPStore
(twobp/transport/launch.h) that bootstraps NCCL. With --one-gpu every rank also gets its own NCCL_HOSTID and
NCCL's socket transport over lo, so that NCCL accepts several ranks of one communicator on the same GPU (as
tests/transport/nccl_processes_test.cpp does).

usage: launch.py --nproc N [--one-gpu] [--grace SECONDS] -- COMMAND [ARGS...]

Each line a rank prints comes out prefixed "[rank R] ". Exit status: 0 when every rank exited 0; otherwise the
first failure's status (a rank killed by a signal: 128 + the signal). After the first failure the others get
--grace seconds to fail on their own (their waits time out naming the dead peer), then SIGTERM. Stdlib only;
run it in its own process group to be able to kill every rank at once (the GPU check's pieces are).
"""

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port():
    """A port of 127.0.0.1 that was free a moment ago, from the 12,000 below the kernel's ephemeral range (rank 0's
    store binds it moments later). A port the kernel hands out by itself -- to any connect(), to another launcher's
    daemons -- could be taken in between, and the store's clients would then retry against another listener; below
    the range, ports are only ever taken on purpose. tests/transport/fault_contract.py uses this one too."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    for _ in range(64):
        port = random.randrange(first, max(first + 1, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port below the ephemeral range")


def rank_env(rank, nproc, port, one_gpu):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")  # NcclTransport requires eager kernel loading
    if one_gpu:
        env.update(NCCL_HOSTID="gpu-check-rank%d" % rank, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    return env


def pump(stream, prefix, lock):
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()
    stream.close()


def status_of(code):
    return 128 - code if code < 0 else code


def main(argv):
    ap = argparse.ArgumentParser(prog="launch.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--one-gpu", action="store_true", help="all ranks share one GPU (distinct NCCL_HOSTIDs)")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds the others get after the first failure")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nproc < 1 or not cmd:
        ap.error("needs --nproc N >= 1 and a command after --")
    port = free_port()
    print("launch: %d processes, MASTER_ADDR=127.0.0.1 MASTER_PORT=%d%s: %s" % (
        args.nproc, port, ", one GPU (NCCL_HOSTID per rank, sockets on lo)" if args.one_gpu else "",
        " ".join(cmd)), flush=True)
    lock = threading.Lock()
    procs, pumps = [], []
    for r in range(args.nproc):
        p = subprocess.Popen(cmd, env=rank_env(r, args.nproc, port, args.one_gpu), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        t = threading.Thread(target=pump, args=(p.stdout, b"[rank %d] " % r, lock), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    first_failure, failed_at = None, None
    while any(p.poll() is None for p in procs):
        for r, p in enumerate(procs):
            if first_failure is None and p.poll() not in (None, 0):
                first_failure, failed_at = (r, status_of(p.returncode)), time.monotonic()
                print("launch: rank %d exited with %d; the others get %.0f s" % (r, first_failure[1], args.grace),
                      flush=True)
        if failed_at is not None and time.monotonic() - failed_at > args.grace:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            failed_at = float("inf")
        time.sleep(0.1)
    end = time.monotonic() + 5  # a rank's own children may hold its pipe open: wait for the output a while only
    for t in pumps:
        t.join(timeout=max(0.0, end - time.monotonic()))
    codes = [status_of(p.returncode) for p in procs]
    print("launch: exit statuses %s" % codes, flush=True)
    if first_failure is None and any(codes):
        first_failure = next((r, c) for r, c in enumerate(codes) if c)
    return first_failure[1] if first_failure else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
