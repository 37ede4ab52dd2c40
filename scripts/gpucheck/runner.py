"""The runner: pieces under timeouts in their own process groups, one deadline, fault injection, the logs and
summary.json. It knows nothing of what a piece measures; the profiles (profiles.py) say which pieces run, the piece
modules what each does and what it adds to the summary (a *section*).

Every step is a *piece*: a command under its own timeout, in its own process group (killed as a group: SIGTERM,
then SIGKILL after a grace period), recorded as {name, status: pass|fail|timeout|skipped, seconds, detail}. One
overall deadline bounds the run: a piece's timeout is min(its own, what is left), and a piece that no longer fits
(less left than the minimum it declares) is recorded as skipped with the reason. summary.json is always written:
in a finally clause, after SIGTERM/SIGINT/SIGHUP, and after a crash of the check.
"""

import datetime
import fnmatch
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback

from .util import ROOT, head_tail, now, show, tail_lines, write_json

STATUSES = ("pass", "fail", "timeout", "skipped")

# What comes back from the device: at most 8 files, each <= 16 MiB. The logs are kept far below that.
MAX_FILES = 8
MAX_FILE_BYTES = 16 << 20
LOG_CAP = 2 << 20          # each log: its first LOG_HEAD bytes and its last LOG_CAP - LOG_HEAD
LOG_HEAD = 256 << 10
PIECE_HEAD = 32 << 10      # each piece's output in a log: its first PIECE_HEAD and last PIECE_TAIL bytes
PIECE_TAIL = 480 << 10
LOGS = ("check.log", "build.log", "tests.log")

SUMMARY_RESERVE_S = 10     # left for the summary at the end of the deadline
KILL_GRACE_S = 5           # SIGTERM -> SIGKILL
# An injected hang (GPU_CHECK_INJECT) tests the kill path: its piece times out after this long, whatever its own
# timeout, and gets this long between SIGTERM and SIGKILL (it ignores SIGTERM), so that the check of it
# (tests/scripts) does not wait for nothing.
INJECTED_HANG_S = 1
INJECTED_HANG_GRACE_S = 1

# Set for every piece unless already set (recorded in summary.json's test_env). TWOBP_TEST_STACKS_ON_HANG: a
# multi-process test prints its stuck ranks' stacks before killing them (tests/common/spawn_ranks.h): a hang costs
# no second loan to locate.
TEST_ENV_DEFAULTS = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_MNNVL_ENABLE": "0",
                     "TWOBP_TEST_STACKS_ON_HANG": "1"}


class Interrupted(BaseException):
    """Raised in the main thread by the signal handler (gpu_check.py)."""


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


def parse_inject(spec):
    """GPU_CHECK_INJECT: "<piece glob>:fail|hang|crash,..." -> [(glob, action)]."""
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        pattern, _, action = item.rpartition(":")
        if action not in ("fail", "hang", "crash") or not pattern:
            raise SystemExit("gpu_check: GPU_CHECK_INJECT: '%s' is not <piece glob>:fail|hang|crash" % item)
        rules.append((pattern, action))
    return rules


