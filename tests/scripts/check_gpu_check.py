#!/usr/bin/env python3
"""Runs scripts/gpu_check.sh --dry-run on this CPU machine and checks what it leaves in its output directory.

usage: check_gpu_check.py dry-run|injected|prebuilt SCRIPT CPU_BUILD WORK_DIR

  dry-run   the plain dry run (deadline 200 s), given carried binaries whose manifest names other sources
            (GPU_CHECK_PREBUILT, stale): "prebuilt" skipped with that reason, so the check configures, builds
            and checks its targets as without carried binaries; exit 0, "gpu": false, every piece passed or was
            skipped with a reason (the gpu tests skip without a GPU), the measurements (the example's two runs
            and their comparison included) and the summary's stage costs present, the opt-in pieces skipped as
            such, exactly the 8 expected files
  injected  the dry run with GPU_CHECK_INJECT="env:tools:hang,measure:split_seq16:fail", a 150 s deadline and
            --only measure:split_seq16,measure:simulate_seq16: exit 1,
            env:tools recorded as timeout (its process group killed, SIGTERM ignored so SIGKILL was needed),
            measure:split_seq16 as fail, measure:simulate_seq16 skipped because of it, every other piece passed or
            was skipped with a reason, the summary written and the run ended before its deadline
  prebuilt  the dry run with carried binaries (GPU_CHECK_PREBUILT: this build's twobp_bench, llama_pipeline and
            gpu tests with a manifest of these sources) and --only naming one split measurement (twobp_bench), the
            opt-in pieces (llama_pipeline: the example's memory estimate against its measured peak) and the tests:
            exit 0, "prebuilt" passed (they load), configure/targets/discover/build:* skipped as provided by them,
            the named measurements run with the carried binaries (the plain dry run runs the others)

Each fails when summary.json is missing, unreadable or wrong. After checking the real summary, the checker also
checks itself: broken copies of that summary (no pieces, an unknown status, "gpu": true, ...) must be rejected.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import time

STATUSES = {"pass", "fail", "timeout", "skipped"}
FILES = {"summary.json", "check.log", "build.log", "tests.log", "split_seq16.json", "split_seq32.json",
         "simulate_seq16.json", "simulate_seq32.json"}
DEADLINE = {"dry-run": 200, "injected": 150, "prebuilt": 200}
PROVIDED = ("configure", "targets", "discover", "build:library", "build:twobp_bench", "build:llama_pipeline")
INJECT = "env:tools:hang,measure:split_seq16:fail"
# --only per mode. The prebuilt run names one measurement of each carried program, the opt-in pieces (the example's
# memory: they run only when named) and every test; the injected run checks the runner, which one measurement and its simulation show as well as all of them
# (the plain and prebuilt runs cover the rest).
ONLY = {"prebuilt": "measure:split_seq16,measure:example_memory*,test:*",
        "injected": "measure:split_seq16,measure:simulate_seq16"}
# The stage costs each mode's summary must hold (None: none, the injected failure stops seq16's).
COSTS = {"dry-run": "seq32", "prebuilt": None, "injected": None}


def check_common(s, files, wall, deadline, need):
    """What every dry run's summary must be, whatever its profile (need(cond, msg) records a problem): an object,
    "gpu" false, at most 8 files of at most 16 MiB, well-formed pieces (a name, a status, seconds, a detail; a
    reason when skipped), the deadline as expected and kept, the NCCL settings. Returns the pieces by name, or None
    when the summary is too broken to look further."""
    if not need(isinstance(s, dict), "summary.json is not an object"):
        return None
    need(s.get("gpu") is False, '"gpu" is %r, not false' % s.get("gpu"))
    need(s.get("mode") == "dry-run", '"mode" is %r' % s.get("mode"))
    need(len(files) <= 8, "%d files in the output directory (at most 8): %s" % (len(files), sorted(files)))
    need(all(size <= 16 << 20 for size in files.values()), "a file over 16 MiB: %s" % files)
    need("summary.json" in files, "no summary.json among the files")
    pieces = s.get("pieces")
    if not need(isinstance(pieces, list) and pieces, '"pieces" is missing or empty'):
        return None
    by_name = {}
    for p in pieces:
        if not need(isinstance(p, dict) and isinstance(p.get("name"), str) and p["name"], "a piece without a name: %r"
                    % (p,)):
            continue
        name = p["name"]
        need(name not in by_name, "piece %s recorded twice" % name)
        by_name[name] = p
        need(p.get("status") in STATUSES, "piece %s: status %r" % (name, p.get("status")))
        need(isinstance(p.get("seconds"), (int, float)) and not isinstance(p.get("seconds"), bool)
             and p["seconds"] >= 0, "piece %s: seconds %r" % (name, p.get("seconds")))
        need(isinstance(p.get("detail"), str), "piece %s: detail %r" % (name, p.get("detail")))
        if p.get("status") == "skipped":
            need(bool(p.get("detail")), "piece %s skipped without a reason" % name)
    got, total = s.get("deadline_s"), s.get("total_s")
    need(got == deadline, "deadline_s %r, expected %r" % (got, deadline))
    need(isinstance(total, (int, float)) and isinstance(got, (int, float)) and total < got,
         "total_s %r is not under deadline_s %r" % (total, got))
    need(s.get("ended_before_deadline") is True, "ended_before_deadline is %r" % s.get("ended_before_deadline"))
    need(wall < deadline + 15, "the run took %.0f s, deadline %d s" % (wall, deadline))
    env = s.get("test_env") or {}
    need(env.get("NCCL_DEBUG") and env.get("NCCL_DEBUG_SUBSYS") and "NCCL_MNNVL_ENABLE" in env,
         "test_env lacks the NCCL settings: %r" % env)
    return by_name


def validate(mode, s, files, rc, wall):
    """Problems of one run: its summary s, the files of its output directory {name: bytes}, its exit code and
    wall time."""
    bad = []

    def need(cond, msg):
        if not cond:
            bad.append(msg)
        return cond

    by_name = check_common(s, files, wall, DEADLINE[mode], need)
    if by_name is None:
        return bad
    pieces = s["pieces"]
    need(isinstance(s.get("gpu_tests"), dict) and s["gpu_tests"], "gpu_tests is empty")
    carried = mode == "prebuilt"
    measured = {"injected": (), "prebuilt": ("measure:split_seq16",)}.get(mode, (
        "measure:split_seq32", "measure:simulate_seq32", "measure:example_2bp", "measure:example_standard",
        "measure:example_compare"))
    for name in ("env:torch", "third_party", "summary") + measured + (("prebuilt",) if carried else PROVIDED):
        need(by_name.get(name, {}).get("status") == "pass", "piece %s: %s" % (name, by_name.get(name)))
    for name in PROVIDED if carried else ():
        p = by_name.get(name, {})
        need(p.get("status") == "skipped" and "carried prebuilt binaries used" in p.get("detail", ""),
             "piece %s is not provided by the carried binaries: %s" % (name, p))
    memory = ("measure:example_memory_2bp_estimate", "measure:example_memory_2bp",
              "measure:example_memory_standard_estimate", "measure:example_memory_standard")
    for name in memory:  # opt-in: they run when --only names them (the prebuilt mode's run), else are skipped
        p = by_name.get(name, {})
        if carried:
            need(p.get("status") == "pass", "piece %s: %s" % (name, p))
            need(name.endswith("_estimate") or "measured/estimate" in p.get("detail", ""), "piece %s: %s" % (name, p))
        else:
            need(p.get("status") == "skipped" and ("runs only when --only names it" in p.get("detail", "")
                                                   or "not selected" in p.get("detail", "")),
                 "opt-in piece %s ran without being named: %s" % (name, p))
    if mode == "dry-run":  # its carried binaries are of other sources
        p = by_name.get("prebuilt", {})
        need(p.get("status") == "skipped" and "other sources" in p.get("detail", ""), "piece prebuilt: %s" % p)
    tests = [p for n, p in by_name.items() if n.startswith("test:")]
    need(tests, "no test: piece")
    for p in tests:
        need(p.get("status") in ("pass", "skipped"), "piece %s: %s %s" % (p["name"], p.get("status"), p.get("detail")))
    need(any(n.startswith("list:") for n in by_name), "no list: piece")
    if COSTS[mode]:
        costs = (s.get("stage_costs") or {}).get(COSTS[mode]) or {}
        need(isinstance(costs.get("forward_ms"), (int, float)) and costs["forward_ms"] > 0,
             "stage_costs.%s.forward_ms: %r" % (COSTS[mode], costs.get("forward_ms")))
        need(bool(costs.get("simulated_4gpu_m8_speedup_2bp_over_standard")),
             "no simulated speedups for %s" % COSTS[mode])

    if mode != "injected":
        need(rc == 0, "exit code %r, expected 0" % rc)
        need(s.get("ok") is True and not s.get("not_ok"), "ok %r, not_ok %r" % (s.get("ok"), s.get("not_ok")))
        # Carried: nothing is configured or built, and only seq16's split is measured.
        expected = {"summary.json", "check.log", "tests.log", "split_seq16.json"} if carried else FILES
        need(set(files) == expected, "files %s, expected %s" % (sorted(files), sorted(expected)))
        if not carried:
            for name in ("measure:split_seq16", "measure:simulate_seq16"):
                need(by_name.get(name, {}).get("status") == "pass", "piece %s: %s" % (name, by_name.get(name)))
            need("seq16" in (s.get("stage_costs") or {}), "no stage_costs.seq16")
        for p in pieces:
            need(p.get("status") in ("pass", "skipped"), "piece %s: %s" % (p.get("name"), p.get("status")))
    else:
        need(rc == 1, "exit code %r, expected 1" % rc)
        need(s.get("ok") is False, "ok is %r with an injected failure" % s.get("ok"))
        expected = {"summary.json", "check.log", "build.log", "tests.log"}  # the failed split wrote no JSON
        need(set(files) == expected, "files %s, expected %s" % (sorted(files), sorted(expected)))
        need(s.get("inject") == INJECT, "inject %r" % s.get("inject"))
        hang = by_name.get("env:tools", {})
        need(hang.get("status") == "timeout" and hang.get("injected") == "hang", "env:tools: %s" % hang)
        need(hang.get("group_cleaned") is True, "env:tools: its process group was not cleaned up: %s" % hang)
        need("SIGKILL" in hang.get("detail", ""), "env:tools: the group ignores SIGTERM, yet no SIGKILL: %s" % hang)
        fail = by_name.get("measure:split_seq16", {})
        need(fail.get("status") == "fail" and fail.get("injected") == "fail", "measure:split_seq16: %s" % fail)
        dep = by_name.get("measure:simulate_seq16", {})
        need(dep.get("status") == "skipped" and "measure:split_seq16" in dep.get("detail", ""),
             "measure:simulate_seq16: %s" % dep)
        need(sorted(s.get("not_ok") or []) == ["env:tools", "measure:split_seq16"], "not_ok %r" % s.get("not_ok"))
        for p in pieces:
            if p.get("name") not in ("env:tools", "measure:split_seq16"):
                need(p.get("status") in ("pass", "skipped"), "piece %s: %s %s" % (p.get("name"), p.get("status"),
                                                                                 p.get("detail")))
    return bad


def self_test(mode, s, files, rc, wall):
    """The checker must be able to fail: each broken copy of a good summary is rejected."""
    def broken(fn):
        c = copy.deepcopy(s)
        fn(c)
        return c

    cases = {
        "no pieces": broken(lambda c: c.pop("pieces")),
        "gpu true": broken(lambda c: c.update(gpu=True)),
        "unknown status": broken(lambda c: c["pieces"][0].update(status="passed")),
        "no seconds": broken(lambda c: c["pieces"][-1].pop("seconds")),
        "after the deadline": broken(lambda c: c.update(total_s=c["deadline_s"] + 1)),
        "configure failed": broken(lambda c: [p.update(status="fail") for p in c["pieces"]
                                              if p["name"] == "configure"]),
        "skipped without reason": broken(lambda c: [p.update(status="skipped", detail="") for p in c["pieces"]
                                                    if p["name"].startswith("test:")]),
    }
    if COSTS[mode]:
        cases["no stage costs"] = broken(lambda c: c.update(stage_costs={}))
    if mode == "prebuilt":  # the carried binaries must stand for the build, not the build run anyway
        cases["build:library run"] = broken(lambda c: [p.update(status="pass", detail="built") for p in c["pieces"]
                                                       if p["name"] == "build:library"])
    problems = []
    for what, c in cases.items():
        if not validate(mode, c, files, rc, wall):
            problems.append("self-test: a summary with '%s' was accepted" % what)
    if not validate(mode, s, dict(files, **{"extra%d.log" % i: 1 for i in range(3)}), rc, wall):
        problems.append("self-test: 11 files were accepted")
    if not validate(mode, s, files, 0 if rc else 1, wall):
        problems.append("self-test: the wrong exit code was accepted")
    if not validate(mode, None, files, rc, wall):
        problems.append("self-test: a missing summary was accepted")
    return problems


def carried_binaries(script, cpu_build, dest, stale):
    """What `gpu_check.sh prebuild` would leave, made of this CPU build's binaries: twobp_bench, the gpu tests that
    run without MPI, and a manifest with the sources' digest (another one when stale) and the build's torch."""
    sys.path.insert(0, os.path.dirname(script))
    from gpucheck import carry, util
    show = subprocess.run(["ctest", "--test-dir", cpu_build, "-L", "gpu", "--show-only=json-v1"],
                          capture_output=True, text=True, check=True).stdout
    tests = [t for t in carry.gpu_tests_from_ctest(show, cpu_build) if not t["mpi"]]
    os.makedirs(dest)
    shutil.copy2(os.path.join(cpu_build, "benchmarks", "twobp_bench"), os.path.join(dest, "twobp_bench"))
    shutil.copy2(os.path.join(cpu_build, "examples", "llama_pipeline"),
                 os.path.join(dest, "llama_pipeline"))
    for t in tests:
        shutil.copy2(t["binary"], os.path.join(dest, t["name"]))
    version = carry.torch_version(carry.torch_root_from_cache(cpu_build))
    util.write_json(os.path.join(dest, "manifest.json"), {
        "digest": "0" * 64 if stale else carry.source_digest(), "torch": version, "bench": "twobp_bench",
        "example": "llama_pipeline", "targets": ["twobp_bench", "llama_pipeline"] + [t["name"] for t in tests],
        "built_utc": "test",
        "tests": [dict(t, binary=t["name"]) for t in tests]})
    return dest


def dry_run(script, options, env, deadline, work):
    """Runs `gpu_check.sh --dry-run OPTIONS WORK/out` under env (deadline GPU_CHECK_DEADLINE). Returns (exit code,
    wall seconds, {file: bytes} of the output directory, the summary or None)."""
    out = os.path.join(work, "out")
    env = dict(env, GPU_CHECK_DEADLINE=str(deadline))
    start = time.monotonic()
    try:
        rc = subprocess.run(["bash", script, "--dry-run"] + options + [out], env=env, timeout=deadline + 60).returncode
    except subprocess.TimeoutExpired:
        rc = "killed after %d s" % (deadline + 60)
    wall = time.monotonic() - start
    print("check_gpu_check: %s: exit %s after %.1f s" % (" ".join(options) or "default", rc, wall))
    files = {n: os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)} if os.path.isdir(out) else {}
    try:
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError) as e:
        print("check_gpu_check: no readable summary.json: %s" % e)
        summary = None
    return rc, wall, files, summary


def check_environment(cpu_build, work):
    """The environment of a checked dry run: this CPU build, no inherited build dir or fault injection, a fresh WORK
    directory."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    env = dict(os.environ, GPU_CHECK_CPU_BUILD=cpu_build)
    for k in ("GPU_CHECK_BUILD_DIR", "GPU_CHECK_INJECT", "GPU_CHECK_DEADLINE"):
        env.pop(k, None)
    env.setdefault("PYTHON", sys.executable)
    return env


