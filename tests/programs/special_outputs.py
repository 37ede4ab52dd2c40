#!/usr/bin/env python3
"""The programs' output files when the path is not a plain file: a symbolic link, a FIFO, a device node.

Each program's --json goes through twobp::write_file. A symbolic link must survive, and its target must get the
document. A FIFO must stay a FIFO, and its reader must get the document. A private copy of /dev/null (made with
mknod, root only; skipped otherwise, with the reason) must stay a device node. A private copy of /dev/full must
make the run fail (non-zero status, a message naming the file and "No space left on device") without a "wrote" line.
The system's own /dev nodes are never touched.

Usage: special_outputs.py [--bench TWOBP_BENCH] [--example LLAMA_PIPELINE] WORK_DIR
"""
import argparse
import json
import os
import shutil
import stat
import subprocess
import threading

# One quick run of each program, with the output path appended.
RUNS = {
    "bench": ["simulate", "--ranks", "2", "--microbatches", "2", "--schedule", "1f1b", "--json"],
    "example": ["--steps", "1", "--json"],
}


def run(program, path):
    kind = "bench" if os.path.basename(program) == "twobp_bench" else "example"
    return subprocess.run([program] + RUNS[kind] + [path], capture_output=True, text=True, timeout=120)


def check(name, program, work):
    problems = []
    def expect(cond, text):
        if not cond:
            problems.append(f"{name}: {text}")

    # A symbolic link (relative): the link stays, its target holds the document.
    target = os.path.join(work, "target.json")
    link = os.path.join(work, "link.json")
    os.symlink("target.json", link)
    p = run(program, link)
    expect(p.returncode == 0, f"through a link: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    expect(os.path.islink(link), "the symbolic link was replaced")
    try:
        with open(target) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        expect(False, f"the link's target holds no JSON document ({e})")

    # A FIFO: written in place, once, to its reader.
    fifo = os.path.join(work, "pipe.json")
    os.mkfifo(fifo)
    received = {}
    reader = threading.Thread(target=lambda: received.setdefault("text", open(fifo).read()))
    reader.start()
    p = run(program, fifo)
    reader.join(timeout=60)
    expect(p.returncode == 0, f"to a FIFO: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    expect(stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced")
    try:
        json.loads(received.get("text", ""))
    except ValueError as e:
        expect(False, f"the FIFO's reader got no single JSON document ({e})")

    # Private device nodes: /dev/null's (1, 3) and /dev/full's (1, 7).
    null_node, full_node = os.path.join(work, "null"), os.path.join(work, "full")
    try:
        os.mknod(null_node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.mknod(full_node, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except OSError as e:
        print(f"{name}: device nodes skipped: mknod failed ({e.strerror}; needs root with CAP_MKNOD)")
        return problems
    p = run(program, null_node)
    expect(p.returncode == 0, f"to a null device: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    p = run(program, full_node)
    out = p.stdout + p.stderr
    expect(0 < p.returncode < 128, f"to a full device: exit {p.returncode}, expected a failure")
    expect(full_node in out and "No space left on device" in out, f"to a full device: message {out.strip()[-300:]!r}")
    expect("wrote " + full_node not in out, "to a full device: said it wrote the file")
    for node in (null_node, full_node):
        expect(stat.S_ISCHR(os.lstat(node).st_mode), f"{node} was replaced")
    return problems


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench")
    parser.add_argument("--example")
    parser.add_argument("work")
    args = parser.parse_args()
    problems = []
    for name, program in (("bench", args.bench), ("example", args.example)):
        if not program:
            continue
        work = os.path.join(args.work, name)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        problems += check(name, program, work)
        print(f"{name}: link, FIFO and device nodes checked")
    shutil.rmtree(args.work, ignore_errors=True)
    if problems:
        raise SystemExit("\n".join(problems))


if __name__ == "__main__":
    main()
