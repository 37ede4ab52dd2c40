"""The gpu test pieces: every test that ctest labels `gpu` in the GPU configuration is built, listed, and run one
gtest suite per piece (or one case per piece in suites of at most PER_CASE_MAX cases), the 4-rank NCCL case last;
gtest's streaming output is parsed, so the cases that passed before a kill are still reported."""

import fnmatch
import os

from .util import tail_lines

LAST_PATTERN = "*FourRanks*"          # test cases run after everything else (the 4-rank NCCL test)
HELPER_SUITES = ("NcclRank",)         # suites that only run as child processes of another test
PER_CASE_MAX = 8                      # suites of at most this many cases run one piece per case (own timeout)
DEFAULT_TEST_TIMEOUT_S = 240          # one test piece's (GPU_CHECK_TEST_TIMEOUT); the last ones get ctest's


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


class GpuTests:
    """build:<test>, list:<test>, test:<test>:<suite or case> for the tests Build discovered."""

    def __init__(self, run, build):
        self.run, self.build = run, build
        self.tests = {}        # test name -> {binary, suites, streams}
        run.add_section("gpu_tests", self.summary)

    def pieces(self):
        build = self.build
        for t in build.discovered:
            if not t["mpi"]:
                build.build_piece("build:" + t["name"], [t["name"]], 300, needs=("build:library",))
        for t in build.discovered:
            self.list_piece(t)
        first, last = self.plan()
        for name, t, filt, expected, skip in first:
            self.test_piece(name, t, filt, expected, skip, False)
        for name, t, filt, expected, skip in last:
            self.test_piece(name, t, filt, expected, skip, True)

    def list_piece(self, t):
        run = self.run
        name, exe = t["name"], self.build.test_binary(t)
        info = self.tests.setdefault(name, {"binary": exe, "suites": {}, "streams": []})

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
        elif run.dry and not os.access(exe, os.X_OK):
            skip = "%s is not built in the CPU build (GPU_CHECK_CPU_BUILD)" % exe
        run.piece("list:" + name, [exe, "--gtest_list_tests"], 60, min_s=5, log="tests.log",
                  needs=self.build.needs(name), analyze=parse, skip_reason=skip)

    def plan(self):
        """(piece name, test, gtest filter, expected cases, skip reason) for every suite of every listed test
        binary: (those that run first, those that run last)."""
        first, last = [], []
        for t in self.build.discovered:
            info = self.tests.get(t["name"])
            if not info or not self.run.passed("list:" + t["name"]):
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
        info = self.tests[t["name"]]
        exe = self.build.test_binary(t)
        own = t["timeout"] if last else min(t["timeout"], float(os.environ.get("GPU_CHECK_TEST_TIMEOUT")
                                                                or DEFAULT_TEST_TIMEOUT_S))
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

        self.run.piece(name, [exe, "--gtest_filter=%s" % (filt or "-*")], own, min_s=15, log="tests.log",
                       needs=self.build.needs(t["name"]), analyze=parse, skip_reason=skip)

    # ---- the summary ----
    def results(self):
        out = {}
        for name, info in self.tests.items():
            res = {k: [] for k in ("passed", "failed", "skipped", "interrupted", "not_run")}
            failures = {}
            for s in info["streams"]:
                piece = self.run.by_name.get(s["piece"], {})
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

    @staticmethod
    def case_status(tests, pattern):
        for entry in tests.values():
            for k in ("failed", "interrupted", "passed", "skipped", "not_run"):
                if any(fnmatch.fnmatchcase(n, pattern) for n in entry.get(k, [])):
                    return {"failed": "FAILED (see tests.log)", "interrupted": "timed out (see tests.log)",
                            "not_run": "not run (see pieces)"}.get(k, k)
        return "not run (no such test here)"

    def summary(self):
        tests = self.results()
        return {"gpu_tests": tests,
                "nccl_2_processes_1_gpu": self.case_status(tests, "*NcclProcesses.TwoRanks*"),
                "nccl_4_processes_1_gpu": self.case_status(tests, "*NcclProcesses.FourRanks*")}
