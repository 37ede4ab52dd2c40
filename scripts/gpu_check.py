#!/usr/bin/env python3
"""The GPU check's orchestrator (stdlib only, Python >= 3.9). Run it through scripts/gpu_check.sh, whose header
describes the usage, the environment and the eight output files.

Every step is a *piece*: a command under its own timeout, in its own process group (killed as a group: SIGTERM,
then SIGKILL after a grace period), recorded as {name, status: pass|fail|timeout|skipped, seconds, detail}. One
overall deadline bounds the run: a piece's timeout is min(its own, what is left), and a piece that no longer fits
(less left than the minimum it declares) is recorded as skipped with the reason. summary.json is always written:
in a finally clause, after SIGTERM/SIGINT/SIGHUP, and after a crash of this script.
"""

import argparse
import datetime
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = ("pass", "fail", "timeout", "skipped")

# What comes back: at most 8 files, each <= 16 MiB. The logs are kept far below that.
MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
LOG_CAP = 2 << 20          # each log: its first LOG_HEAD bytes and its last LOG_CAP - LOG_HEAD
LOG_HEAD = 256 << 10
PIECE_HEAD = 32 << 10      # each piece's output in a log: its first PIECE_HEAD and last PIECE_TAIL bytes
PIECE_TAIL = 480 << 10

SUMMARY_RESERVE_S = 10     # left for the summary at the end of the deadline
KILL_GRACE_S = 5           # SIGTERM -> SIGKILL
# An injected hang (GPU_CHECK_INJECT) tests the kill path: its piece times out after this long, whatever its own
# timeout, so that the check of it (tests/scripts, gpu_check_injected) does not wait for nothing.
INJECTED_HANG_S = 3
THIRD_PARTY_MAX_MIB = 48   # with the tree, under the device's 64 MiB carry limit
PREBUILT = os.path.join(ROOT, ".gpu-prebuilt")   # `prebuild`: GPU binaries built here, carried (git-ignored)
PREBUILT_MAX_MIB = 24      # with .third_party and the tree, under the 64 MiB carry limit
PREBUILT_BUILD = os.path.join(ROOT, "build-gpu-carry")
# What the binaries are built from: the carried ones are used only when these hash the same there as here.
DIGEST_PATHS = ("CMakeLists.txt", "cmake", "include", "src", "tests", "benchmarks", "examples")

# The GPU measurement: one 7B stage (LLaMa-7B blocks), all bfloat16 (split does not time mixed precision yet), batch
# 1; the dry run: a tiny fp32 model on the CPU.
MEASURE_GPU = dict(device="cuda", dtype="bf16-pure", dim=4096, ffn=11008, heads=32, layers=8, seqs=(1024, 4096),
                   repeats=10)
MEASURE_DRY = dict(device="cpu", dtype="fp32", dim=64, ffn=176, heads=4, layers=2, seqs=(16, 32), repeats=2)
# The example, whole training steps (AdamW, clipping, the data loader): ranks as threads on the one GPU, with 2BP and
# without, the same seed. On one shared GPU the two take the same total work, so their throughput ratio is NOT a
# pipeline speedup; the pieces show that the example trains on a GPU (losses, gradient norms, tokens/s).
EXAMPLE_GPU = dict(device="cuda", model="1b", dtype="bf16", ranks=4, schedule="1f1b", microbatches=8, seq_len=1024,
                   steps=8)
EXAMPLE_DRY = dict(device="cpu", model="tiny", dtype="fp32", ranks=2, schedule="1f1b", microbatches=4, seq_len=64,
                   steps=3)
# The example's memory estimate (its --dry-run) against the peak tensor memory of real steps: the whole 7B model as
# one rank (the only layout whose memory one GPU can measure: rank threads sharing a GPU share its allocator's
# statistics), bf16 (bf16 weights, gradients and AdamW state: ~8 bytes per parameter, ~60 GiB), with 2BP and
# without. Run after the tests (the longest piece: the model is built on the CPU first).
EXAMPLE_MEMORY_GPU = dict(device="cuda", model="7b", dtype="bf16-pure", ranks=1, schedule="1f1b", microbatches=4,
                          micro_batch_size=1, seq_len=1024, steps=3)
EXAMPLE_MEMORY_DRY = dict(device="cpu", model="tiny", dtype="fp32", ranks=1, schedule="1f1b", microbatches=4,
                          micro_batch_size=1, seq_len=64, steps=3)
MEMORY_ESTIMATE_SLACK = 1.10  # measured peak <= this x the estimate (an estimate that says "fits" must hold)
# Pieces that run only when an --only glob names them: the 7B memory pieces (~150 s) do not fit a full run's 8
# minutes beside everything else, so they get a run of their own (`--only 'measure:example_memory*'`).
OPT_IN = ("measure:example_memory*",)

# TWOBP_TEST_STACKS_ON_HANG: a multi-process test prints its stuck ranks' stacks before killing them
# (tests/common/spawn_ranks.h): a hang costs no second loan to locate.
TEST_ENV_DEFAULTS = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_MNNVL_ENABLE": "0",
                     "TWOBP_TEST_STACKS_ON_HANG": "1"}
LAST_PATTERN = "*FourRanks*"          # test cases run after everything else (the 4-rank NCCL test)
HELPER_SUITES = ("NcclRank",)         # suites that only run as child processes of another test
PER_CASE_MAX = 8                      # suites of at most this many cases run one piece per case (own timeout)

NVIDIA_SMI_FIELDS = ("name", "memory.total", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem",
                     "clocks.max.mem", "compute_mode", "persistence_mode", "pstate", "temperature.gpu",
                     "power.draw", "power.limit", "pci.bus_id")

TORCH_PROBE = r"""
import importlib.util, json, os, re, sys
spec = importlib.util.find_spec("torch")
root = os.path.dirname(spec.origin) if spec else None
print("TORCH_ROOT=" + (root or ""), flush=True)
info = {"python": sys.version.split()[0], "torch_root": root}
if root:
    try:
        for line in open(os.path.join(root, "version.py")):
            m = re.match(r"^(__version__|cuda)\b[^=]*=\s*['\"]?([^'\"\n]*)", line)
            if m:
                info["file_" + m.group(1).strip("_")] = m.group(2).strip()
    except OSError:
        pass
print("TORCH_FILE_INFO=" + json.dumps(info), flush=True)
import torch
info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
try:
    info["cudnn"] = torch.backends.cudnn.version()
except Exception as e:
    info["cudnn"] = "error: %s" % e
if info["cuda_available"]:
    info["device_count"] = torch.cuda.device_count()
    p = torch.cuda.get_device_properties(0)
    info["device"] = {"name": p.name, "capability": "%d.%d" % (p.major, p.minor),
                      "memory_gib": round(p.total_memory / 2**30, 2), "multiprocessors": p.multi_processor_count}
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        info["nccl"] = "error: %s" % e
print("TORCH_INFO=" + json.dumps(info), flush=True)
"""


class Interrupted(BaseException):
    """Raised in the main thread by the signal handler."""


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
    if len(data) <= head + tail:
        return data
    cut = len(data) - head - tail
    return data[:head] + b"\n... [%d bytes cut by gpu_check] ...\n" % cut + data[-tail:]


