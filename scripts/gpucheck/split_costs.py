"""The perf profile's split costs: one 7B stage (twobp_bench split: 8 LLaMa-7B blocks, batch 1) at two sequence
lengths, all-bfloat16 and mixed precision, with whatever columns this twobp_bench writes (issue 57 adds host time,
a device-timed back-to-back variant, ATen ops per block, host overhead, accumulation); judged against issue 57's
GPU targets. The raw outputs go to split.json, the headline numbers and the verdict to summary.json's "split"."""

import json
import os
import re

from .util import write_json

SPLIT_GPU = dict(device="cuda", dim=4096, ffn=11008, heads=32, kv_heads=32, layers=8, batch=1, seqs=(1024, 4096),
                 repeats=10, warmup=2, micro_batches=4, threads=2)
# The dry run: a tiny stage on the CPU, fp32 standing for both bfloat16 forms (bfloat16 on this CPU is slow and says
# nothing about a GPU), one thread (measure.py says why); the options are still read from the binary and recorded.
SPLIT_DRY = dict(device="cpu", dim=64, ffn=176, heads=4, kv_heads=4, layers=1, batch=1, seqs=(16, 32), repeats=1,
                 warmup=0, micro_batches=2, threads=1, stand_in_dtype="fp32")
# The precisions measured, as the example spells them: bf16-pure = all bfloat16, bf16 = mixed (bfloat16 compute,
# float32 master weights and gradients).
DTYPES = ("bf16-pure", "bf16")

# Issue 57's GPU targets, judged at the first (shorter) sequence length: synced (I + W) / B, device-timed (I + W) / B,
# and mixed-precision W over all-bfloat16 W.
TARGET_SYNCED = 1.03
TARGET_DEVICE_TIMED = 0.02     # |ratio - 1| at most this
TARGET_MIXED_W = 1.25

# The fast path's columns of the H200 run of 2026-12-04 (docs/GPU.md): every other column (issue 57's host time,
# ops per block, host overhead, accumulation, ... under whatever names they land) is copied into the summary as the
# JSON has it.
KNOWN_COLUMNS = {"stage1_ratio", "split_ratio", "forward_ms", "stage1_ms", "stage2_ms", "fused_ms", "split_overhead_ms",
                 "batched_w_speedup", "batched_w_ms", "separate_w_ms", "parameters", "forward_tflops", "stage1_tflops",
                 "stage2_tflops", "fused_tflops", "spread"}
PHASE_KEYS = {"F": ("forward_ms", "F_ms", "F"), "I": ("stage1_ms", "I_ms", "I", "input_ms"),
              "W": ("stage2_ms", "W_ms", "W", "weight_ms"), "B": ("fused_ms", "B_ms", "B", "backward_ms")}


def help_options(text):
    """What `twobp_bench split --help` offers: {"options": [names], "dtypes": [choices], "paths": [choices]}."""
    options = sorted(set(re.findall(r"(?m)^\s+(--[\w-]+)", text)))
    dtypes = re.search(r"--dtype\s+TEXT:\{([^}]*)\}", text)
    paths = re.search(r"--paths\s+TEXT:\{([^}]*)\}", text)
    return {"options": options, "dtypes": dtypes.group(1).split(",") if dtypes else [],
            "paths": paths.group(1).split(",") if paths else (["?"] if "--paths" in options else [])}


def dtype_argument(wanted, dtypes):
    """The --dtype value that gives precision `wanted` (DTYPES' spelling) with a binary offering `dtypes`: (value,
    note), value None when this binary cannot. Before issue 57, split's bf16 meant all-bfloat16 and it had no
    mixed precision; with it, split spells them as the example does."""
    if "bf16-pure" in dtypes:
        return (wanted, "") if wanted in dtypes else (None, "--dtype %s not offered" % wanted)
    if wanted == "bf16-pure" and "bf16" in dtypes:
        return "bf16", "this twobp_bench's --dtype bf16 is all-bfloat16 (before issue 57)"
    if wanted == "bf16":
        return None, "this twobp_bench has no mixed precision (no bf16-pure among --dtype %s: before issue 57)" % (
            ",".join(dtypes) or "?")
    return None, "--dtype %s not offered (%s)" % (wanted, ",".join(dtypes) or "none listed")


