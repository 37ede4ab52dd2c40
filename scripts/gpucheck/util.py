"""Helpers every part of the GPU check uses: where the tree is, the clock, shortening text and commands for a log
line, writing JSON atomically, sizes of what travels to the device."""

import json
import os
import re
import shlex
import subprocess
import time

# The source tree (scripts/gpucheck/util.py -> the root).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def now():
    return time.monotonic()


def tail_lines(text, n=3, limit=400, prefer=None):
    """The last n meaningful lines of text (those matching prefer, when any do), at most limit characters."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    lines = [l for l in lines if not re.match(r"^\[\d+/\d+\] ", l)] or lines  # ninja progress lines
    if prefer:
        hits = [l for l in lines if re.search(prefer, l)]
        if hits:
            lines = hits[:2] + ([lines[-1]] if lines[-1] not in hits[:2] else [])
            n = len(lines)
    out = " | ".join(lines[-n:])
    return out if len(out) <= limit else "..." + out[-limit:]


def show(cmd):
    """A command as a shell line, long arguments (an inline script) shortened."""
    return " ".join(shlex.quote(a if len(a) <= 160 else " ".join(a[:80].split()) + " ... [%d chars]" % len(a))
                    for a in map(str, cmd))


def head_tail(data, head, tail):
    """data (bytes) whole, or its first head and last tail bytes with a note of what was cut between them."""
    if len(data) <= head + tail:
        return data
    cut = len(data) - head - tail
    return data[:head] + b"\n... [%d bytes cut by gpu_check] ...\n" % cut + data[-tail:]


def write_json(path, obj):
    """Writes obj as JSON to path atomically (a reader never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def load_json(path):
    with open(path) as f:
        return json.load(f)


def dir_bytes(path):
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(base, f)).st_size
            except OSError:
                pass
    return total


def tree_bytes():
    """Bytes of the files that travel to the device: tracked and untracked-but-not-ignored."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for rel in filter(None, out.split(b"\0")):
        try:
            total += os.lstat(os.path.join(ROOT.encode(), rel)).st_size
        except OSError:
            pass
    return total


def relative_difference(x, y):
    return abs(x - y) / max(abs(y), 1e-12)
