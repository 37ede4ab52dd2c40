#!/usr/bin/env python3
"""Two "nodes" on one machine: llama_pipeline across two Linux network namespaces gives the single-node losses.

    multinode_netns.py --example BIN [--torchrun PATH] [--mpirun PATH] --work DIR

Each namespace has only its loopback and one end of a veth pair; the pair's two addresses (10.254.0.1/24 and
10.254.0.2/24) exist only inside the two namespaces, so every byte between the "nodes" stays on this machine and
nothing else is ever addressed. Each node also gets its own host name (a UTS namespace per launch) because Open MPI
and PMIx key their session directories and locality on it. The namespaces are deleted on every exit path.

Runs (dp 2 x pp 2, four processes, two per node; --steps 3):
  * torchrun --nnodes 2 --node-rank {0,1} --master-addr 10.254.0.1: the rendezvous and twobp's TCPStore
    cross the veth; nodes hold replicas (world ranks 0,1 on node 0), so the data-parallel reduction crosses nodes.
  * mpirun from node 0 with a launch agent that enters node 1's namespace instead of ssh (plm_rsh_agent),
    --map-by node: world ranks alternate between nodes, so every pipeline message crosses nodes; Open MPI's TCP
    transport between the namespaces, no shared memory.
Each run's losses must equal the same job run as threads in one process (1e-9 relative: the same float operations
in the same order; a difference means a message was lost, duplicated or misrouted).

Exits 77 (ctest's skip) with the reason when namespaces cannot be created (not root, no CAP_NET_ADMIN, no `ip`),
or when neither launcher is available. Every launch is bounded by a timeout.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

SKIP = 77
SUBNET = "10.254.0"
RUN_TIMEOUT_S = 180
ARGS = ("--model tiny --ranks 2 --dp 2 --microbatches 4 --micro-batch-size 2 --seq-len 32 --lr 1e-2 "
        "--seed 7 --timeout 60 --steps 3 --schedule 1f1b").split()


def sh(cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


class Namespaces:
    """Two network namespaces joined by a veth pair; removed by close() (deleting a namespace deletes its end of
    the pair, and with it the other end)."""

    def __init__(self):
        tag = f"twobp{os.getpid()}"
        self.names = [f"{tag}a", f"{tag}b"]
        self.addrs = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.created = []

    def open(self):
        for n in self.names:
            sh(["ip", "netns", "add", n])
            self.created.append(n)
        va, vb = self.names[0] + "v", self.names[1] + "v"
        sh(["ip", "link", "add", va, "type", "veth", "peer", "name", vb])
        for ns, dev, addr in zip(self.names, (va, vb), self.addrs):
            sh(["ip", "link", "set", dev, "netns", ns])
            sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            sh(["ip", "-n", ns, "link", "set", dev, "up"])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        sh(enter(self.names[1], "twobp-probe") + ["ping", "-c", "1", "-W", "2", self.addrs[0]]
           if shutil.which("ping") else enter(self.names[1], "twobp-probe") + ["true"])

    def close(self):
        for n in self.created:
            sh(["ip", "netns", "del", n], check=False)
        self.created = []


def enter(ns, hostname):
    """A command prefix that runs what follows in namespace `ns` under its own host name."""
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh"]


def clean_env():
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("OMPI_", "PMI", "SLURM_", "TORCHELASTIC_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


def losses(path):
    with open(path) as f:
        return [s["loss"] for s in json.load(f)["steps"]]


def compare(name, got, want):
    if len(got) != len(want):
        return f"{name}: {len(got)} steps, the single-node run has {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if abs(g - w) > 1e-9 * abs(w):
            return f"{name}: step {k + 1} loss {g!r}, the single-node run has {w!r}"
    return None


def wait_all(procs, name, logs):
    """Waits for every process within RUN_TIMEOUT_S; kills the rest on timeout. Returns an error or None."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    error = None
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            error = f"{name}: did not finish within {RUN_TIMEOUT_S} s"
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if error is None and any(p.returncode != 0 for p in procs):
        error = f"{name}: exit statuses {[p.returncode for p in procs]}"
    if error is not None:
        for log in logs:
            with open(log) as f:
                error += f"\n--- {log}\n" + f.read()[-4000:]
    return error