def report(mode, summary, files, problems, work):
    """Prints the pieces and the verdict; returns the exit code of the checker."""
    leftovers = [n for n in os.listdir(work) if n.startswith("build-gpu-dry.")]
    if leftovers:
        problems.append("the dry run's build directory was left behind: %s" % leftovers)
    for p in summary.get("pieces", []) if isinstance(summary, dict) else []:
        print("  %-72s %-7s %6.1f s  %s" % (p.get("name"), p.get("status"), p.get("seconds") or 0,
                                           str(p.get("detail"))[:100]))
    if problems:
        print("check_gpu_check: FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("check_gpu_check: %s OK (%d pieces, %d files, %.1f s of a %d s deadline)" % (
        mode, len(summary["pieces"]), len(files), summary["total_s"], summary["deadline_s"]))
    return 0


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in DEADLINE:
        sys.exit(__doc__)
    mode, script, cpu_build, work = sys.argv[1:]
    env = check_environment(cpu_build, work)
    if mode == "injected":
        env.update(GPU_CHECK_INJECT=INJECT, GPU_CHECK_MAX_PIECE_SECONDS="90")
    if mode in ("prebuilt", "dry-run"):
        env["GPU_CHECK_PREBUILT"] = carried_binaries(script, cpu_build, os.path.join(work, "prebuilt"),
                                                     stale=mode == "dry-run")
    only = ["--only", ONLY[mode]] if mode in ONLY else []
    rc, wall, files, summary = dry_run(script, only, env, DEADLINE[mode], work)
    if summary is None:
        return report(mode, summary, files, ["no readable summary.json"], work)
    problems = validate(mode, summary, files, rc, wall)
    if not problems:
        problems = self_test(mode, summary, files, rc, wall)
    return report(mode, summary, files, problems, work)


if __name__ == "__main__":
    sys.exit(main())
