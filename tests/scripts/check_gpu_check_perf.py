#!/usr/bin/env python3
"""Runs scripts/gpu_check.sh --profile perf --dry-run on this CPU machine and checks what it leaves (the perf
profile's sibling of check_gpu_check.py, whose common checks it shares).

usage: check_gpu_check_perf.py perf-part1|perf-part2|perf-injected SCRIPT CPU_BUILD WORK_DIR

  perf-part1     --part 1: exit 0; the numerics gate first (split_cuda_test run, its cases skipped without a GPU;
                 split's fast vs general path with --check in bf16-pure and bf16, the accumulating W branch among
                 the values compared); the probe of the real `twobp_bench split --help` finding bf16, bf16-pure
                 and fast; the split pieces of both precisions at both lengths run with --dtype bf16-pure / bf16 and
                 --paths fast (their JSON says so: no stand-in precision), the tiny model's size chosen by its
                 --dry-run estimate, its per-stage costs with 2BP and standard as one
                 rank holding four chunks, the planner's prediction of every schedule x mode from them; configure and
                 the builds skipped with the perf dry run's reason; the summary's split runs, issue 57's targets (not
                 judged on a CPU), the costs, the plan with the message time assumed; exactly the part's 6 files
  perf-part2     --part 2: exit 0; 4 CPU processes (launch.py, TCPStore) run 1F1B and ZB-V with 2BP and standard and
                 mixed precision; each run's peak within 10 % of the estimate; the first-step losses identical and
                 the first-step gradient norms within their tolerance; the
                 green-context emulation skipped as not implemented; exactly the part's 3 files
  perf-injected  both parts (no --part), --only naming part 1's measurements and part 2's sizing (its runs are left
                 out for time), GPU_CHECK_INJECT="measure:split_seq16_bf16-pure:fail,measure:stage_costs_2bp:hang":
                 exit 1; the failure and the hang (its group killed with SIGKILL) recorded, the plan skipped because
                 it needs the costs, the targets of seq16 unmeasured where they need the failed run, part 2's pieces
                 listed and skipped as not selected, every other piece passed or skipped, the summary written before
                 the deadline

Before running anything, the checker tests the profile's pure functions (the peak table, the split options read
from the CPU build's real `twobp_bench split --help`, the gate's verdicts, issue 57's targets, the sizing rule, the
memory, loss and gradient-norm checks, the link that gives the assumed message time, the plan's table), and runs the
probe and the split pieces through the runner on a fake twobp_bench whose help offers neither bf16, bf16-pure nor
fast: the probe must fail, the split pieces be skipped for it, and the run be not ok. After checking a real summary
it checks itself: broken copies must be rejected.
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_gpu_check as common  # noqa: E402

DEADLINE = {"perf-part1": 120, "perf-part2": 120, "perf-injected": 120}
OPTIONS = {"perf-part1": ["--profile", "perf", "--part", "1"], "perf-part2": ["--profile", "perf", "--part", "2"],
           "perf-injected": ["--profile", "perf", "--only", "measure:split_*,measure:stage_costs_*,measure:plan_*,"
                                                            "measure:nccl4_size_*"]}
INJECT = "measure:split_seq16_bf16-pure:fail,measure:stage_costs_2bp:hang"
FILES = {1: {"summary.json", "check.log", "split.json", "costs_2bp.json", "costs_standard.json", "plan.json"},
         2: {"summary.json", "check.log", "nccl4.json"}}
SKIPPED_SETUP = ("configure", "targets", "build:library", "build:twobp_bench", "build:llama_pipeline")
GATE_BUILD = "build:split_cuda_test"  # part 1's, skipped with the others
GATE_TEST = "gate:split_cuda_test"     # its cases skip without a GPU: recorded as skipped in the dry run
GATE_CHECKS = ("gate:split_check_bf16-pure", "gate:split_check_bf16")
SPLIT_KEYS = ("seq16_bf16-pure", "seq16_bf16", "seq32_bf16-pure", "seq32_bf16")
PART1 = (GATE_TEST,) + GATE_CHECKS + ("probe:split_options", "measure:split_seq16_bf16-pure",
         "measure:split_seq16_bf16",
         "measure:stage_costs_size_m2_seq16", "measure:stage_costs_2bp", "measure:stage_costs_standard",
         "measure:plan_4gpu", "measure:split_seq32_bf16-pure", "measure:split_seq32_bf16")
RUNS = ("1f1b_2bp", "1f1b_standard", "zb-v_2bp", "zb-v_standard", "1f1b_2bp_stream", "1f1b_2bp_bf16")
PART2 = ("measure:nccl4_size_m4_seq16",) + tuple("measure:nccl4_" + r for r in RUNS) + (
    "measure:nccl4_compare", "measure:nccl4_receive_waits")
TARGETS = ("synced_i_plus_w_over_b", "device_timed_i_plus_w_over_b", "mixed_w_over_pure_w")


def probe_without_options(sc, runner, util, real_help):
    """The probe and the split pieces through the runner on a fake twobp_bench whose help offers neither bf16,
    bf16-pure nor fast: the probe fails, every split piece is skipped for it, and the run is not ok. Returns the
    problems."""
    import re
    import shutil
    import tempfile
    help_text = re.sub(r"(?m)^  --dtype .*\n(\s{20,}.*\n)*", "  --dtype TEXT:fp32    Precision (default fp32)\n",
                       real_help)
    help_text = re.sub(r"(?m)^  --paths .*\n(\s{20,}.*\n)*", "  --paths TEXT=all     all, or general\n", help_text)
    work = tempfile.mkdtemp(prefix="check_gpu_check_perf.")
    bad = []
    try:
        fake = os.path.join(work, "twobp_bench")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\ncat <<'EOF'\n%sEOF\n" % help_text)
        os.chmod(fake, 0o755)

        class Build:
            prebuilt = None
            bench_binary = staticmethod(lambda: fake)
            missing = staticmethod(lambda exe, target: None)
            needs = staticmethod(lambda target: ())

        class Env:
            peak = None

        run = runner.Runner(True, os.path.join(work, "out"), util.now(), 60)
        try:
            costs = sc.SplitCosts(run, Env(), Build())
            costs.probe_piece()
            costs.pieces(16)
            summary = run.summary()
        finally:
            run.check_log.close()
            shutil.rmtree(run.tmp, ignore_errors=True)
        by_name = {p["name"]: p for p in summary["pieces"]}
        probe = by_name.get("probe:split_options", {})
        if probe.get("status") != "fail" or "bf16-pure" not in probe.get("detail", ""):
            bad.append("probe without bf16/bf16-pure/fast: %s (expected a failure naming them)" % probe)
        for key in ("seq16_bf16-pure", "seq16_bf16"):
            piece = by_name.get("measure:split_" + key, {})
            if piece.get("status") != "skipped" or "needs probe:split_options (fail)" not in piece.get("detail", ""):
                bad.append("measure:split_%s after a failed probe: %s" % (key, piece))
        if summary.get("ok") is not False or "probe:split_options" not in (summary.get("not_ok") or []):
            bad.append("a run whose probe found no bf16/bf16-pure/fast was ok %r (not_ok %r)" % (
                summary.get("ok"), summary.get("not_ok")))
        if (summary.get("split") or {}).get("missing_options") != ["--dtype bf16-pure", "--dtype bf16",
                                                                   "--paths fast"]:
            bad.append("summary's split.missing_options %r" % (summary.get("split") or {}).get("missing_options"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ["unit: " + b for b in bad]


def unit_problems(script, cpu_build):
    """The perf profile's pure functions against known answers; the probe on the real help and on a fake one."""
    import subprocess
    sys.path.insert(0, os.path.dirname(script))
    from gpucheck import environment, gate, measure, nccl4, partition, runner, sizing, split_costs as sc, util
    bad = []

    def expect(what, got, want):
        if got != want:
            bad.append("unit: %s gave %r, expected %r" % (what, got, want))

    for name, want in (("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
                       ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("Tesla T4", None)):
        expect("peak_bf16_tflops(%s)" % name, environment.peak_bf16_tflops(name)[0], want)
    # The probe on the REAL help of the CPU build's twobp_bench (the binary of this commit).
    bench = os.path.join(cpu_build, "benchmarks", "twobp_bench")
    try:
        real_help = subprocess.run([bench, "split", "--help"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return ["unit: cannot run %s split --help: %s" % (bench, e)]
    opts = sc.help_options(real_help)
    for want in ("bf16", "bf16-pure"):
        expect("%s in the real --dtype help" % want, want in opts["dtypes"], True)
    expect("fast in the real --paths help", "fast" in opts["paths"], True)
    expect("the real help's --json and --check", {"--json", "--check"} <= set(opts["options"]), True)
    expect("probe verdict on the real help", sc.probe_verdict(real_help, "pass", "")[0], "pass")
    expect("help_options finds bf16 apart from bf16-pure",
           sc.help_options("  --dtype TEXT:fp32 or bf16-pure\n")["dtypes"], ["fp32", "bf16-pure"])
    expect("probe verdict without bf16", sc.probe_verdict("  --dtype TEXT:fp32 or bf16-pure\n  --paths TEXT=fast\n",
                                                          "pass", "")[0], "fail")
    bad += probe_without_options(sc, runner, util, real_help)
    cases = {"passed": ["A.b"], "failed": [], "skipped": [], "skip_reason": ""}
    expect("gate test: passed on the GPU", gate.test_verdict(cases, "pass", "", False)[0], "pass")
    skipped = dict(cases, passed=[], skipped=["A.b"], skip_reason="no CUDA device")
    expect("gate test: skipped in the dry run", gate.test_verdict(skipped, "pass", "", True)[0], "skipped")
    expect("gate test: skipped on the GPU", gate.test_verdict(skipped, "pass", "", False)[0], "fail")
    expect("gate test: a failure", gate.test_verdict(dict(cases, failed=["A.c"]), "pass", "", False)[0], "fail")
    expect("gate test: nothing ran", gate.test_verdict(dict(cases, passed=[]), "pass", "", False)[0], "fail")
    expect("gtest_cases", gate.gtest_cases("[       OK ] A.b (1 ms)\n[  SKIPPED ] C.d (0 ms)\n"
                                           "[  FAILED  ] E.f (2 ms)\n[  FAILED  ] 1 test, listed below:\n"),
           {"passed": ["A.b"], "failed": ["E.f"], "skipped": ["C.d"], "skip_reason": ""})
    agree = {"ok": True, "accumulating_w_compared": 20, "compared": 42, "max_relative_difference": 1e-3}
    expect("gate check: agree", gate.check_verdict({"fast_vs_general": agree}, "pass", "")[0], "pass")
    expect("gate check: differ", gate.check_verdict({"fast_vs_general": dict(agree, ok=False)}, "pass", "")[0],
           "fail")
    expect("gate check: no accumulating W", gate.check_verdict(
        {"fast_vs_general": dict(agree, accumulating_w_compared=0)}, "pass", "")[0], "fail")
    expect("gate check: one path only", gate.check_verdict({"fast": {}}, "pass", "")[0], "fail")
    # The default profile's simulation: a B measured below max(I, W) (noise) is priced at max(I, W) and said so.
    ok = {"forward_ms": 0.4, "stage1_ms": 0.5, "stage2_ms": 0.14, "fused_ms": 0.6}
    expect("simulator_costs as measured", measure.simulator_costs(ok), (0.4, 0.5, 0.14, 0.6, ""))
    low = measure.simulator_costs(dict(ok, fused_ms=0.3))
    expect("simulator_costs: a B below I", (low[3], "below max(I, W)" in low[4]), (0.5, True))
    j = {"fast": {"stage1_ms": 12.36, "stage2_ms": 6.16, "fused_ms": 16.27, "forward_ms": 9.13,
                  "device_timed": {"stage1_ms": 10.0, "stage2_ms": 6.2, "fused_ms": 16.0}, "host_ms": {"I": 3.0}}}
    h = sc.headline(j, 989)
    expect("headline (I + W)/B", h["i_plus_w_over_b"], round((12.36 + 6.16) / 16.27, 4))
    expect("headline device-timed", (h["device_timed"] or {}).get("i_plus_w_over_b"), round(16.2 / 16.0, 4))
    expect("headline new columns", sorted(h["new_columns"]), ["device_timed", "host_ms"])
    mixed = {"W_ms": 8.0, "i_plus_w_over_b": 1.0}
    t = sc.targets({(1024, "bf16-pure"): h, (1024, "bf16"): mixed}, 1024)
    expect("targets synced (1.14)", t["synced_i_plus_w_over_b"]["met"], False)
    expect("targets device-timed (1.0125)", t["device_timed_i_plus_w_over_b"]["met"], True)
    expect("targets mixed W (8 / 6.16)", t["mixed_w_over_pure_w"]["met"], False)
    expect("targets without runs", sc.targets({}, 1024)["synced_i_plus_w_over_b"]["met"], None)
    expect("sizing: 64.7 GiB on an H100", sizing.verdict(64.7, sizing.H100_GIB, False)[0], True)
    expect("sizing: 75.3 GiB on an H100", sizing.verdict(75.3, sizing.H100_GIB, False)[0], False)
    expect("sizing: unknown card, not last", sizing.verdict(1.0, None, False)[0], False)
    expect("sizing: unknown card, last", sizing.verdict(1.0, None, True)[0], True)
    expect("need_gib", sizing.need_gib([2**30, 2**30], 2), 2 + 2 * sizing.PROCESS_OVERHEAD_GIB)
    steps = [{"peak_memory_bytes": 100.0}, {"peak_memory_bytes": 105.0}]
    expect("memory_check within", nccl4.memory_check(steps, [90.0, 100.0])["ok"], True)
    expect("memory_check over", nccl4.memory_check(steps, [90.0, 90.0])["ok"], False)
    per_rank = [{"peak_memory_bytes_per_rank": [100.0, 50.0]}]
    expect("memory_check per rank", nccl4.memory_check(per_rank, [100.0, 100.0])["ok"], False)
    expect("losses identical", nccl4.first_losses_agree({"a": 5.0, "b": 5.0}, "fp32"), (True, 0.0, True))
    expect("losses apart", nccl4.first_losses_agree({"a": 5.0, "b": 5.01}, "bf16-pure")[0], False)
    expect("grad norms close", nccl4.first_grad_norms_agree({"a": 2.0, "b": 2.0 * (1 + 1e-6)}, "fp32")[0], True)
    expect("grad norms apart", nccl4.first_grad_norms_agree({"a": 2.0, "b": 2.1}, "bf16-pure")[0], False)
    expect("grad norms missing", nccl4.first_grad_norms_agree({"a": 2.0, "b": None}, "fp32")[0], False)
    expect("stream waits faster", nccl4.receive_waits_verdict(100.0, 103.0, False)["default"], "stream")
    expect("stream waits within the noise", nccl4.receive_waits_verdict(100.0, 101.0, False)["default"], "host")
    expect("stream waits in a dry run", nccl4.receive_waits_verdict(100.0, 200.0, True)["default"], "undecided")
    expect("link for 0.1 ms at seq 1024", round(partition.link_gbps(1024, 4096, 2)), 706)
    plan = {"candidates": [{"schedule": "1f1b", "mode": "standard", "v": 1, "sim_step_ms": 100.0},
                           {"schedule": "1f1b", "mode": "2bp", "v": 1, "sim_step_ms": 95.0},
                           {"schedule": "zb-v", "mode": "2bp", "v": 2, "sim_step_ms": 80.0},
                           {"schedule": "zb-v", "mode": "2bp", "v": 2, "sim_step_ms": 90.0}]}
    pred = partition.predictions(plan)
    expect("predictions 1f1b 2bp/standard", pred["1f1b"].get("2bp_speedup_over_standard"), round(100 / 95, 4))
    expect("predictions zb-v over 1f1b standard", pred["zb-v"]["2bp"]["speedup_over_1f1b_standard"], 1.25)
    return bad


def validate(mode, s, files, rc, wall):
    bad = []

    def need(cond, msg):
        if not cond:
            bad.append(msg)
        return cond

    by_name = common.check_common(s, files, wall, DEADLINE[mode], need)
    if by_name is None:
        return bad
    part = {"perf-part1": "1", "perf-part2": "2", "perf-injected": "1+2"}[mode]
    need(s.get("profile") == "perf" and s.get("part") == part, "profile %r part %r" % (s.get("profile"),
                                                                                      s.get("part")))
    status = lambda n: by_name.get(n, {}).get("status")  # noqa: E731
    for name in SKIPPED_SETUP + ((GATE_BUILD,) if "1" in part else ()):
        need(status(name) == "skipped" and "perf dry run" in by_name[name].get("detail", ""),
             "piece %s: %s" % (name, by_name.get(name)))
    need(not any(n.startswith(("test:", "list:")) for n in by_name), "the perf profile ran gpu tests")
    mine, other = {"1": (PART1, PART2), "2": (PART2, PART1), "1+2": (PART1 + PART2, ())}[part]
    need(all(n in by_name for n in mine), "pieces missing: %s" % [n for n in mine if n not in by_name])
    need(not any(n in by_name for n in other + ((GATE_BUILD,) if part == "2" else ())),
         "pieces of the other part ran")
    for name in ("env:torch", "third_party", "summary"):
        need(status(name) == "pass", "piece %s: %s" % (name, by_name.get(name)))
    if mode == "perf-injected":
        need(rc == 1, "exit code %r, expected 1" % rc)
        need(s.get("ok") is False and s.get("inject") == INJECT, "ok %r, inject %r" % (s.get("ok"), s.get("inject")))
        fail, hang = by_name.get("measure:split_seq16_bf16-pure", {}), by_name.get("measure:stage_costs_2bp", {})
        need(fail.get("status") == "fail" and fail.get("injected") == "fail", "the injected failure: %s" % fail)
        need(hang.get("status") == "timeout" and hang.get("group_cleaned") is True and "SIGKILL" in
             hang.get("detail", ""), "the injected hang: %s" % hang)
        plan = by_name.get("measure:plan_4gpu", {})
        need(plan.get("status") == "skipped" and "measure:stage_costs_2bp" in plan.get("detail", ""),
             "measure:plan_4gpu: %s" % plan)
        need(sorted(s.get("not_ok") or []) == ["measure:split_seq16_bf16-pure", "measure:stage_costs_2bp"],
             "not_ok %r" % s.get("not_ok"))
        seq16 = ((s.get("split") or {}).get("targets") or {}).get("seq16") or {}
        need((seq16.get("synced_i_plus_w_over_b") or {}).get("met", 0) is None,
             "seq16's synced target judged without its run: %r" % seq16)
        for name in PART2[1:]:
            need(status(name) == "skipped" and "not selected" in by_name.get(name, {}).get("detail", ""),
                 "piece %s ran though --only left it out: %s" % (name, by_name.get(name)))
        need(status("measure:nccl4_size_m4_seq16") == "pass", "measure:nccl4_size_m4_seq16 did not pass")
        need(status("measure:green_contexts") == "skipped", "measure:green_contexts was not skipped")
        need(set(files) == {"summary.json", "check.log", "split.json", "costs_standard.json"},
             "files %s" % sorted(files))
        for p in s["pieces"]:
            if p["name"] not in s.get("not_ok", []):
                need(p["status"] in ("pass", "skipped"), "piece %s: %s" % (p["name"], p["status"]))
        return bad
    need(rc == 0, "exit code %r, expected 0" % rc)
    need(s.get("ok") is True and not s.get("not_ok"), "ok %r, not_ok %r" % (s.get("ok"), s.get("not_ok")))
    need(set(files) == FILES[int(part)], "files %s, expected %s" % (sorted(files), sorted(FILES[int(part)])))
    for name in mine:
        if name != GATE_TEST:
            need(status(name) == "pass", "piece %s: %s" % (name, by_name.get(name)))
    if part == "1":
        test = by_name.get(GATE_TEST, {})
        need(test.get("status") == "skipped" and test.get("exit_code") == 0 and "dry run: all" in
             test.get("detail", "") and "no CUDA device" in test.get("detail", ""),
             "%s: %s (expected: ran, every case skipped for want of a GPU)" % (GATE_TEST, test))
        need([n for n in by_name if n.startswith(("gate:", "probe:", "measure:"))][:4] == list(PART1[:4]),
             "part 1 does not start with the numerics gate: %s" % list(by_name)[:12])
        numerics = s.get("numerics_gate") or {}
        need(numerics.get("ok") is True, "numerics_gate ok %r" % numerics.get("ok"))
        for dtype in ("bf16-pure", "bf16"):
            check = (numerics.get("split_check") or {}).get(dtype) or {}
            agree = check.get("fast_vs_general") or {}
            need(agree.get("ok") is True and (agree.get("accumulating_w_compared") or 0) > 0 and
                 "--check" in check.get("command", []) and ["--dtype", dtype] == check["command"][
                     check["command"].index("--dtype"):check["command"].index("--dtype") + 2],
                 "numerics gate %s: %r" % (dtype, check))
        split = s.get("split") or {}
        options = split.get("options") or {}
        need({"bf16", "bf16-pure"} <= set(options.get("dtypes") or []) and "fast" in (options.get("paths") or [])
             and split.get("missing_options") == [], "the probe of the real help found %r (missing %r)" % (
                 options, split.get("missing_options")))
        for key in SPLIT_KEYS:
            run = (split.get("runs") or {}).get(key) or {}
            need(isinstance(run.get("i_plus_w_over_b"), float) and run["i_plus_w_over_b"] > 0,
                 "split run %s: %r" % (key, run))
            dtype = key.split("_", 1)[1]
            args = (split.get("commands") or {}).get(key) or []
            need(" ".join(args).startswith("--device cpu --dtype %s --paths fast " % dtype),
                 "split %s passed %r, not --dtype %s --paths fast" % (key, args, dtype))
            need(run.get("precision_run") == dtype and run.get("paths_run") == ["fast"],
                 "split %s ran precision %r, paths %r (asked: %s, fast)" % (key, run.get("precision_run"),
                                                                          run.get("paths_run"), dtype))
        targets = split.get("targets") or {}
        need(targets.get("judged") is False and targets.get("judged_at") == "seq16", "targets: %r" % targets)
        for seq in ("seq16", "seq32"):
            for t in TARGETS:
                entry = (targets.get(seq) or {}).get(t) or {}
                need({"value", "target", "met"} <= set(entry), "target %s %s: %r" % (seq, t, entry))
        need(isinstance(((targets.get("seq16") or {}).get("mixed_w_over_pure_w") or {}).get("value"), float),
             "no mixed/pure W ratio at seq16")
        part1 = s.get("stage_costs_real_partition") or {}
        chosen = (part1.get("sizing") or {}).get("chosen") or {}
        need(chosen.get("m") == 2 and chosen.get("seq") == 16 and "fits_h100_80gb" in chosen, "sizing %r" % chosen)
        for mode_ in ("2bp", "standard"):
            costs = (((part1.get("runs") or {}).get(mode_) or {}).get("costs") or {}).get("results") or [{}]
            per = costs[0].get("costs_ms") or {}
            need(len(per.get("F") or []) == 4 and all(x > 0 for x in per["F"]), "%s per-stage F: %r" % (mode_, per))
        plan = part1.get("plan_4gpu") or {}
        need((plan.get("link") or {}).get("message_ms_assumed") == 0.1, "plan link: %r" % plan.get("link"))
        need(plan.get("cost_model_kind") == "fitted", "plan: per-chunk costs not fitted (unequal partition): %r"
             % plan.get("cost_model_kind"))
        pred = plan.get("predictions") or {}
        for schedule in ("1f1b", "zb-v", "interleaved-1f1b"):
            need(isinstance((pred.get(schedule) or {}).get("2bp_speedup_over_standard"), float),
                 "plan: no 2BP/standard for %s: %r" % (schedule, pred.get(schedule)))
    else:
        n4 = s.get("nccl_4_processes") or {}
        runs = n4.get("runs") or {}
        for key in RUNS:
            r = runs.get(key) or {}
            need(r.get("world_size") == 4 and len(r.get("losses") or []) == 2, "run %s: %r" % (key, r))
            need((r.get("memory") or {}).get("ok") is True, "run %s memory: %r" % (key, r.get("memory")))
        first = n4.get("first_step") or {}
        need(first.get("ok") is True and first.get("identical") is True, "first-step losses: %r" % first)
        norms = first.get("grad_norms") or {}
        need(norms.get("ok") is True and len(norms.get("first_step") or {}) == 4 and
             all(isinstance(v, float) and v > 0 for v in (norms.get("first_step") or {}).values()),
             "first-step gradient norms: %r" % norms)
        waits = n4.get("receive_waits") or {}
        need(waits.get("ok") is True and waits.get("flag_recorded") is True and waits.get("default") == "undecided"
             and isinstance(waits.get("stream_over_host"), float) and waits["stream_over_host"] > 0,
             "the receive-wait A/B (host vs stream waits): %r" % waits)
        need((runs.get("1f1b_2bp_stream") or {}).get("nccl_stream_waits") is True and
             (runs.get("1f1b_2bp") or {}).get("nccl_stream_waits") is False,
             "--nccl-stream-waits not passed to the stream run alone")
        green = by_name.get("measure:green_contexts", {})
        need(green.get("status") == "skipped" and "not implemented" in green.get("detail", ""),
             "measure:green_contexts: %s" % green)
    return bad


def self_test(mode, s, files, rc, wall):
    """The checker must be able to fail: each broken copy of a good summary is rejected."""
    def broken(fn):
        c = copy.deepcopy(s)
        fn(c)
        return c

    def piece(c, name, **kv):
        for p in c["pieces"]:
            if p["name"] == name:
                p.update(kv)

    cases = {"no pieces": broken(lambda c: c.pop("pieces")),
             "gpu true": broken(lambda c: c.update(gpu=True)),
             "another part": broken(lambda c: c.update(part="3")),
             "after the deadline": broken(lambda c: c.update(total_s=c["deadline_s"] + 1)),
             "configure ran": broken(lambda c: piece(c, "configure", status="pass", detail="configured"))}
    if mode == "perf-part1":
        cases["plan failed"] = broken(lambda c: piece(c, "measure:plan_4gpu", status="fail"))
        cases["no predictions"] = broken(lambda c: c["stage_costs_real_partition"]["plan_4gpu"].update(
            predictions={}))
        cases["targets judged"] = broken(lambda c: c["split"]["targets"].update(judged=True))
        cases["no split runs"] = broken(lambda c: c["split"].update(runs={}))
        cases["a split run in fp32"] = broken(lambda c: c["split"]["runs"]["seq32_bf16"].update(precision_run="fp32"))
        cases["a split piece without --paths fast"] = broken(lambda c: c["split"]["commands"].update(
            seq16_bf16=["--device", "cpu", "--dtype", "bf16", "--dim", "64"]))
        cases["the probe found no bf16"] = broken(lambda c: c["split"].update(missing_options=["--dtype bf16"]))
        cases["split pieces skipped"] = broken(lambda c: piece(c, "measure:split_seq16_bf16", status="skipped",
                                                               detail="needs probe:split_options (fail)"))
        cases["gate: fast and general differ"] = broken(
            lambda c: c["numerics_gate"]["split_check"]["bf16"]["fast_vs_general"].update(ok=False))
        cases["gate: no accumulating W"] = broken(
            lambda c: c["numerics_gate"]["split_check"]["bf16-pure"]["fast_vs_general"].update(
                accumulating_w_compared=0))
        cases["gate: the test did not run"] = broken(lambda c: piece(c, GATE_TEST, exit_code=None))
    elif mode == "perf-part2":
        cases["memory off"] = broken(lambda c: c["nccl_4_processes"]["runs"]["zb-v_2bp"]["memory"].update(ok=False))
        cases["losses differ"] = broken(lambda c: c["nccl_4_processes"]["first_step"].update(identical=False))
        cases["grad norms differ"] = broken(lambda c: c["nccl_4_processes"]["first_step"]["grad_norms"].update(
            ok=False))
        cases["green ran"] = broken(lambda c: piece(c, "measure:green_contexts", status="pass"))
        cases["receive waits differ"] = broken(lambda c: c["nccl_4_processes"]["receive_waits"].update(ok=False))
        cases["no stream run"] = broken(lambda c: c["nccl_4_processes"]["runs"].pop("1f1b_2bp_stream"))
    else:
        cases["hang not killed"] = broken(lambda c: piece(c, "measure:stage_costs_2bp", group_cleaned=False))
        cases["plan ran"] = broken(lambda c: piece(c, "measure:plan_4gpu", status="pass", detail="planned"))
        cases["part 2 ran"] = broken(lambda c: piece(c, "measure:nccl4_zb-v_2bp", status="pass", detail="ran"))
    problems = ["self-test: a summary with '%s' was accepted" % what for what, c in cases.items()
                if not validate(mode, c, files, rc, wall)]
    if not validate(mode, s, dict(files, **{"extra%d.log" % i: 1 for i in range(8)}), rc, wall):
        problems.append("self-test: 14 files were accepted")
    if not validate(mode, s, files, 0 if rc else 1, wall):
        problems.append("self-test: the wrong exit code was accepted")
    return problems


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in DEADLINE:
        sys.exit(__doc__)
    mode, script, cpu_build, work = sys.argv[1:]
    problems = unit_problems(script, cpu_build)
    if problems:
        print("check_gpu_check_perf: FAILED:\n  " + "\n  ".join(problems))
        return 1
    env = common.check_environment(cpu_build, work)
    if mode == "perf-injected":
        env.update(GPU_CHECK_INJECT=INJECT)
    rc, wall, files, summary = common.dry_run(script, OPTIONS[mode], env, DEADLINE[mode], work)
    if summary is None:
        return common.report(mode, summary, files, ["no readable summary.json"], work)
    problems = validate(mode, summary, files, rc, wall)
    if not problems:
        problems = self_test(mode, summary, files, rc, wall)
    return common.report(mode, summary, files, problems, work)


if __name__ == "__main__":
    sys.exit(main())