def run_torchrun(a, ns, ref):
    port = "29517"
    out_json = os.path.join(a.work, "torchrun.json")
    procs, logs = [], []
    for node in (0, 1):
        log = os.path.join(a.work, f"torchrun.node{node}.log")
        cmd = enter(ns.names[node], f"twobp-node{node}") + [
            a.torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
            "--master-addr", ns.addrs[0], "--master-port", port, "--no-python", a.example] + ARGS
        if node == 0:
            cmd += ["--json", out_json]
        logs.append(log)
        procs.append(subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=clean_env()))
    error = wait_all(procs, "torchrun --nnodes 2", logs)
    if error:
        return error
    with open(logs[0]) as f:
        text = f.read()
    if "processes, torchrun + TCPStore" not in text:
        return "torchrun: the example did not report a TCPStore launch:\n" + text[-2000:]
    return compare("torchrun --nnodes 2", losses(out_json), ref)


def run_mpirun(a, ns, ref):
    # The launch agent: Open MPI calls it as `agent HOST COMMAND` where it would call ssh, COMMAND being one line
    # for the remote shell; it runs that line in the namespace holding HOST's address, under that node's host name.
    agent = os.path.join(a.work, "netns_agent.sh")
    with open(agent, "w") as f:
        f.write("#!/bin/sh\n# Open MPI's launch agent for multinode_netns.py: enter HOST's namespace instead of ssh.\n"
                "host=$1; shift\ncase $host in\n")
        for i, (n, addr) in enumerate(zip(ns.names, ns.addrs)):
            f.write(f"  {addr}) ns={n}; name=twobp-node{i} ;;\n")
        f.write('  *) echo "netns_agent: unknown host $host" >&2; exit 1 ;;\nesac\n'
                'exec ip netns exec "$ns" unshare --uts sh -c "hostname $name && $*"\n')
    os.chmod(agent, 0o755)
    out_json = os.path.join(a.work, "mpirun.json")
    log = os.path.join(a.work, "mpirun.log")
    iface = f"{SUBNET}.0/24"
    cmd = enter(ns.names[0], "twobp-node0") + [
        a.mpirun, "-np", "4", "--host", f"{ns.addrs[0]}:2,{ns.addrs[1]}:2", "--map-by", "node", "--display-map",
        "--mca", "plm_rsh_agent", agent, "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", iface,
        "--mca", "oob_tcp_if_include", iface, a.example] + ARGS + ["--json", out_json]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=clean_env())
    error = wait_all([proc], "mpirun across two namespaces", [log])
    if error:
        return error
    with open(log) as f:
        text = f.read()
    if "4 ranks (MPI)" not in text:
        return "mpirun: the example did not report an MPI launch:\n" + text[-2000:]
    # --display-map: two nodes with two ranks each, the second being the other namespace's address.
    nodes = dict(re.findall(r"Data for node: (\S+)\s+Num slots: \d+\s+Max slots: \d+\s+Num procs: (\d+)", text))
    if len(nodes) != 2 or set(nodes.values()) != {"2"} or ns.addrs[1] not in nodes:
        return f"mpirun: the job map does not show 2 ranks on each node (got {nodes}):\n" + text[:3000]
    return compare("mpirun across two namespaces", losses(out_json), ref)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--example", required=True)
    p.add_argument("--torchrun")
    p.add_argument("--mpirun")
    p.add_argument("--work", required=True)
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)

    if os.geteuid() != 0:
        print("SKIP: creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)")
        return SKIP
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            print(f"SKIP: `{tool}` is not installed")
            return SKIP
    launchers = [(name, fn) for name, fn, path in (("torchrun", run_torchrun, a.torchrun),
                                                   ("mpirun", run_mpirun, a.mpirun)) if path]
    if not launchers:
        print("SKIP: neither torchrun nor mpirun was given")
        return SKIP

    ref_json = os.path.join(a.work, "threads.json")
    r = sh([a.example] + ARGS + ["--json", ref_json], check=False, env=clean_env(), timeout=RUN_TIMEOUT_S)
    if r.returncode != 0:
        print("FAIL: the single-node run (threads) failed:\n" + r.stdout)
        return 1
    ref = losses(ref_json)

    ns = Namespaces()
    try:
        try:
            ns.open()
        except subprocess.CalledProcessError as e:
            print(f"SKIP: cannot create network namespaces here: {' '.join(e.cmd)}: {e.stdout.strip()}")
            return SKIP
        failures = []
        for name, fn in launchers:
            error = fn(a, ns, ref)
            print(f"{'FAIL' if error else 'ok'}: {name} across two namespaces" + (f": {error}" if error else
                  f", losses {', '.join(f'{x:.6f}' for x in ref)} equal the single-node run"))
            if error:
                failures.append(name)
        return 1 if failures else 0
    finally:
        ns.close()


if __name__ == "__main__":
    sys.exit(main())