def read_text(path, limit=None):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ""
    if limit is not None:
        data = head_tail(data, limit // 4, limit - limit // 4)
    return data.decode("utf-8", "replace")


def group_alive(pgid):
    """Whether a process (not a zombie) of process group pgid remains."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for pid in pids:
        try:
            with open("/proc/%s/stat" % pid) as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            return True
    return False


def kill_group(pgid, grace):
    """SIGTERM to the group, SIGKILL after grace seconds if any member is left. Returns (whether the group is
    gone, the last signal sent)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True, sig.name
        except PermissionError:
            pass
        end = now() + wait
        while now() < end:
            if not group_alive(pgid):
                return True, sig.name
            time.sleep(0.1)
    return not group_alive(pgid), "SIGKILL"


class GtestStream:
    """Results of gtest's streaming output, restricted to the expected case names (children of a multi-process
    test print their own [ RUN ]/[ OK ] lines into the same stream)."""

    MARKS = {"[       OK ] ": "passed", "[  FAILED  ] ": "failed", "[  SKIPPED ] ": "skipped"}

    def __init__(self, text, expected):
        self.expected = list(expected)
        want = set(self.expected)
        self.result, self.excerpt = {}, {}
        self.running = None
        lines = []
        for line in text.splitlines():
            if line.startswith("[ RUN      ] "):
                name = line[13:].split()[0] if line[13:].split() else ""
                if name in want:
                    self.running, lines = name, []
                continue
            mark = next((m for m in self.MARKS if line.startswith(m)), None)
            if mark:
                words = line[len(mark):].split()
                name = words[0].rstrip(",") if words else ""
                if name in want and name not in self.result:
                    self.result[name] = self.MARKS[mark]
                    self.excerpt[name] = "\n".join(lines[-15:])[-1500:]
                    if self.running == name:
                        self.running = None
                continue
            if self.running:
                lines.append(line)

    def names(self, kind):
        return [n for n in self.expected if self.result.get(n) == kind]

    def not_run(self):
        return [n for n in self.expected if n not in self.result and n != self.running]

    def skip_reason(self):
        for n in self.names("skipped"):
            text = [l.strip() for l in self.excerpt.get(n, "").splitlines() if l.strip() and "Skipped" not in l]
            if text:
                return text[-1][:200]
        return ""


class Check:
    def __init__(self, args):
        self.dry = args.dry_run
        self.out = os.path.abspath(args.outdir)
        self.t0 = args.t0
        self.deadline_s = args.deadline
        self.end = self.t0 + self.deadline_s
        self.jobs = int(os.environ.get("JOBS") or os.cpu_count() or 4)
        self.torch_python = os.environ.get("GPU_CHECK_TORCH_PYTHON", "")
        self.cpu_build = os.path.abspath(os.environ.get("GPU_CHECK_CPU_BUILD") or os.path.join(ROOT, "build"))
        self.max_piece = float(os.environ.get("GPU_CHECK_MAX_PIECE_SECONDS") or 0) or None
        self.keep_build = os.environ.get("GPU_CHECK_KEEP_BUILD", "") not in ("", "0")
        self.inject = self.parse_inject(os.environ.get("GPU_CHECK_INJECT", ""))
        self.measure = MEASURE_DRY if self.dry else MEASURE_GPU
        self.example = EXAMPLE_DRY if self.dry else EXAMPLE_GPU
        self.example_memory = EXAMPLE_MEMORY_DRY if self.dry else EXAMPLE_MEMORY_GPU
        self.memory_checks = {}    # mode -> {estimate_bytes, measured_peak_bytes, ratio}
        self.example_runs = {}     # mode -> the example's per-step records (its --json "steps")
        self.pieces, self.by_name = [], {}
        self.facts, self.versions, self.tools = {}, {}, {}
        self.gpu_tests = {}        # test name -> {binary, list, streams...}
        self.targets = None
        self.discovered = []
        self.error = None
        self.interrupted = None
        self.torch_root = ""
        self.only = [g for g in (args.only or "").split(",") if g]
        # Carried binaries: on the GPU machine .gpu-prebuilt when it is there; in the dry run only when asked for.
        self.prebuilt_dir = os.path.abspath(os.environ.get("GPU_CHECK_PREBUILT") or PREBUILT)
        self.prebuilt = None       # the carried binaries' manifest, once they have been checked to load here
        self.provided = set()      # pieces whose result the carried binaries stand for (they are skipped)
        self.tmp = tempfile.mkdtemp(prefix="gpu_check.")
        build = args.build_dir or os.environ.get("GPU_CHECK_BUILD_DIR")
        self.own_build = False
        if build:
            self.build = os.path.abspath(build)
        elif self.dry:  # unique, next to OUTDIR (its name starts with build, which .gitignore covers at the root)
            parent = os.path.dirname(self.out)
            os.makedirs(parent, exist_ok=True)
            self.build = tempfile.mkdtemp(prefix="build-gpu-dry.", dir=parent)
            self.own_build = not self.keep_build
        else:
            self.build = os.path.join(ROOT, "build-gpu")
        self.env = dict(os.environ)
        self.test_env = {k: self.env.get(k, v) for k, v in TEST_ENV_DEFAULTS.items()}
        self.env.update(self.test_env)
        if os.path.isdir("/usr/local/cuda/bin"):
            self.env["PATH"] = "/usr/local/cuda/bin:" + self.env.get("PATH", "")
        os.makedirs(self.out, exist_ok=True)
        for name in os.listdir(self.out):  # stale results of an earlier run must not be summarized
            if name in ("summary.json", "check.log", "build.log", "tests.log") or re.match(
                    r"^(split|simulate)_seq\d+\.json$", name):
                os.remove(os.path.join(self.out, name))
        self.check_log = open(os.path.join(self.out, "check.log"), "a", buffering=1, encoding="utf-8")

    # ---- bookkeeping ----
    @staticmethod
    def parse_inject(spec):
        rules = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            pattern, _, action = item.rpartition(":")
            if action not in ("fail", "hang", "crash") or not pattern:
                raise SystemExit("gpu_check: GPU_CHECK_INJECT: '%s' is not <piece glob>:fail|hang|crash" % item)
            rules.append((pattern, action))
        return rules

    def injected(self, name):
        for pattern, action in self.inject:
            if fnmatch.fnmatchcase(name, pattern):
                return action
        return None

    def elapsed(self):
        return now() - self.t0

    def left(self):
        return self.end - now()

    def say(self, msg):
        line = "[%6.1f s] %s" % (self.elapsed(), msg)
        print(line, flush=True)
        try:
            self.check_log.write(line + "\n")
        except ValueError:
            pass

    def record(self, name, status, seconds, detail, **extra):
        assert status in STATUSES
        piece = {"name": name, "status": status, "seconds": round(seconds, 2), "detail": detail}
        piece.update(extra)
        self.pieces.append(piece)
        self.by_name[name] = piece
        self.say("%-60s %-7s %6.1f s  %s" % (name, status, seconds, detail))
        return piece

    def passed(self, name):
        p = self.by_name.get(name)
        return name in self.provided or (p is not None and p["status"] == "pass")

    def selected(self, name):
        """--only: measurements and tests outside its globs are skipped (set-up pieces always run); OPT_IN pieces run
        only when a glob names them."""
        if not name.startswith(("measure:", "test:")):
            return True
        named = any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(name.split(":", 1)[1], g) for g in self.only)
        if any(fnmatch.fnmatchcase(name, g) for g in OPT_IN):
            return named
        return named or not self.only

    def not_selected(self):
        return "not selected (%s)" % ("--only " + ",".join(self.only) if self.only else
                                      "runs only when --only names it: " + ", ".join(OPT_IN))

    def provide(self, name, what):
        """Records a set-up piece that the carried prebuilt binaries make unnecessary; later pieces may need it."""
        self.provided.add(name)
        return self.record(name, "skipped", 0, "carried prebuilt binaries used: " + what)

    def append_log(self, log, header, data):
        path = os.path.join(self.out, log)
        with open(path, "ab") as f:
            f.write(("\n===== %s\n" % header).encode())
            f.write(head_tail(data, PIECE_HEAD, PIECE_TAIL))
        self.cap_file(path)

    @staticmethod
    def cap_file(path):
        try:
            if os.path.getsize(path) <= LOG_CAP:
                return
            with open(path, "rb") as f:
                data = f.read()
            with open(path, "wb") as f:
                f.write(head_tail(data, LOG_HEAD, LOG_CAP - LOG_HEAD - 100))
        except OSError:
            pass

    # ---- running a piece ----
    def piece(self, name, cmd, timeout, min_s=5, log="check.log", needs=(), cwd=None, env=None, analyze=None,
              skip_reason=None):
        """Runs cmd as one piece. analyze(text, rc, timed_out) -> (status, detail, extra) refines the result;
        the default: pass on exit 0, fail otherwise, timeout when killed. Returns (piece, output text)."""
        action = self.injected(name)
        if action == "crash":
            raise RuntimeError("injected crash of the orchestrator at piece %s" % name)
        if skip_reason and not action:
            return self.record(name, "skipped", 0, skip_reason), ""
        if not self.selected(name) and not action:
            return self.record(name, "skipped", 0, self.not_selected()), ""
        for need in needs:
            if not self.passed(need):
                st = self.by_name[need]["status"] if need in self.by_name else "not run"
                return self.record(name, "skipped", 0, "needs %s (%s)" % (need, st)), ""
        left = self.left() - SUMMARY_RESERVE_S - KILL_GRACE_S
        if left < min_s:
            return self.record(name, "skipped", 0, "skipped: %.0f s left of the deadline, needs %.0f" %
                               (max(left, 0), min_s), deadline=True), ""
        limit = min(timeout, left, self.max_piece or timeout)
        why = "own timeout %.0f s" % timeout if limit == timeout else (
            "deadline" if limit == left else "GPU_CHECK_MAX_PIECE_SECONDS")
        if action == "hang" and limit > INJECTED_HANG_S:
            limit, why = INJECTED_HANG_S, "an injected hang"
        extra = {}
        if action == "fail":
            cmd = ["sh", "-c", 'echo "gpu_check: injected failure of piece $0" >&2; exit 1', name]
            extra["injected"] = action
        elif action == "hang":
            # The whole group ignores SIGTERM, so the SIGKILL escalation is exercised too.
            cmd = ["sh", "-c", 'echo "gpu_check: injected hang of piece $0"; trap "" TERM; sleep 100000 & '
                               'sleep 100000; wait', name]
            extra["injected"] = action
        out_path = os.path.join(self.tmp, re.sub(r"[^\w.-]", "_", name) + ".out")
        self.say("%s: %s (timeout %.0f s: %s)" % (name, show(cmd), limit, why))
        start = now()
        timed_out, interrupted, rc, gone, sig = False, None, None, True, None
        try:
            with open(out_path, "wb") as out:
                proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=cwd or self.tmp, env=env or self.env,
                                        start_new_session=True)
        except OSError as e:
            piece = self.record(name, "fail", now() - start, "could not start: %s" % e, **extra)
            return piece, ""
        try:
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
        except Interrupted as e:
            interrupted = str(e)
        if timed_out or interrupted:
            killed_at = now() - start
            gone, sig = kill_group(proc.pid, KILL_GRACE_S)
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rc = None
        elif group_alive(proc.pid):  # children left behind by a piece that ended
            kill_group(proc.pid, 1.0)
            extra["stray_processes_killed"] = True
        seconds = now() - start
        with open(out_path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8", "replace")
        if timed_out or interrupted:
            status = "timeout"
            detail = ("interrupted by %s" % interrupted) if interrupted else "timed out after %.0f s (%s)" % (
                killed_at, why)
            detail += ", group killed with %s%s" % (sig, "" if gone else " (some processes remain!)")
            detail += "; last output: %s" % (tail_lines(text, 2, 300) or "none")
            extra["group_cleaned"] = gone
        elif rc == 0:
            status, detail = "pass", tail_lines(text, 1, 200)
        else:
            status = "fail"
            detail = "exit %s: %s" % (rc, tail_lines(text, 3, 400, prefer=r"(?i)\berror\b|FAILED|fatal"))
        extra["exit_code"] = rc
        extra["timeout_s"] = round(limit, 1)
        if analyze and not extra.get("injected"):
            try:
                status, detail, more = analyze(text, rc, timed_out or bool(interrupted), status, detail)
                extra.update(more or {})
            except Exception as e:  # noqa: BLE001 - the piece's own result still counts
                detail += " (analysis failed: %s)" % e
        self.append_log(log, "%s: %s, %.1f s, exit %s: %s" % (name, status, seconds, rc, show(cmd)), data)
        piece = self.record(name, status, seconds, detail, **extra)
        if interrupted:
            raise Interrupted(interrupted)
        return piece, text

    def func_piece(self, name, fn, log="check.log"):
        """An in-process piece: fn() -> detail or raises; fault injection still replaces it by a command."""
        if self.injected(name):
            return self.piece(name, ["true"], 30, log=log)[0]
        start = now()
        try:
            detail = fn()
            return self.record(name, "pass", now() - start, detail)
        except Exception as e:  # noqa: BLE001
            return self.record(name, "fail", now() - start, str(e)[:400])

    # ---- the pieces ----
    def prebuilt_pieces(self):
        """Binaries carried in .gpu-prebuilt (`gpu_check.sh prebuild`, here) stand for configure and build when
        they were built from these very sources and load against this machine's torch; otherwise the check builds
        here, as without them. Their libraries come from this machine's torch package (LD_LIBRARY_PATH)."""
        path = os.path.join(self.prebuilt_dir, "manifest.json")
        if self.dry and not os.environ.get("GPU_CHECK_PREBUILT"):
            return self.record("prebuilt", "skipped", 0, "dry run: carried binaries are used only with "
                               "GPU_CHECK_PREBUILT=DIR")
        if not os.path.isfile(path):
            return self.record("prebuilt", "skipped", 0, "no carried binaries in %s: building here" % self.prebuilt_dir)
        try:
            manifest = json.load(open(path))
            digest = source_digest()
        except (OSError, ValueError) as e:
            return self.record("prebuilt", "skipped", 0, "unreadable %s (%s): building here" % (path, e))
        if manifest.get("digest") != digest:
            return self.record("prebuilt", "skipped", 0, "carried binaries are of other sources (digest %s, these "
                               "%s): building here" % (str(manifest.get("digest"))[:12], digest[:12]))
        here = self.versions.get("torch") or self.versions.get("file_version") or ""
        if not self.torch_root or here.split(".")[:2] != str(manifest.get("torch")).split(".")[:2]:
            return self.record("prebuilt", "skipped", 0, "carried binaries were linked against torch %s, this "
                               "machine has %s: building here" % (manifest.get("torch"), here or "none"))
        env = dict(self.env)
        env["LD_LIBRARY_PATH"] = ":".join(torch_lib_dirs(self.torch_root) + list(filter(None, [
            env.get("LD_LIBRARY_PATH")])))
        script = ('cd "$0" || exit 1; rc=0; for b in "$@"; do ldd "./$b" | grep "not found" && rc=1; done; '
                  '[ $rc = 0 ] || exit 1; ./"$1" --help > /dev/null || exit 1; ./"$2" --help > /dev/null || exit 1; '
                  'shift 2; for b in "$@"; do ./"$b" --gtest_list_tests > /dev/null || exit 1; done; echo "they load"')
        if not manifest.get("example"):
            return self.record("prebuilt", "skipped", 0, "carried binaries without the example (an older prebuild): "
                               "building here")
        binaries = [manifest["bench"], manifest["example"]] + [t["binary"] for t in manifest["tests"]]

        def verdict(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail + " -- building here instead", None
            return status, "%s, built %s against torch %s: they load here (LD_LIBRARY_PATH %s)" % (
                ", ".join(binaries), manifest["built_utc"], manifest["torch"], env["LD_LIBRARY_PATH"]), None

        piece, _ = self.piece("prebuilt", ["sh", "-c", script, self.prebuilt_dir] + binaries, 60, min_s=5, env=env,
                              analyze=verdict)
        if piece["status"] == "pass":
            self.env, self.prebuilt = env, manifest

    def env_pieces(self):
        def smi(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail, None
            gpus = []
            for line in text.splitlines():
                kind, _, row = line.partition(": ")
                fields = {"FULL": NVIDIA_SMI_FIELDS, "MIN": NVIDIA_SMI_FIELDS[:3]}.get(kind)
                if fields and row.count(",") == len(fields) - 1:
                    gpus.append(dict(zip(fields, (c.strip() for c in row.split(",")))))
            self.facts["nvidia_smi"] = gpus
            if not gpus:
                return "fail", "no GPU row in: " + tail_lines(text), None
            g = gpus[0]
            return "pass", "%d GPU(s): %s, %s, driver %s, sm %s/%s, mem %s/%s, %s, persistence %s" % (
                len(gpus), g["name"], g["memory.total"], g["driver_version"], g.get("clocks.sm"),
                g.get("clocks.max.sm"), g.get("clocks.mem"), g.get("clocks.max.mem"), g.get("compute_mode"),
                g.get("persistence_mode")), None

        # The full query, or (should a field be unknown to this driver) the minimal one; then the plain table
        # (other processes, MIG) for check.log.
        query = ('q=$(nvidia-smi --query-gpu="$0" --format=csv,noheader) && printf "%s\\n" "$q" | sed "s/^/FULL: /" '
                 '|| { q=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader) && '
                 'printf "%s\\n" "$q" | sed "s/^/MIN: /"; }; rc=$?; nvidia-smi; exit $rc')
        smi_missing = shutil.which("nvidia-smi", path=self.env.get("PATH")) is None
        self.piece("env:nvidia-smi", ["sh", "-c", query, ",".join(NVIDIA_SMI_FIELDS)], 30, analyze=smi,
                   skip_reason="nvidia-smi not found (no GPU driver here)" if smi_missing and self.dry else None)

        def torch_info(text, rc, killed, status, detail):
            info = {}
            for line in text.splitlines():
                if line.startswith("TORCH_ROOT="):
                    self.torch_root = line.split("=", 1)[1].strip()
                elif line.startswith("TORCH_FILE_INFO=") or line.startswith("TORCH_INFO="):
                    info = json.loads(line.split("=", 1)[1])
            self.versions.update(info)
            if status == "pass":
                dev = info.get("device", {})
                return "pass", "torch %s, CUDA %s, NCCL %s, python %s, cuda available %s%s" % (
                    info.get("torch"), info.get("cuda"), info.get("nccl"), info.get("python"),
                    info.get("cuda_available"), (", %s (sm %s, %s GiB)" % (dev.get("name"), dev.get("capability"),
                                                                          dev.get("memory_gib")) if dev else "")), None
            if self.dry and rc is not None and self.torch_root and "file_version" in info:
                # A CPU-only install of the CUDA wheel cannot import torch (scripts/setup.sh): the build still works.
                return "pass", "torch %s at %s (import failed: %s)" % (
                    info["file_version"], self.torch_root, tail_lines(text, 1, 150)), None
            return status, detail, None

        if self.torch_python:
            self.piece("env:torch", [self.torch_python, "-c", TORCH_PROBE], 120, min_s=10, analyze=torch_info)
        else:
            self.record("env:torch", "fail", 0, "no Python that has torch was found (set PYTHON)")

        tools = ("echo cmake: $(cmake --version | head -n1); echo ninja: $(ninja --version 2>&1); "
                 "echo nvcc: $(nvcc --version 2>&1 | grep -i release); echo cores: $(nproc); "
                 "echo kernel: $(uname -r); echo memory: $(free -g | awk '/Mem:/{print $2 \" GiB\"}'); "
                 "echo disk: $(df -h . | awk 'NR==2{print $4 \" free\"}'); echo python: $(%s --version 2>&1)"
                 % shlex.quote(sys.executable))

        def tool_info(text, rc, killed, status, detail):
            for line in text.splitlines():
                k, sep, v = line.partition(":")
                if sep and k.strip() in ("cmake", "ninja", "nvcc", "cores", "kernel", "memory", "disk", "python"):
                    self.tools[k.strip()] = v.strip()
            return status, ", ".join("%s %s" % kv for kv in self.tools.items())[:300], None

        self.piece("env:tools", ["sh", "-c", tools], 20, min_s=3, analyze=tool_info, cwd=ROOT)

    def third_party_piece(self):
        tp = os.path.join(ROOT, ".third_party")

        def check():
            notes = []
            if not third_party_complete(tp):
                if not self.dry:
                    raise RuntimeError(".third_party is missing or incomplete: run `scripts/gpu_check.sh prepare` "
                                       "before and carry .third_party")
                prepare(quiet=True)
                notes.append("prepared")
            size = dir_bytes(tp) / 2**20
            if size > THIRD_PARTY_MAX_MIB:
                raise RuntimeError(".third_party is %.1f MiB: with the tree it must stay under the 64 MiB carry "
                                   "limit (at most %d MiB)" % (size, THIRD_PARTY_MAX_MIB))
            notes.append(".third_party %.1f MiB" % size)
            tree = tree_bytes()
            if tree is not None:
                notes.append("tree %.1f MiB (git ls-files), total %.1f of 64 MiB" % (tree / 2**20, tree / 2**20 + size))
            return ", ".join(notes)

        self.func_piece("third_party", check)

    def configure_piece(self):
        if not self.torch_root and self.dry:
            self.torch_root = torch_root_from_cache(self.cpu_build) or ""
        if self.prebuilt:
            return self.provide("configure", "configured on the machine that built them, with the same options")
        args = configure_args(self.build, self.torch_root, self.torch_python, self.env.get("PATH"))

        def summary_line(text, rc, killed, status, detail):
            line = next((l.strip() for l in text.splitlines() if l.startswith("-- twobp:")), "")
            self.facts["configure"] = line[3:] if line else None
            if status == "pass":
                return status, line[3:] or detail, None
            return status, detail, None

        self.piece("configure", args, 180, min_s=15, log="build.log", needs=("third_party",),
                   analyze=summary_line)

    def targets_piece(self):
        if self.prebuilt:
            self.targets = set(self.prebuilt["targets"])
            return self.provide("targets", ", ".join(sorted(self.targets)))

        def parse(text, rc, killed, status, detail):
            names = set()
            for line in text.splitlines():
                m = re.match(r"^([\w.+-]+): phony$", line.strip()) or re.match(r"^\.\.\. ([\w.+-]+)", line.strip())
                if m:
                    names.add(m.group(1))
            self.targets = names
            if status == "pass" and not names:
                return "fail", "no targets in the help output", None
            return status, "%d targets%s" % (len(names), "" if "twobp_nccl" in names else
                                              "; no twobp_nccl here (no NCCL transport in this configuration)"), None

        self.piece("targets", ["cmake", "--build", self.build, "--target", "help"], 60, needs=("configure",),
                   analyze=parse)

    def discover_piece(self):
        if self.prebuilt:
            self.discovered = [dict(t, binary=os.path.join(self.prebuilt_dir, t["binary"]))
                               for t in self.prebuilt["tests"]]
            return self.provide("discover", "gpu tests: " + ", ".join(t["name"] for t in self.discovered))

        def parse(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail, None
            found = gpu_tests_from_ctest(text, self.build)
            self.discovered = found
            return "pass", "gpu tests: " + (", ".join(t["name"] + (" (mpi: not run)" if t["mpi"] else "")
                                                       for t in found) or "none"), None

        self.piece("discover", ["ctest", "--test-dir", self.build, "-L", "gpu", "--show-only=json-v1"], 60,
                   needs=("configure",), analyze=parse)

    def build_piece(self, name, targets, timeout, min_s=20, needs=()):
        """On the GPU: builds targets. In the dry run: checks that they exist in the GPU configuration."""
        needs = ("targets",) + tuple(needs)
        if self.prebuilt:
            return self.provide(name, "built here from the same sources (%s)" % self.prebuilt["built_utc"])
        if self.dry:
            missing = [t for t in targets if self.targets is not None and t not in self.targets]
            cmd = ["sh", "-c", 'echo "dry run: not built; target(s) %s exist"' % " ".join(targets)] if not missing \
                else ["sh", "-c", 'echo "target(s) %s missing from the GPU configuration" >&2; exit 1'
                      % " ".join(missing)]
            return self.piece(name, cmd, 30, min_s=1, log="build.log", needs=needs)[0]
        return self.piece(name, ["cmake", "--build", self.build, "-j", str(self.jobs), "--target"] + list(targets),
                          timeout, min_s=min_s, log="build.log", needs=needs)[0]

    def measure_pieces(self):
        m = self.measure
        bench = self.bench_binary()
        batched_mbs = 4  # the micro-batches of split's batched W, priced by the simulator below
        for seq in m["seqs"]:
            split_json = os.path.join(self.out, "split_seq%d.json" % seq)
            cmd = [bench, "split", "--device", m["device"], "--dtype", m["dtype"], "--dim", m["dim"], "--ffn", m["ffn"],
                   "--heads", m["heads"], "--kv-heads", m["heads"], "--layers", m["layers"], "--seq", seq, "--batch",
                   1, "--repeats", m["repeats"], "--warmup", 2, "--no-conv", "--batched-w", "--micro-batches",
                   batched_mbs, "--json", split_json]

            def split_ok(text, rc, killed, status, detail, split_json=split_json):
                if status == "pass":
                    fast = json.load(open(split_json))["fast"]
                    detail = "F %.3f I %.3f W %.3f B %.3f ms, fused %.3g TFLOP/s" % (
                        fast["forward_ms"], fast["stage1_ms"], fast["stage2_ms"], fast["fused_ms"],
                        fast.get("fused_tflops") or 0)
                return status, detail, None

            skip = None
            if self.dry and not os.access(bench, os.X_OK):
                skip = "%s is missing: build twobp_bench in GPU_CHECK_CPU_BUILD first" % bench
            self.piece("measure:split_seq%d" % seq, cmd, 150, min_s=15, analyze=split_ok, skip_reason=skip,
                       needs=() if self.dry else ("build:twobp_bench",))
            # Costs of the fast path (twobp::nn layers) feed the simulator: 4 GPUs, 8 micro-batches, one stage per GPU
            # (two half-size chunks for interleaved-1f1b and zb-v). Communication: one [1, seq, dim] bf16 activation
            # per message; 0.1 ms is ASSUMED (NVLink moves 8-32 MiB in ~0.03-0.1 ms; one GPU cannot measure it).
            name = "measure:simulate_seq%d" % seq
            if not self.passed("measure:split_seq%d" % seq):
                self.piece(name, [], 30, needs=("measure:split_seq%d" % seq,))
                continue
            try:
                fast = json.load(open(split_json))["fast"]
                f, i, w, b = (fast[k] for k in ("forward_ms", "stage1_ms", "stage2_ms", "fused_ms"))
                # The W of batched_mbs micro-batches at once (--batched-w): the simulator then prices every W as a
                # fixed part + k x per micro-batch (twobp::fit_weight_cost), so batching W costs what it measured.
                batched = (["--w-batched", batched_mbs, fast["batched_w_ms"]]
                           if isinstance(fast.get("batched_w_ms"), (int, float)) and fast["batched_w_ms"] > 0 else [])
            except Exception as e:  # noqa: BLE001
                self.record(name, "fail", 0, "cannot read F, I, W, B from %s: %s" % (split_json, e))
                continue
            sim_json = os.path.join(self.out, "simulate_seq%d.json" % seq)

            def sim_ok(text, rc, killed, status, detail, sim_json=sim_json):
                if status == "pass":
                    sim = json.load(open(sim_json))
                    sp = {r["schedule"]: r.get("speedup_vs_standard") for r in sim.get("results", [])
                          if r.get("mode") == "2bp"}
                    detail = "2BP speedup: " + ", ".join("%s %.3f" % (k, v) for k, v in sp.items() if v is not None)
                return status, detail, None

            self.piece(name, [bench, "simulate", "--ranks", 4, "--microbatches", 8, "--f", f, "--i", i, "--w", w,
                              *batched, "--b", b, "--comm", 0.1, "--json", sim_json], 30, min_s=3, analyze=sim_ok)

    def example_pieces(self):
        """measure:example_2bp, measure:example_standard: llama_pipeline trains on the device (threads as ranks),
        then measure:example_compare puts the two runs side by side (losses agree; tokens/s of each)."""
        skip = self.example_missing()
        for mode in ("2bp", "standard"):
            out_json = os.path.join(self.tmp, "example_%s.json" % mode)  # not returned (8 files): summarized
            cmd = self.example_command(self.example, mode) + ["--timeout", 60, "--json", out_json]

            def ran(text, rc, killed, status, detail, mode=mode, out_json=out_json):
                if status == "pass":
                    steps = json.load(open(out_json))["steps"]
                    self.example_runs[mode] = steps
                    peak = max((s.get("peak_memory_bytes") or -1) for s in steps)  # -1: not recorded
                    detail = "loss %.4f -> %.4f in %d steps, median %.0f tokens/s after the first%s" % (
                        steps[0]["loss"], steps[-1]["loss"], len(steps), median_tokens_per_s(steps),
                        ", peak %.2f GiB per rank" % (peak / 2**30) if peak >= 0 else "")
                return status, detail, None

            self.piece("measure:example_" + mode, cmd, 150, min_s=20, analyze=ran, skip_reason=skip,
                       needs=() if self.dry else ("build:llama_pipeline",))

        def compare():
            a, b = self.example_runs.get("2bp"), self.example_runs.get("standard")
            if not a or not b:
                raise RuntimeError("needs measure:example_2bp and measure:example_standard to pass")
            # Same weights, data and seed: the first step's forward is the same computation (its loss agrees to
            # rounding) and 2BP changes only the order of the weight-gradient sums, so the first step's gradient norm
            # agrees to the precision's rounding; a lost or doubled gradient would be off by far more. Later losses
            # are reported only: a trajectory amplifies rounding differences (several % after a few steps in bf16).
            rel = lambda x, y: abs(x - y) / max(abs(y), 1e-12)
            tol = 1e-4 if self.example["dtype"] == "fp32" else 1e-2
            loss0, norm0 = rel(a[0]["loss"], b[0]["loss"]), rel(a[0]["grad_norm"], b[0]["grad_norm"])
            later = max(rel(x["loss"], y["loss"]) for x, y in zip(a, b))
            detail = ("2BP vs standard, first step: loss %.2g, gradient norm %.2g relative difference (tolerance %g); "
                      "later losses up to %.2g apart; tokens/s 2BP/standard %.3f (threads sharing one device: not a "
                      "pipeline speedup)" % (loss0, norm0, tol, later, median_tokens_per_s(a) / median_tokens_per_s(b)))
            if not (loss0 <= tol and norm0 <= tol):
                raise RuntimeError(detail)
            return detail

        if self.selected("measure:example_compare"):
            self.func_piece("measure:example_compare", compare)
        else:
            self.record("measure:example_compare", "skipped", 0, self.not_selected())

    def example_memory_pieces(self):
        """measure:example_memory_2bp / _standard: the example's --dry-run estimate of a rank's memory, then real
        steps of the same configuration; the measured peak (the allocator's, over the steps) must not exceed the
        estimate by more than MEMORY_ESTIMATE_SLACK."""
        skip = self.example_missing()
        units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
        for mode in ("2bp", "standard"):
            args = self.example_command(self.example_memory, mode) + ["--timeout", 120]
            out_json = os.path.join(self.tmp, "example_memory_%s.json" % mode)
            estimate = {}

            def estimated(text, rc, killed, status, detail, estimate=estimate):
                if status == "pass":
                    m = re.search(r"rank 0: .*\| total ([\d.]+) (B|KiB|MiB|GiB|TiB)", text)
                    if not m:
                        return "fail", "no 'rank 0: ... | total N GiB' line in the --dry-run output", None
                    estimate["bytes"] = float(m.group(1)) * units[m.group(2)]
                    detail = "rank 0 estimated at %.2f GiB" % (estimate["bytes"] / 2**30)
                return status, detail, None

            dry_name, run_name = "measure:example_memory_%s_estimate" % mode, "measure:example_memory_%s" % mode
            self.piece(dry_name, args + ["--dry-run"], 60, min_s=5, analyze=estimated, skip_reason=skip,
                       needs=() if self.dry else ("build:llama_pipeline",))

            def measured(text, rc, killed, status, detail, mode=mode, out_json=out_json, estimate=estimate):
                if status == "pass":
                    steps = json.load(open(out_json))["steps"]
                    peak = max(s.get("peak_memory_bytes") or -1 for s in steps)
                    if peak <= 0:
                        return "fail", "the example recorded no peak memory", None
                    ratio = peak / estimate["bytes"]
                    self.memory_checks[mode] = {"estimate_bytes": estimate["bytes"], "measured_peak_bytes": peak,
                                                "measured_over_estimate": round(ratio, 4)}
                    detail = "peak %.2f GiB over %d steps, estimate %.2f GiB: measured/estimate %.3f (at most %.2f)" % (
                        peak / 2**30, len(steps), estimate["bytes"] / 2**30, ratio, MEMORY_ESTIMATE_SLACK)
                    if ratio > MEMORY_ESTIMATE_SLACK:
                        status = "fail"
                return status, detail, None

            self.piece(run_name, args + ["--json", out_json], 240, min_s=60, analyze=measured, needs=(dry_name,))

    def example_command(self, e, mode):
        """llama_pipeline with configuration e (EXAMPLE_* above) in mode 2bp or standard."""
        cmd = [self.example_binary(), "--device", e["device"], "--model", e["model"], "--dtype", e["dtype"], "--ranks",
               e["ranks"], "--schedule", e["schedule"], "--microbatches", e["microbatches"], "--seq-len", e["seq_len"],
               "--steps", e["steps"], "--2bp" if mode == "2bp" else "--no-2bp"]
        return cmd + (["--micro-batch-size", e["micro_batch_size"]] if "micro_batch_size" in e else [])

    def example_missing(self):
        """Why the example pieces are skipped (the dry run without the CPU build's example), or None."""
        exe = self.example_binary()
        if self.dry and not os.access(exe, os.X_OK):
            return "%s is missing: build llama_pipeline in GPU_CHECK_CPU_BUILD first" % exe
        return None

    def example_binary(self):
        if self.prebuilt and self.prebuilt.get("example"):
            return os.path.join(self.prebuilt_dir, self.prebuilt["example"])
        return os.path.join(self.cpu_build if self.dry else self.build, "examples", "llama_pipeline")

    def bench_binary(self):
        if self.prebuilt:
            return os.path.join(self.prebuilt_dir, self.prebuilt["bench"])
        return os.path.join(self.cpu_build if self.dry else self.build, "benchmarks", "twobp_bench")

    def test_binary(self, t):
        """The binary that runs: the GPU build's, or in the dry run the CPU build's of the same name and place."""
        if self.prebuilt:
            return t["binary"]
        build = self.cpu_build if self.dry else self.build
        exe = os.path.join(build, os.path.relpath(t["binary"], self.build)) if self.dry else t["binary"]
        if not os.access(exe, os.X_OK):  # not where ctest said (not built yet at discovery): look for it by name
            for base, dirs, files in os.walk(build):
                dirs[:] = [d for d in dirs if d != "CMakeFiles" and not d.startswith("_")]
                if t["name"] in files and os.access(os.path.join(base, t["name"]), os.X_OK):
                    return os.path.join(base, t["name"])
        return exe

    def list_piece(self, t):
        name, exe = t["name"], self.test_binary(t)
        info = self.gpu_tests.setdefault(name, {"binary": exe, "suites": {}, "streams": []})

        def parse(text, rc, killed, status, detail):
            suites, suite = {}, None
            for line in text.splitlines():
                if not line.strip() or line.startswith("Running main()"):
                    continue
                if not line.startswith(" "):
                    tok = line.split()[0]
                    suite = tok[:-1] if tok.endswith(".") else None
                    if suite:
                        suites[suite] = []
                elif suite:
                    suites[suite].append(line.split()[0])
            info["suites"] = suites
            if status == "pass" and not suites:
                return "fail", "no test suites listed", None
            return status, "%d suites, %d cases: %s" % (len(suites), sum(map(len, suites.values())),
                                                        ", ".join(suites)[:250]), None

        skip = None
        if t["mpi"]:
            skip = "an MPI test (mpiexec): no MPI on the GPU machine"
        elif self.dry and not os.access(exe, os.X_OK):
            skip = "%s is not built in the CPU build (GPU_CHECK_CPU_BUILD)" % exe
        needs = () if self.dry else ("build:" + name,)
        self.piece("list:" + name, [exe, "--gtest_list_tests"], 60, min_s=5, log="tests.log", needs=needs,
                   analyze=parse, skip_reason=skip)

    def plan_test_pieces(self):
        """(piece name, test, gtest filter, expected cases, last?) for every suite of every listed test binary."""
        first, last = [], []
        for t in self.discovered:
            info = self.gpu_tests.get(t["name"])
            if not info or not self.passed("list:" + t["name"]):
                continue
            for suite, cases in info["suites"].items():
                full = ["%s.%s" % (suite, c) for c in cases]
                base = "test:%s:%s" % (t["name"], suite)
                if suite in HELPER_SUITES:
                    first.append((base, t, None, full, "helper suite: runs only as a child process of another test"))
                    continue
                late = [n for n in full if fnmatch.fnmatchcase(n, LAST_PATTERN)]
                early = [n for n in full if n not in late]
                if early and len(full) <= PER_CASE_MAX:  # a hung case must not take its suite's other results
                    for n in early:
                        first.append(("test:%s:%s" % (t["name"], n), t, n, [n], None))
                elif early:
                    filt = suite + ".*" + ((":-" + ":".join(late)) if late else "")
                    first.append((base, t, filt, early, None))
                for n in late:
                    last.append(("test:%s:%s" % (t["name"], n) if len(full) > 1 else base, t, n, [n], None))
        return first, last

    def test_piece(self, name, t, filt, expected, skip, last):
        info = self.gpu_tests[t["name"]]
        exe = self.test_binary(t)
        own = t["timeout"] if last else min(t["timeout"], float(os.environ.get("GPU_CHECK_TEST_TIMEOUT") or 240))
        stream = {"piece": name, "expected": expected}
        info["streams"].append(stream)

        def parse(text, rc, killed, status, detail):
            g = GtestStream(text, expected)
            p, f, s = g.names("passed"), g.names("failed"), g.names("skipped")
            stream.update(passed=p, failed=f, skipped=s, interrupted=[g.running] if g.running else [],
                          not_run=g.not_run(),
                          failures={n: g.excerpt.get(n, "") for n in f[:10]})
            counts = "%d passed, %d failed, %d skipped of %d" % (len(p), len(f), len(s), len(expected))
            if killed:
                return "timeout", "%s; %s%s" % (detail, counts, "; running: " + g.running if g.running else ""), None
            if f or rc != 0:
                return "fail", "%s; exit %s; failed: %s%s" % (counts, rc, ", ".join(f[:5]),
                                                              "" if f else "; " + tail_lines(text, 2, 300)), None
            if not (p or s):
                return "fail", "no case ran (filter %s)" % filt, None
            if s and not p:
                return "skipped", "all %d cases skipped: %s" % (len(s), g.skip_reason() or "no reason given"), None
            return "pass", counts, None

        needs = () if self.dry else ("build:" + t["name"],)
        self.piece(name, [exe, "--gtest_filter=%s" % (filt or "-*")], own, min_s=15, log="tests.log",
                   needs=needs, analyze=parse, skip_reason=skip)

    def run(self):
        self.say("gpu_check: %s UTC on %s, %s, python %s (torch python %s), %d jobs, deadline %.0f s, build dir %s%s"
                 % (datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), socket.gethostname(),
                    "dry run" if self.dry else "GPU run", sys.executable, self.torch_python or "none", self.jobs,
                    self.deadline_s, self.build, (", CPU build " + self.cpu_build) if self.dry else ""))
        if self.inject:
            self.say("gpu_check: fault injection: %s" % self.inject)
        self.env_pieces()
        self.third_party_piece()
        self.prebuilt_pieces()
        self.configure_piece()
        self.targets_piece()
        self.discover_piece()
        libs = ["twobp"] + (["twobp_nccl"] if self.targets and "twobp_nccl" in self.targets else [])
        self.build_piece("build:library", libs, 360, min_s=30)
        self.build_piece("build:twobp_bench", ["twobp_bench"], 240, needs=("build:library",))
        self.measure_pieces()
        self.build_piece("build:llama_pipeline", ["llama_pipeline"], 240, needs=("build:library",))
        self.example_pieces()
        runnable = [t for t in self.discovered if not t["mpi"]]
        for t in runnable:
            self.build_piece("build:" + t["name"], [t["name"]], 300, needs=("build:library",))
        for t in self.discovered:
            self.list_piece(t)
        first, last = self.plan_test_pieces()
        for name, t, filt, expected, skip in first:
            self.test_piece(name, t, filt, expected, skip, False)
        for name, t, filt, expected, skip in last:
            self.test_piece(name, t, filt, expected, skip, True)
        self.example_memory_pieces()

    # ---- the summary ----
    def test_results(self):
        out = {}
        for name, info in self.gpu_tests.items():
            res = {k: [] for k in ("passed", "failed", "skipped", "interrupted", "not_run")}
            failures = {}
            for s in info["streams"]:
                piece = self.by_name.get(s["piece"], {})
                if "passed" not in s:  # never ran: skipped (helper suite, deadline, build failed)
                    res["not_run" if piece.get("status") != "skipped" or "helper" not in piece.get("detail", "")
                        else "skipped"] += s["expected"]
                    continue
                for k in res:
                    res[k] += s.get(k, [])
                failures.update(s.get("failures", {}))
            entry = {"binary": info["binary"], "counts": {k: len(v) for k, v in res.items()}}
            for k, v in res.items():
                entry[k] = v[:40] + (["... %d more" % (len(v) - 40)] if len(v) > 40 else [])
            entry["failure_excerpts"] = dict(list(failures.items())[:10])
            out[name] = entry
        return out

    def case_status(self, tests, pattern):
        for entry in tests.values():
            for k in ("failed", "interrupted", "passed", "skipped", "not_run"):
                if any(fnmatch.fnmatchcase(n, pattern) for n in entry.get(k, [])):
                    return {"failed": "FAILED (see tests.log)", "interrupted": "timed out (see tests.log)",
                            "not_run": "not run (see pieces)"}.get(k, k)
        return "not run (no such test here)"

    def stage_costs(self):
        stages = {}
        for name in sorted(os.listdir(self.out)):
            m = re.match(r"^split_seq(\d+)\.json$", name)
            if not m:
                continue
            seq = m.group(1)
            try:
                j = json.load(open(os.path.join(self.out, name)))
                fast = j["fast"]
                stage = {k: fast.get(k) for k in ("forward_ms", "stage1_ms", "stage2_ms", "fused_ms", "batched_w_ms",
                                                   "forward_tflops", "stage1_tflops", "stage2_tflops", "fused_tflops")}
                stage["general_path"] = {k: j.get("general", {}).get(k)
                                         for k in ("forward_ms", "stage1_ms", "stage2_ms", "fused_ms")}
                cfg = j.get("config", {})
                stage["peak_allocated_gib"] = (cfg["peak_allocated_bytes"] / 2**30
                                               if "peak_allocated_bytes" in cfg else None)
                stage["config"] = {k: cfg.get(k) for k in ("device", "dtype", "dim", "ffn", "heads", "layers", "seq",
                                                           "batch", "repeats")}
                sim_path = os.path.join(self.out, "simulate_seq%s.json" % seq)
                if os.path.exists(sim_path):
                    sim = json.load(open(sim_path))
                    stage["simulated_4gpu_m8_speedup_2bp_over_standard"] = {
                        r["schedule"]: r.get("speedup_vs_standard") for r in sim.get("results", [])
                        if r.get("mode") == "2bp"}
            except Exception as e:  # noqa: BLE001
                stage = {"error": "%s: %s" % (name, e)}
            stages["seq" + seq] = stage
        return stages

    def files(self):
        listing = {}
        for name in sorted(os.listdir(self.out)):
            path = os.path.join(self.out, name)
            listing[name] = os.path.getsize(path) if os.path.isfile(path) else "not a plain file"
        return listing

    def summary(self):
        start = now()
        problems = []
        summary = {"gpu": False, "mode": "dry-run" if self.dry else "gpu", "ok": None,
                   "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                   "host": socket.gethostname(), "deadline_s": self.deadline_s, "total_s": None}
        if self.interrupted:
            summary["interrupted_by"] = self.interrupted
        if self.error:
            summary["error"] = self.error
        for key, fn in (("versions", lambda: self.versions), ("gpu_facts", lambda: self.facts),
                        ("tools", lambda: self.tools), ("gpu_tests", self.test_results)):
            try:
                summary[key] = fn()
            except Exception as e:  # noqa: BLE001 - a summary with the reason beats no summary
                summary[key] = {"error": str(e)}
                problems.append("%s: %s" % (key, e))
        gpu_tests = summary.get("gpu_tests") if isinstance(summary.get("gpu_tests"), dict) else {}
        summary["nccl_2_processes_1_gpu"] = self.case_status(gpu_tests, "*NcclProcesses.TwoRanks*")
        summary["nccl_4_processes_1_gpu"] = self.case_status(gpu_tests, "*NcclProcesses.FourRanks*")
        try:
            summary["stage_costs"] = self.stage_costs()  # one 7B stage on the GPU; a tiny model in the dry run
        except Exception as e:  # noqa: BLE001
            summary["stage_costs"] = {"error": str(e)}
            problems.append("stage_costs: %s" % e)
        summary["gpu"] = bool(not self.dry and (self.versions.get("cuda_available") or self.facts.get("nvidia_smi")))
        summary["test_env"] = self.test_env
        summary["inject"] = os.environ.get("GPU_CHECK_INJECT") or None
        summary["build_dir"] = self.build
        if self.dry:
            summary["cpu_build"] = self.cpu_build
        summary["measurement"] = {k: v for k, v in self.measure.items()}
        summary["example"] = {"config": self.example, "steps": self.example_runs}
        summary["example_memory"] = {"config": self.example_memory, "checks": self.memory_checks}
        summary["communication_ms_assumed"] = 0.1
        self.record("summary", "fail" if problems else "pass", now() - start,
                    "; ".join(problems) if problems else "%d pieces, this one included" % (len(self.pieces) + 1))
        bad = [p["name"] for p in self.pieces if p["status"] in ("fail", "timeout") or p.get("deadline")]
        summary["ok"] = not bad and not self.error and not self.interrupted
        summary["not_ok"] = bad + (["the check itself: " + self.error.splitlines()[0]] if self.error else []) + (
            ["the check itself: interrupted by " + self.interrupted] if self.interrupted else [])
        summary["pieces"] = self.pieces
        summary["total_s"] = round(self.elapsed(), 1)
        summary["ended_before_deadline"] = self.elapsed() < self.deadline_s
        return summary

    def finish(self):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        path = os.path.join(self.out, "summary.json")
        ok = False
        try:
            summary = self.summary()
            names = set(self.files()) | {"summary.json"}
            summary["files"] = sorted(names)
            write_json(path, summary)
            listing = self.files()
            too_big = [n for n, s in listing.items() if not isinstance(s, int) or s > MAX_FILE_BYTES]
            if len(listing) > MAX_FILES or too_big:
                summary["files_error"] = "%d files in %s (at most %d), too big or not plain: %s" % (
                    len(listing), self.out, MAX_FILES, too_big)
                summary["ok"] = False
                write_json(path, summary)
            ok = bool(summary["ok"])
            self.say("gpu_check: %s in %.1f s (deadline %.0f s), %d files in %s; %s" % (
                "OK" if ok else "NOT OK", self.elapsed(), self.deadline_s, len(listing), self.out,
                "not ok: " + "; ".join(summary["not_ok"]) if summary["not_ok"] else "no piece failed"))
            if summary.get("files_error"):
                self.say("gpu_check: " + summary["files_error"])
        except BaseException as e:  # noqa: BLE001 - last resort: a minimal summary
            try:
                write_json(path, {"gpu": False, "mode": "dry-run" if self.dry else "gpu", "ok": False,
                                  "error": "summary failed: %s\n%s" % (e, traceback.format_exc()[-2000:]),
                                  "deadline_s": self.deadline_s, "total_s": round(self.elapsed(), 1),
                                  "pieces": self.pieces})
            except BaseException:  # noqa: BLE001
                pass
        finally:
            try:
                self.check_log.close()
                for log in ("check.log", "build.log", "tests.log"):
                    self.cap_file(os.path.join(self.out, log))
            except OSError:
                pass
            shutil.rmtree(self.tmp, ignore_errors=True)
            if self.own_build:
                shutil.rmtree(self.build, ignore_errors=True)
        return ok


def median_tokens_per_s(steps):
    """The median tokens/s of the example's step records after the first (which warms up)."""
    rates = sorted(s["tokens_per_s"] for s in steps[1:] or steps)
    return rates[len(rates) // 2]


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


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


def configure_args(build, torch_root, torch_python, path=None):
    """The GPU configuration (no MPI, GoogleTest/CLI11/json from .third_party), one place for the GPU
    machine, the dry run and `prebuild`, so that carried binaries are built as the GPU machine would build them."""
    args = ["cmake", "-S", ROOT, "-B", build]
    if shutil.which("ninja", path=path):
        args += ["-G", "Ninja"]
    args += ["-DCMAKE_BUILD_TYPE=Release", "-DTWOBP_WITH_MPI=OFF", "-DTWOBP_BUILD_EXAMPLES=ON",
             "-DTWOBP_GTEST_SOURCE_DIR=%s/.third_party/googletest" % ROOT,
             "-DTWOBP_THIRD_PARTY_INCLUDE_DIR=%s/.third_party/include" % ROOT]
    if torch_root:
        args.append("-DCMAKE_PREFIX_PATH=%s/share/cmake" % torch_root)
    if torch_python:
        args.append("-DPython3_EXECUTABLE=%s" % torch_python)
    if os.path.isdir("/usr/local/cuda"):
        args.append("-DCUDAToolkit_ROOT=/usr/local/cuda")
    return args


def gpu_tests_from_ctest(text, build):
    """The tests of `ctest -L gpu --show-only=json-v1` output: name, binary, mpi (launched by mpiexec), timeout."""
    j = json.loads(text[text.index("{"):text.rindex("}") + 1])
    found = []
    for t in j.get("tests", []):
        props = {p["name"]: p.get("value") for p in t.get("properties", [])}
        cmd = t.get("command") or []
        workdir = props.get("WORKING_DIRECTORY") or build
        exe = cmd[0] if cmd else os.path.join(workdir, t["name"])
        mpi = bool(cmd) and re.search(r"(mpiexec|mpirun|srun|orterun)$", os.path.basename(cmd[0]))
        mpi = mpi or (not cmd and re.search(r"_np\d+$", t["name"]))
        found.append({"name": t["name"], "binary": exe, "mpi": bool(mpi),
                      "timeout": float(props.get("TIMEOUT") or 600)})
    return found


def torch_version(torch_root):
    """The torch package's version string, read from its version.py (without importing torch)."""
    for line in open(os.path.join(torch_root, "version.py")):
        m = re.match(r"^__version__\b[^=]*=\s*['\"]([^'\"]*)", line)
        if m:
            return m.group(1)
    return ""


def torch_lib_dirs(torch_root):
    """torch's lib/ and the CUDA, NCCL, cuDNN... libraries of the pip packages beside it (site-packages/nvidia)."""
    dirs = [os.path.join(torch_root, "lib")]
    nvidia = os.path.join(os.path.dirname(torch_root), "nvidia")
    if os.path.isdir(nvidia):
        dirs += sorted(os.path.join(nvidia, d, "lib") for d in os.listdir(nvidia)
                       if os.path.isdir(os.path.join(nvidia, d, "lib")))
    return dirs


def source_digest():
    """sha256 over the files the binaries are built from (DIGEST_PATHS): equal on the GPU machine's copy of the
    tree exactly when the carried binaries are of these sources."""
    import hashlib
    h = hashlib.sha256()
    for top in DIGEST_PATHS:
        full = os.path.join(ROOT, top)
        files = [full] if os.path.isfile(full) else []
        for base, dirs, names in os.walk(full):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(base, n) for n in sorted(names) if not n.endswith((".pyc", ".swp"))]
        for f in files:
            h.update(os.path.relpath(f, ROOT).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def git_exclude(entry):
    """Adds entry to the checkout's info/exclude once (git-ignored locally; right in a worktree too)."""
    try:
        exclude = subprocess.run(["git", "-C", ROOT, "rev-parse", "--git-path", "info/exclude"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        exclude = os.path.join(ROOT, exclude)
        os.makedirs(os.path.dirname(exclude), exist_ok=True)
        lines = open(exclude).read().splitlines() if os.path.exists(exclude) else []
        if entry not in lines:
            with open(exclude, "a") as f:
                f.write(entry + "\n")
    except (OSError, subprocess.SubprocessError):
        pass


def prebuild():
    """HERE: builds the GPU configuration's twobp_bench and gpu tests (the CUDA build of the torch wheel compiles and
    links GPU code without a GPU) into build-gpu-carry and copies them, with a manifest, into .gpu-prebuilt/ to
    carry: the GPU machine then skips its build (minutes of the loan) when they are of the same sources and load
    there. Returns the exit status."""
    prepare(quiet=True)
    py = os.environ.get("GPU_CHECK_TORCH_PYTHON", "")
    if not py:
        print("gpu_check prebuild: no Python with torch found (set PYTHON)", file=sys.stderr)
        return 1
    probe = "import importlib.util as u, os; print(os.path.dirname(u.find_spec('torch').origin))"
    torch_root = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    version = torch_version(torch_root)
    digest = source_digest()
    jobs = str(int(os.environ.get("JOBS") or os.cpu_count() or 2))
    configure = configure_args(PREBUILT_BUILD, torch_root, py)
    subprocess.run(configure, check=True)
    show = subprocess.run(["ctest", "--test-dir", PREBUILT_BUILD, "-L", "gpu", "--show-only=json-v1"],
                          capture_output=True, text=True, check=True).stdout
    tests = [t for t in gpu_tests_from_ctest(show, PREBUILT_BUILD) if not t["mpi"]]
    targets = ["twobp_bench", "llama_pipeline"] + [t["name"] for t in tests]
    subprocess.run(["cmake", "--build", PREBUILT_BUILD, "-j", jobs, "--target"] + targets, check=True)
    if source_digest() != digest:
        print("gpu_check prebuild: the sources changed during the build; run it again", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix=".gpu-prebuilt.new.", dir=ROOT)
    try:
        shutil.copy2(os.path.join(PREBUILT_BUILD, "benchmarks", "twobp_bench"), os.path.join(work, "twobp_bench"))
        shutil.copy2(os.path.join(PREBUILT_BUILD, "examples", "llama_pipeline"),
                     os.path.join(work, "llama_pipeline"))
        for t in tests:
            shutil.copy2(t["binary"], os.path.join(work, t["name"]))
        manifest = {"digest": digest, "torch": version, "targets": targets, "bench": "twobp_bench",
                    "example": "llama_pipeline", "tests": [dict(t, binary=t["name"]) for t in tests],
                    "built_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                    "built_on": socket.gethostname(), "configure": configure}
        write_json(os.path.join(work, "manifest.json"), manifest)
        size = dir_bytes(work) / 2**20
        if size > PREBUILT_MAX_MIB:
            print("gpu_check prebuild: %.1f MiB, over %d MiB" % (size, PREBUILT_MAX_MIB), file=sys.stderr)
            return 1
        shutil.rmtree(PREBUILT, ignore_errors=True)
        os.rename(work, PREBUILT)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    git_exclude("/.gpu-prebuilt/")
    print("gpu_check prebuild: %s in %s (%.1f MiB, torch %s, sources %s): carry .gpu-prebuilt and .third_party"
          % (", ".join(targets), PREBUILT, dir_bytes(PREBUILT) / 2**20, version, digest[:12]))
    return 0


def torch_root_from_cache(build):
    """The torch package directory a CPU build used (when no Python can tell: a CPU-only install)."""
    try:
        for line in open(os.path.join(build, "CMakeCache.txt")):
            if line.startswith("Torch_DIR:") or line.startswith("TORCH_LIBRARY:"):
                value = line.split("=", 1)[1].strip()
                m = re.match(r"^(.*/torch)/(share/cmake/Torch|lib/libtorch\.so)$", value)
                if m:
                    return m.group(1)
    except OSError:
        pass
    return None


def third_party_complete(tp):
    return (os.path.isdir(os.path.join(tp, "googletest")) and os.path.isfile(os.path.join(tp, "include/CLI/CLI.hpp"))
            and os.path.isfile(os.path.join(tp, "include/nlohmann/json.hpp")))


def prepare(quiet=False, force=False):
    """Copies what the GPU image lacks into .third_party/ (git-ignored): GoogleTest's sources, CLI11's and
    nlohmann/json's headers. Atomic (built aside, then renamed) and locked, so two dry runs at once are safe."""
    import fcntl
    import hashlib
    tp = os.path.join(ROOT, ".third_party")
    lock_path = os.path.join(tempfile.gettempdir(), "gpu_check_prepare.%s.lock"
                             % hashlib.sha1(ROOT.encode()).hexdigest()[:12])
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and third_party_complete(tp):
            return
        sources = {"googletest": "/usr/src/googletest", "include/CLI": "/usr/include/CLI",
                   "include/nlohmann": "/usr/include/nlohmann"}
        missing = [s for s in sources.values() if not os.path.isdir(s)]
        if missing:
            raise RuntimeError("cannot prepare .third_party: missing %s (install libgtest-dev, libcli11-dev, "
                               "nlohmann-json3-dev)" % ", ".join(missing))
        work = tempfile.mkdtemp(prefix=".third_party.new.", dir=ROOT)
        try:
            for dest, src in sources.items():
                shutil.copytree(src, os.path.join(work, dest), symlinks=False)
            old = None
            if os.path.exists(tp):
                old = tp + ".old.%d" % os.getpid()
                os.rename(tp, old)
            os.rename(work, tp)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        git_exclude("/.third_party/")
    if not quiet:
        print("gpu_check: .third_party prepared: %.1f MiB" % (dir_bytes(tp) / 2**20))


def main(argv):
    if argv[:1] == ["prepare"]:
        prepare(force=True)
        return 0
    if argv[:1] == ["prebuild"]:
        return prebuild()
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description="see the header of scripts/gpu_check.sh")
    ap.add_argument("--dry-run", action="store_true", help="the CPU-side check (this machine)")
    ap.add_argument("--deadline", type=float, default=float(os.environ.get("GPU_CHECK_DEADLINE") or 450),
                    help="overall deadline in seconds (GPU_CHECK_DEADLINE, default 450)")
    ap.add_argument("--build-dir", help="the GPU configuration's build directory (GPU_CHECK_BUILD_DIR)")
    ap.add_argument("--only", help="comma-separated globs: run only the measure:/test: pieces they match (with or "
                                   "without the prefix); set-up pieces always run")
    ap.add_argument("outdir")
    args = ap.parse_args(argv)
    try:
        t0 = float(os.environ.get("GPU_CHECK_T0", ""))
        args.t0 = now() - max(0.0, min(time.time() - t0, 120.0))  # the wrapper's start (bounded, in case)
    except ValueError:
        args.t0 = now()
    try:
        check = Check(args)
    except Exception as e:  # noqa: BLE001 - still leave a summary where one is expected
        os.makedirs(args.outdir, exist_ok=True)
        write_json(os.path.join(args.outdir, "summary.json"),
                   {"gpu": False, "mode": "dry-run" if args.dry_run else "gpu", "ok": False, "pieces": [],
                    "error": "gpu_check could not start: %r\n%s" % (e, traceback.format_exc()[-2000:]),
                    "deadline_s": args.deadline, "total_s": round(now() - args.t0, 1)})
        raise

    def on_signal(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        check.run()
    except Interrupted as e:
        check.interrupted = str(e)
        check.say("gpu_check: interrupted by %s: writing the summary" % e)
    except BaseException as e:  # noqa: BLE001 - the summary is written whatever happened
        check.error = "gpu_check crashed: %r\n%s" % (e, traceback.format_exc()[-3000:])
        check.say(check.error)
    finally:
        ok = check.finish()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