class Runner:
    """One run of the check: its settings (from the command line and the environment), the pieces recorded so far,
    the sections that will make up summary.json, and what to clean up at the end.

    Contract for piece modules: run pieces through piece() or func_piece() (never subprocess directly: a command
    outside a piece has no timeout and no record), ask passed() before using another piece's result, and register
    what they contribute to the summary with add_section(name, fn) -- fn() returns a dict merged into summary.json,
    and an exception in it is recorded instead of losing the summary."""

    def __init__(self, dry, outdir, t0, deadline, only=(), opt_in=(), profile=None, stale=None):
        self.dry = dry
        self.out = os.path.abspath(outdir)
        self.t0 = t0
        self.deadline_s = deadline
        self.end = self.t0 + self.deadline_s
        self.profile = profile or {}   # {"name": ..., ...}: recorded in the summary
        self.jobs = int(os.environ.get("JOBS") or os.cpu_count() or 4)
        self.torch_python = os.environ.get("GPU_CHECK_TORCH_PYTHON", "")
        self.cpu_build = os.path.abspath(os.environ.get("GPU_CHECK_CPU_BUILD") or os.path.join(ROOT, "build"))
        self.max_piece = float(os.environ.get("GPU_CHECK_MAX_PIECE_SECONDS") or 0) or None
        self.inject = parse_inject(os.environ.get("GPU_CHECK_INJECT", ""))
        self.only = list(only)
        self.opt_in = tuple(opt_in)
        self.pieces, self.by_name = [], {}
        self.provided = set()      # pieces whose result carried binaries stand for (recorded as skipped)
        self.sections = []         # (name, fn): fn() -> dict merged into summary.json
        self.cleanups = []         # callables run after the summary is written
        self.error = None
        self.interrupted = None
        self.tmp = tempfile.mkdtemp(prefix="gpu_check.")
        self.env = dict(os.environ)
        self.test_env = {k: self.env.get(k, v) for k, v in TEST_ENV_DEFAULTS.items()}
        self.env.update(self.test_env)
        if os.path.isdir("/usr/local/cuda/bin"):
            self.env["PATH"] = "/usr/local/cuda/bin:" + self.env.get("PATH", "")
        os.makedirs(self.out, exist_ok=True)
        for name in os.listdir(self.out):  # stale results of an earlier run must not be summarized
            if name in ("summary.json",) + LOGS or (stale and re.match(stale, name)):
                os.remove(os.path.join(self.out, name))
        self.check_log = open(os.path.join(self.out, "check.log"), "a", buffering=1, encoding="utf-8")

    # ---- bookkeeping ----
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
        """--only: measurements and tests outside its globs are skipped (set-up pieces always run); opt-in pieces
        (the profile's) run only when a glob names them."""
        if not name.startswith(("measure:", "test:")):
            return True
        named = any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(name.split(":", 1)[1], g) for g in self.only)
        if any(fnmatch.fnmatchcase(name, g) for g in self.opt_in):
            return named
        return named or not self.only

    def not_selected(self):
        return "not selected (%s)" % ("--only " + ",".join(self.only) if self.only else
                                      "runs only when --only names it: " + ", ".join(self.opt_in))

    def provide(self, name, what):
        """Records a set-up piece that carried prebuilt binaries make unnecessary; later pieces may need it."""
        self.provided.add(name)
        return self.record(name, "skipped", 0, "carried prebuilt binaries used: " + what)

    def add_section(self, name, fn):
        self.sections.append((name, fn))

    def append_log(self, log, header, data):
        path = os.path.join(self.out, log)
        with open(path, "ab") as f:
            f.write(("\n===== %s\n" % header).encode())
            f.write(head_tail(data, PIECE_HEAD, PIECE_TAIL))
        cap_file(path)

    # ---- running a piece ----
    def skipped(self, name, needs, reason, action):
        """Records name as skipped and returns its record when it does not run: a reason given or not selected by
        --only (unless a fault is injected there: it stands for the piece), or a piece it needs did not pass."""
        if reason and not action:
            return self.record(name, "skipped", 0, reason)
        if not self.selected(name) and not action:
            return self.record(name, "skipped", 0, self.not_selected())
        for need in needs:
            if not self.passed(need):
                st = self.by_name[need]["status"] if need in self.by_name else "not run"
                return self.record(name, "skipped", 0, "needs %s (%s)" % (need, st))
        return None

    def piece(self, name, cmd, timeout, min_s=5, log="check.log", needs=(), cwd=None, env=None, analyze=None,
              skip_reason=None):
        """Runs cmd as one piece. analyze(text, rc, timed_out, status, detail) -> (status, detail, extra) refines
        the result; the default: pass on exit 0, fail otherwise, timeout when killed. Returns (piece, output)."""
        action = self.injected(name)
        if action == "crash":
            raise RuntimeError("injected crash of the orchestrator at piece %s" % name)
        skipped = self.skipped(name, needs, skip_reason, action)
        if skipped:
            return skipped, ""
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
            gone, sig = kill_group(proc.pid, INJECTED_HANG_GRACE_S if action == "hang" else KILL_GRACE_S)
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

    def func_piece(self, name, fn, log="check.log", needs=()):
        """An in-process piece: fn() -> detail or raises; fault injection still replaces it by a command. Only for
        work that cannot hang (reading files, arithmetic): it has no timeout."""
        if self.injected(name):
            return self.piece(name, ["true"], 30, log=log)[0]
        skipped = self.skipped(name, needs, None, None)
        if skipped:
            return skipped
        start = now()
        try:
            detail = fn()
            return self.record(name, "pass", now() - start, detail)
        except Exception as e:  # noqa: BLE001
            return self.record(name, "fail", now() - start, str(e)[:400])

    # ---- the summary ----
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
        summary.update(self.profile)
        if self.interrupted:
            summary["interrupted_by"] = self.interrupted
        if self.error:
            summary["error"] = self.error
        for name, fn in self.sections:
            try:
                summary.update(fn())
            except Exception as e:  # noqa: BLE001 - a summary with the reason beats no summary
                summary[name] = {"error": "%s: %s" % (type(e).__name__, e)}
                problems.append("%s: %s" % (name, e))
        summary["gpu"] = bool(summary["gpu"]) and not self.dry
        summary["test_env"] = self.test_env
        summary["inject"] = os.environ.get("GPU_CHECK_INJECT") or None
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
        """Writes summary.json whatever happened (a minimal one if the summary itself fails), caps the logs and
        cleans up. Returns whether the run was ok."""
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
                for log in LOGS:
                    cap_file(os.path.join(self.out, log))
            except OSError:
                pass
            shutil.rmtree(self.tmp, ignore_errors=True)
            for fn in self.cleanups:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - cleaning up must not lose the result
                    pass
        return ok


def cap_file(path):
    """Keeps a log under LOG_CAP: its head and its tail."""
    try:
        if os.path.getsize(path) <= LOG_CAP:
            return
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(head_tail(data, LOG_HEAD, LOG_CAP - LOG_HEAD - 100))
    except OSError:
        pass
