#!/usr/bin/env python3
"""Runs scripts/gpu_check.sh --profile perf --dry-run on this CPU machine and checks what it leaves (the perf
profile's sibling of check_gpu_check.py, whose common checks it shares).

usage: check_gpu_check_perf.py perf-part1|perf-part2|perf-injected SCRIPT CPU_BUILD WORK_DIR

  perf-part1     --part 1: exit 0; the split pieces of both precisions at both lengths (fp32 standing in), the
                 tiny model's size chosen by its --dry-run estimate, its per-stage costs with 2BP and standard as one
                 rank holding four chunks, the planner's prediction of every schedule x mode from them; configure and
                 the builds skipped with the perf dry run's reason; the summary's split runs, issue 57's targets (not
                 judged on a CPU), the costs, the plan with the message time assumed; exactly the part's 6 files
  perf-part2     --part 2: exit 0; 4 CPU processes (launch.py, TCPStore) run 1F1B and ZB-V with 2BP and standard and
                 mixed precision; each run's peak within 10 % of the estimate; the first-step losses identical; the
                 green-context emulation skipped as not implemented; exactly the part's 3 files
  perf-injected  both parts (no --part), --only naming part 1's measurements and part 2's sizing (its runs are left
                 out for time), GPU_CHECK_INJECT="measure:split_seq16_bf16-pure:fail,measure:stage_costs_2bp:hang":
                 exit 1; the failure and the hang (its group killed with SIGKILL) recorded, the plan skipped because
                 it needs the costs, the targets of seq16 unmeasured where they need the failed run, part 2's pieces
                 listed and skipped as not selected, every other piece passed or skipped, the summary written before
                 the deadline

Before running anything, the checker tests the profile's pure functions (the peak table, the split options read
from --help, issue 57's targets, the sizing rule, the memory and loss checks, the link that gives the assumed message
time, the plan's table). After checking a real summary it checks itself: broken copies must be rejected.
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
PART1 = ("probe:split_options", "measure:split_seq16_bf16-pure", "measure:split_seq16_bf16",
         "measure:stage_costs_size_m2_seq16", "measure:stage_costs_2bp", "measure:stage_costs_standard",
         "measure:plan_4gpu", "measure:split_seq32_bf16-pure", "measure:split_seq32_bf16")
RUNS = ("1f1b_2bp", "1f1b_standard", "zb-v_2bp", "zb-v_standard", "1f1b_2bp_bf16")
PART2 = ("measure:nccl4_size_m4_seq16",) + tuple("measure:nccl4_" + r for r in RUNS) + ("measure:nccl4_compare",)
TARGETS = ("synced_i_plus_w_over_b", "device_timed_i_plus_w_over_b", "mixed_w_over_pure_w")


def unit_problems(script):
    """The perf profile's pure functions against known answers."""
    sys.path.insert(0, os.path.dirname(script))
    from gpucheck import environment, nccl4, partition, sizing, split_costs as sc
    bad = []

    def expect(what, got, want):
        if got != want:
            bad.append("unit: %s gave %r, expected %r" % (what, got, want))

    for name, want in (("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
                       ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("Tesla T4", None)):
        expect("peak_bf16_tflops(%s)" % name, environment.peak_bf16_tflops(name)[0], want)
    old, new = ["fp32", "bf16"], ["fp32", "bf16", "bf16-pure"]
    expect("dtype_argument(bf16-pure, old)", sc.dtype_argument("bf16-pure", old)[0], "bf16")
    expect("dtype_argument(bf16, old)", sc.dtype_argument("bf16", old)[0], None)
    expect("dtype_argument(bf16-pure, new)", sc.dtype_argument("bf16-pure", new)[0], "bf16-pure")
    expect("dtype_argument(bf16, new)", sc.dtype_argument("bf16", new)[0], "bf16")
    helptext = ("Options:\n  --dtype TEXT:{fp32,bf16,bf16-pure}=fp32\n                              fp32 ...\n"
                "  --paths TEXT:{fast,general,both}=both\n  --json TEXT:writable file   Write\n")
    opts = sc.help_options(helptext)
    expect("help_options dtypes", opts["dtypes"], new)
    expect("help_options paths", opts["paths"], ["fast", "general", "both"])
    expect("help_options options", opts["options"], ["--dtype", "--json", "--paths"])
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
    for name in SKIPPED_SETUP:
        need(status(name) == "skipped" and "perf dry run" in by_name[name].get("detail", ""),
             "piece %s: %s" % (name, by_name.get(name)))
    need(not any(n.startswith(("test:", "list:")) for n in by_name), "the perf profile ran gpu tests")
    mine, other = {"1": (PART1, PART2), "2": (PART2, PART1), "1+2": (PART1 + PART2, ())}[part]
    need(all(n in by_name for n in mine), "pieces missing: %s" % [n for n in mine if n not in by_name])
    need(not any(n in by_name for n in other), "pieces of the other part ran")
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
        need(status(name) == "pass", "piece %s: %s" % (name, by_name.get(name)))
    if part == "1":
        split = s.get("split") or {}
        for key in ("seq16_bf16-pure", "seq16_bf16", "seq32_bf16-pure", "seq32_bf16"):
            run = (split.get("runs") or {}).get(key) or {}
            need(isinstance(run.get("i_plus_w_over_b"), float) and run["i_plus_w_over_b"] > 0,
                 "split run %s: %r" % (key, run))
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
    elif mode == "perf-part2":
        cases["memory off"] = broken(lambda c: c["nccl_4_processes"]["runs"]["zb-v_2bp"]["memory"].update(ok=False))
        cases["losses differ"] = broken(lambda c: c["nccl_4_processes"]["first_step"].update(identical=False))
        cases["green ran"] = broken(lambda c: piece(c, "measure:green_contexts", status="pass"))
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
    problems = unit_problems(script)
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