def phase_ms(d, phase):
    for key in PHASE_KEYS[phase]:
        v = d.get(key) if isinstance(d, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def device_timed(j):
    """(I, W, B ms, where) of the device-timed back-to-back variant, looked for in the fast path's entries and the
    JSON's top level (a dict whose name says device or back-to-back and has I, W and B), or None."""
    fast = j.get("fast") or {}
    places = [("fast." + k, v) for k, v in fast.items()] + [(k, v) for k, v in j.items()
                                                             if k not in ("fast", "general", "config")]
    for where, v in places:
        if isinstance(v, dict) and re.search(r"device|back_to_back", where):
            for d, sub in [(v, where)] + [(v.get("fast"), where + ".fast")]:
                iwb = [phase_ms(d or {}, p) for p in "IWB"]
                if all(x is not None for x in iwb):
                    return iwb + [sub]
    return None


def headline(j, peak_tflops=None):
    """The numbers of one split run that the summary keeps: F, I, W, B synced, (I + W) / B, the device-timed ratio,
    TFLOP/s and utilisation, every new column as the JSON has it, and the fast path's key names."""
    fast = j.get("fast") or {}
    out = {p + "_ms": phase_ms(fast, p) for p in "FIWB"}
    i, w, b = out["I_ms"], out["W_ms"], out["B_ms"]
    out["i_plus_w_over_b"] = round((i + w) / b, 4) if None not in (i, w, b) and b > 0 else None
    dev = device_timed(j)
    out["device_timed"] = ({"I_ms": dev[0], "W_ms": dev[1], "B_ms": dev[2], "from": dev[3],
                            "i_plus_w_over_b": round((dev[0] + dev[1]) / dev[2], 4) if dev[2] > 0 else None}
                           if dev else None)
    out["batched_w_ms"] = fast.get("batched_w_ms")
    out["fused_tflops"] = fast.get("fused_tflops")
    if peak_tflops and isinstance(fast.get("fused_tflops"), (int, float)):
        out["fused_utilisation"] = round(fast["fused_tflops"] / peak_tflops, 4)
    out["new_columns"] = {k: v for k, v in fast.items() if k not in KNOWN_COLUMNS}
    out["new_sections"] = {k: v for k, v in j.items() if k not in ("fast", "general", "config", "fast_vs_general")}
    out["keys"] = sorted(fast)
    cfg = j.get("config") or {}
    out["dtype_run"] = cfg.get("dtype")
    out["peak_allocated_gib"] = (round(cfg["peak_allocated_bytes"] / 2**30, 2)
                                 if isinstance(cfg.get("peak_allocated_bytes"), (int, float)) else None)
    return out


def judge(value, ok, target, note=""):
    return {"value": value, "target": target, "met": None if value is None else bool(ok(value)),
            **({"note": note} if note else {})}


def targets(runs, seq):
    """Issue 57's targets at seq from runs {(seq, dtype): headline}: each {value, target, met (None: not
    measured), note}."""
    pure, mixed = runs.get((seq, "bf16-pure")) or {}, runs.get((seq, "bf16")) or {}
    dev = pure.get("device_timed") or {}
    wp, wm = pure.get("W_ms"), mixed.get("W_ms")
    return {
        "synced_i_plus_w_over_b": judge(pure.get("i_plus_w_over_b"), lambda v: v <= TARGET_SYNCED,
                                        "<= %.2f (bf16-pure)" % TARGET_SYNCED,
                                        "" if pure else "no bf16-pure run at this length"),
        "device_timed_i_plus_w_over_b": judge(dev.get("i_plus_w_over_b"),
                                              lambda v: abs(v - 1) <= TARGET_DEVICE_TIMED,
                                              "within %.0f %% of 1.00 (bf16-pure)" % (100 * TARGET_DEVICE_TIMED),
                                              "" if dev else "no device-timed columns in this twobp_bench's JSON"),
        "mixed_w_over_pure_w": judge(round(wm / wp, 4) if wm is not None and wp else None,
                                     lambda v: v <= TARGET_MIXED_W, "<= %.2f" % TARGET_MIXED_W,
                                     "" if wm is not None and wp else "needs both a bf16 and a bf16-pure run"),
    }


class SplitCosts:
    """probe:split_options, then measure:split_seq<N>_<dtype> per sequence length (pieces(seq)); the summary's
    "split" section judges them."""

    def __init__(self, run, env, build):
        self.run, self.env, self.build = run, env, build
        self.config = SPLIT_DRY if run.dry else SPLIT_GPU
        self.options = None       # help_options() of this twobp_bench, once probed
        self.raw = {}             # "seq<N>_<dtype>" -> the run's JSON (split.json)
        self.runs = {}            # (seq, dtype) -> headline()
        self.notes = {}           # "seq<N>_<dtype>" -> why the dtype was passed as it was, or skipped
        run.add_section("split", self.summary)

    def probe_piece(self):
        bench = self.build.bench_binary()

        def parse(text, rc, killed, status, detail):
            if status == "pass":
                self.options = help_options(text)
                detail = "--dtype {%s}, --paths %s, %d options" % (
                    ",".join(self.options["dtypes"]), ",".join(self.options["paths"]) or "absent",
                    len(self.options["options"]))
            return status, detail, None

        self.run.piece("probe:split_options", [bench, "split", "--help"], 30, min_s=3, analyze=parse,
                       skip_reason=self.build.missing(bench, "twobp_bench"), needs=self.build.needs("twobp_bench"))

    def pieces(self, seq):
        run, c = self.run, self.config
        bench = self.build.bench_binary()
        for dtype in DTYPES:
            key = "seq%d_%s" % (seq, dtype)
            name = "measure:split_" + key
            if self.options is None:
                run.piece(name, [], 30, needs=("probe:split_options",))
                continue
            value, note = dtype_argument(dtype, self.options["dtypes"])
            if run.dry:  # every piece runs, so that the dry run exercises what the GPU run would do with it
                value, note = c["stand_in_dtype"], "dry run: %s stands for %s (on the GPU: %s)" % (
                    c["stand_in_dtype"], dtype, "--dtype %s%s" % (value, "; " + note if note else "")
                    if value else "skipped: " + note)
            self.notes[key] = note
            if value is None:
                run.record(name, "skipped", 0, note)
                continue
            out_json = os.path.join(run.tmp, "split_%s.json" % key)
            cmd = [bench, "split", "--device", c["device"], "--dtype", value, "--dim", c["dim"], "--ffn", c["ffn"],
                   "--heads", c["heads"], "--kv-heads", c["kv_heads"], "--layers", c["layers"], "--seq", seq,
                   "--batch", c["batch"], "--repeats", c["repeats"], "--warmup", c["warmup"], "--no-conv",
                   "--batched-w", "--micro-batches", c["micro_batches"], "--threads", c["threads"], "--json", out_json]
            if "fast" in self.options["paths"]:
                cmd += ["--paths", "fast"]  # issue 57: skip building the general path's stack

            def ran(text, rc, killed, status, detail, key=key, seq=seq, dtype=dtype, out_json=out_json):
                if status != "pass":
                    return status, detail, None
                with open(out_json) as f:
                    j = json.load(f)
                self.raw[key] = j
                write_json(os.path.join(run.out, "split.json"), self.raw)
                h = headline(j, (self.env.peak or {}).get("tflops"))
                self.runs[(seq, dtype)] = h
                if None in (h["I_ms"], h["W_ms"], h["B_ms"]):
                    return "fail", "no F/I/W/B in the JSON: fast has %s" % ", ".join(h["keys"]), None
                dev = h["device_timed"]
                return "pass", "F %.3f I %.3f W %.3f B %.3f ms synced, (I + W)/B %.3f%s, fused %.3g TFLOP/s%s" % (
                    h["F_ms"] or 0, h["I_ms"], h["W_ms"], h["B_ms"], h["i_plus_w_over_b"],
                    ", device-timed %.3f" % dev["i_plus_w_over_b"] if dev and dev["i_plus_w_over_b"] else "",
                    h["fused_tflops"] or 0, ", %.0f %% of peak" % (100 * h["fused_utilisation"])
                    if h.get("fused_utilisation") else ""), None

            # Own timeouts: a few times what a 7B stage should take (model on the GPU, 10 repeats of each phase, the
            # general path too where --paths is missing); min_s: less left is not worth starting.
            timeout = 90 if seq == c["seqs"][0] else 120
            run.piece(name, cmd, timeout, min_s=20 if not run.dry else 3, analyze=ran,
                      needs=self.build.needs("twobp_bench"))

    def summary(self):
        first = self.config["seqs"][0]
        runs = {"seq%d_%s" % k: v for k, v in self.runs.items()}
        verdict = {"seq%d" % seq: targets(self.runs, seq) for seq in self.config["seqs"]}
        return {"split": {
            "config": {k: v for k, v in self.config.items()}, "options": self.options, "dtype_notes": self.notes,
            "runs": runs,
            "targets": dict(verdict, judged_at="seq%d" % first, source="issue 57 (GPU targets)",
                            judged=not self.run.dry and bool(runs),
                            note="dry run: CPU numbers of a tiny stage, not judged" if self.run.dry else ""),
        }}
