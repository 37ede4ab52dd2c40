"""The perf profile's numerics gate, first in part 1: the CUDA-only code paths that the measurements time compute
what they should, before anything is timed.

  gate:split_cuda_test        the gpu test binary of the split's CUDA-only paths (tests/autograd/split_cuda_test:
                              fused RMSNorm in every order of I and W, the rotary node, bfloat16 products into
                              float32 masters through mm.dtype and baddbmm.dtype_out); every case must pass: a case
                              skipped on the GPU machine fails the gate
  gate:split_check_<dtype>    `twobp_bench split --paths fast,general --check` in bf16-pure and bf16 (mixed): the
                              fast path against the general one (LibTorch autograd) on the same weights and data --
                              output, input gradient and every weight gradient, from no gradients and accumulating
                              (a second W into the .grad the first made) -- within the dtype's tolerance, and every
                              headline number present (split's --check exits non-zero otherwise)

A failed gate makes the run not ok; the measurements still run (their times stand, their numerics would not). The
gate pieces are not measure:/test: pieces, so --only never leaves them out. The dry run runs the CPU build's test
binary (its cases skip without a GPU: recorded as skipped) and the split check on a tiny stage on the CPU, in the
same precisions. Results: summary.json's "numerics_gate"."""

import os
import re

from .util import load_json

GATE_GPU = dict(device="cuda", dim=512, ffn=1376, heads=8, kv_heads=4, layers=2, seq=256, batch=2, repeats=2,
                warmup=1, threads=2)
GATE_DRY = dict(device="cpu", dim=64, ffn=176, heads=4, kv_heads=2, layers=2, seq=16, batch=1, repeats=1, warmup=0,
                threads=1)
DTYPES = ("bf16-pure", "bf16")
TEST = "split_cuda_test"
TEST_DIR = os.path.join("tests", "autograd")   # where the build puts it


def gtest_cases(text):
    """{"passed": [...], "failed": [...], "skipped": [...], "skip_reason": str} from a gtest binary's output."""
    out = {"passed": [], "failed": [], "skipped": []}
    for mark, kind in (("[       OK ] ", "passed"), ("[  FAILED  ] ", "failed"), ("[  SKIPPED ] ", "skipped")):
        for m in re.finditer(r"(?m)^%s([\w/]+\.[\w/]+)" % re.escape(mark), text):
            if m.group(1) not in out[kind]:
                out[kind].append(m.group(1))
    reasons = [l.strip() for l in text.splitlines() if "Skipped" not in l and re.search(r"no CUDA|skip", l, re.I)
               and not l.startswith("[")]
    out["skip_reason"] = reasons[0][:200] if reasons else ""
    return out


def test_verdict(cases, status, detail, dry):
    """gate:split_cuda_test's (status, detail): on the GPU every case passes; in the dry run every case skips (no
    GPU), which is recorded as skipped."""
    p, f, s = cases["passed"], cases["failed"], cases["skipped"]
    counts = "%d passed, %d failed, %d skipped" % (len(p), len(f), len(s))
    if status != "pass" or f:
        return ("fail" if status == "pass" else status), "%s; %s%s" % (
            counts, detail, "; failed: " + ", ".join(f[:5]) if f else "")
    if not (p or s):
        return "fail", "no case ran: %s" % detail
    if s and dry and not p:
        return "skipped", "dry run: all %d cases skipped (%s)" % (len(s), cases["skip_reason"] or "no reason given")
    if s:
        return "fail", "%s: a case skipped on the GPU machine checked nothing (%s): %s" % (
            counts, cases["skip_reason"] or "no reason given", ", ".join(s[:5]))
    return "pass", counts


def check_verdict(doc, status, detail):
    """gate:split_check_<dtype>'s (status, detail) from split's exit status and its JSON: fast vs general agree,
    the accumulating W branch among the values compared."""
    if status != "pass":
        return status, detail
    agree = (doc or {}).get("fast_vs_general")
    if not isinstance(agree, dict):
        return "fail", "no fast_vs_general in the JSON (were both paths run?)"
    if not agree.get("accumulating_w_compared"):
        return "fail", "fast_vs_general did not compare the accumulating W branch (no accumulating_w_compared)"
    line = "fast vs general: max relative difference %.3g (%s) over %s values (%s accumulating W), tolerance %g" % (
        agree.get("max_relative_difference", float("nan")), agree.get("worst"), agree.get("compared"),
        agree.get("accumulating_w_compared"), agree.get("tolerance", float("nan")))
    if not agree.get("ok"):
        return "fail", line + ": DIFFER"
    return "pass", line


class NumericsGate:
    """build:split_cuda_test, gate:split_cuda_test, gate:split_check_<dtype>; the summary's "numerics_gate"."""

    def __init__(self, run, build):
        self.run, self.build = run, build
        self.config = GATE_DRY if run.dry else GATE_GPU
        self.test = None       # gtest_cases() of split_cuda_test
        self.checks = {}       # dtype -> {command, fast_vs_general}
        run.add_section("numerics_gate", self.summary)

    def test_binary(self):
        b = self.build
        if b.prebuilt:
            names = [t["name"] for t in b.prebuilt.get("tests", [])]
            return os.path.join(b.prebuilt_dir, TEST) if TEST in names else None
        return os.path.join(self.run.cpu_build if self.run.dry else b.build_dir(), TEST_DIR, TEST)

    def pieces(self):
        run, build = self.run, self.build
        build.build_piece("build:" + TEST, [TEST], 240, needs=("build:library",))
        exe = self.test_binary()
        skip = None
        if exe is None:
            skip = "the carried binaries hold no %s (an older prebuild)" % TEST
        elif run.dry and not os.access(exe, os.X_OK):
            skip = "%s is missing: build %s in GPU_CHECK_CPU_BUILD first" % (exe, TEST)

        def tested(text, rc, killed, status, detail):
            self.test = gtest_cases(text)
            status, detail = test_verdict(self.test, status, detail, run.dry)
            return status, detail, None

        run.piece("gate:" + TEST, [exe or TEST], 90, min_s=5, analyze=tested, skip_reason=skip,
                  needs=build.needs(TEST))
        bench = build.bench_binary()
        c = self.config
        for dtype in DTYPES:
            out_json = os.path.join(run.tmp, "gate_%s.json" % dtype)
            args = ["--device", c["device"], "--dtype", dtype, "--paths", "fast,general", "--no-conv", "--dim",
                    c["dim"], "--ffn", c["ffn"], "--heads", c["heads"], "--kv-heads", c["kv_heads"], "--layers",
                    c["layers"], "--seq", c["seq"], "--batch", c["batch"], "--repeats", c["repeats"], "--warmup",
                    c["warmup"], "--threads", c["threads"]]
            entry = self.checks.setdefault(dtype, {"command": ["split"] + [str(a) for a in args] + ["--check"]})

            def checked(text, rc, killed, status, detail, out_json=out_json, entry=entry):
                doc = load_json(out_json) if os.path.isfile(out_json) else None
                entry["fast_vs_general"] = (doc or {}).get("fast_vs_general")
                if status != "pass":  # split's --check names what failed
                    problems = [l.strip() for l in text.splitlines() if l.startswith("check failed")]
                    return status, "; ".join(problems)[:400] or detail, None
                status, detail = check_verdict(doc, status, detail)
                return status, detail, None

            run.piece("gate:split_check_" + dtype, [bench, "split"] + args + ["--json", out_json, "--check"], 90,
                      min_s=10 if not run.dry else 3, analyze=checked,
                      skip_reason=build.missing(bench, "twobp_bench"), needs=build.needs("twobp_bench"))

    def summary(self):
        checks = {d: dict(e, status=self.run.by_name.get("gate:split_check_" + d, {}).get("status", "not run"))
                  for d, e in self.checks.items()}
        test = dict(self.test or {}, status=self.run.by_name.get("gate:" + TEST, {}).get("status", "not run"))
        status = lambda n: self.run.by_name.get(n, {}).get("status")  # noqa: E731
        # In the dry run the test's cases skip (no GPU); on the GPU every gate piece passes.
        test_ok = status("gate:" + TEST) == "pass" or (self.run.dry and status("gate:" + TEST) == "skipped")
        return {"numerics_gate": {
            "ok": test_ok and all(status("gate:split_check_" + d) == "pass" for d in DTYPES),
            "config": self.config, TEST: test, "split_check": checks,
            "note": "dry run: the test's cases skip without a GPU; the split check ran on the CPU" if self.run.dry
            else ""}}
