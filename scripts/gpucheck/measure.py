"""The default profile's measurements: one 7B stage's F, I, W, B (twobp_bench split) and the simulated 4-GPU speedup
from them; llama_pipeline training on the GPU with 2BP and without; and (opt-in) the example's memory estimate
against the measured peak of whole 7B steps on one rank."""

import json
import os
import re

from .util import relative_difference

# One 7B stage (LLaMa-7B blocks), all bfloat16, batch 1; the dry run: a tiny fp32 model on the CPU.
# threads: twobp_bench split's intra-op threads. The dry run takes one: its two threads spin-waited against the other
# tests' processes under ctest -j2 (a forward of a few microseconds' work measured 231 ms, 2026-12-07).
MEASURE_GPU = dict(device="cuda", dtype="bf16-pure", dim=4096, ffn=11008, heads=32, layers=8, seqs=(1024, 4096),
                   repeats=10, threads=2)
MEASURE_DRY = dict(device="cpu", dtype="fp32", dim=64, ffn=176, heads=4, layers=2, seqs=(16, 32), repeats=2,
                   threads=1)
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
# Assumed time of one activation message in the simulated 4-GPU pipeline: one GPU cannot measure a link. NVLink
# moves the [1, seq, dim] bf16 activation (8-32 MiB) in ~0.03-0.1 ms.
COMMUNICATION_MS = 0.1
SIZE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def example_command(exe, e, mode):
    """llama_pipeline exe with configuration e (EXAMPLE_* above, or any dict of the same keys) in mode 2bp or
    standard."""
    cmd = [exe, "--device", e["device"], "--model", e["model"], "--dtype", e["dtype"], "--ranks", e["ranks"],
           "--schedule", e["schedule"], "--microbatches", e["microbatches"], "--seq-len", e["seq_len"],
           "--steps", e["steps"], "--2bp" if mode == "2bp" else "--no-2bp"]
    for key, option in (("micro_batch_size", "--micro-batch-size"), ("chunks_per_rank", "--chunks-per-rank"),
                        ("layers", "--layers"), ("partition", "--partition")):
        if key in e:
            cmd += [option, e[key]]
    return cmd


def simulator_costs(fast):
    """F, I, W, B in ms for `twobp_bench simulate` from split's "fast" record, and a note ("" when none). A fused
    backward costs at least max(I, W) (the simulator refuses a B below it: twobp's cost check); a B measured under
    that is noise -- small sizes, a loaded machine (seen in the CPU dry run under a second suite's load) -- and is
    priced at max(I, W), said in the note, rather than failing the simulation."""
    f, i, w, b = (float(fast[k]) for k in ("forward_ms", "stage1_ms", "stage2_ms", "fused_ms"))
    floor = max(i, w)
    if b >= floor:
        return f, i, w, b, ""
    return f, i, w, floor, "B measured %.4g ms, below max(I, W) = %.4g ms (noise): simulated with B = %.4g ms" % (
        b, floor, floor)


def median_tokens_per_s(steps):
    """The median tokens/s of the example's step records after the first (which warms up)."""
    rates = sorted(s["tokens_per_s"] for s in steps[1:] or steps)
    return rates[len(rates) // 2]


def peak_of(steps):
    """The largest peak_memory_bytes of the example's step records, or -1 where none was recorded."""
    return max((s.get("peak_memory_bytes") or -1) for s in steps)


class Measurements:
    """measure:split_seqN, measure:simulate_seqN, measure:example_*, measure:example_memory_*."""

    def __init__(self, run, build):
        self.run, self.build = run, build
        self.measure = MEASURE_DRY if run.dry else MEASURE_GPU
        self.example = EXAMPLE_DRY if run.dry else EXAMPLE_GPU
        self.example_memory = EXAMPLE_MEMORY_DRY if run.dry else EXAMPLE_MEMORY_GPU
        self.memory_checks = {}    # mode -> {estimate_bytes, measured_peak_bytes, ratio}
        self.example_runs = {}     # mode -> the example's per-step records (its --json "steps")
        run.add_section("measurements", self.summary)

    def split_pieces(self):
        run, m = self.run, self.measure
        bench = self.build.bench_binary()
        batched_mbs = 4  # the micro-batches of split's batched W, priced by the simulator below
        for seq in m["seqs"]:
            split_json = os.path.join(run.out, "split_seq%d.json" % seq)
            cmd = [bench, "split", "--device", m["device"], "--dtype", m["dtype"], "--dim", m["dim"], "--ffn", m["ffn"],
                   "--heads", m["heads"], "--kv-heads", m["heads"], "--layers", m["layers"], "--seq", seq, "--batch",
                   1, "--repeats", m["repeats"], "--warmup", 2, "--no-conv", "--batched-w", "--micro-batches",
                   batched_mbs, "--threads", m["threads"], "--json", split_json]

            def split_ok(text, rc, killed, status, detail, split_json=split_json):
                if status == "pass":
                    fast = json.load(open(split_json))["fast"]
                    detail = "F %.3f I %.3f W %.3f B %.3f ms, fused %.3g TFLOP/s" % (
                        fast["forward_ms"], fast["stage1_ms"], fast["stage2_ms"], fast["fused_ms"],
                        fast.get("fused_tflops") or 0)
                return status, detail, None

            run.piece("measure:split_seq%d" % seq, cmd, 150, min_s=15, analyze=split_ok,
                      skip_reason=self.build.missing(bench, "twobp_bench"), needs=self.build.needs("twobp_bench"))
            # Costs of the fast path (twobp::nn layers) feed the simulator: 4 GPUs, 8 micro-batches, one stage per GPU
            # (two half-size chunks for interleaved-1f1b and zb-v). Communication: COMMUNICATION_MS per message.
            name = "measure:simulate_seq%d" % seq
            if not run.passed("measure:split_seq%d" % seq):
                run.piece(name, [], 30, needs=("measure:split_seq%d" % seq,))
                continue
            try:
                fast = json.load(open(split_json))["fast"]
                f, i, w, b, b_note = simulator_costs(fast)
                # The W of batched_mbs micro-batches at once (--batched-w): the simulator then prices every W as a
                # fixed part + k x per micro-batch (twobp::fit_weight_cost), so batching W costs what it measured.
                batched = (["--w-batched", batched_mbs, fast["batched_w_ms"]]
                           if isinstance(fast.get("batched_w_ms"), (int, float)) and fast["batched_w_ms"] > 0 else [])
            except Exception as e:  # noqa: BLE001
                run.record(name, "fail", 0, "cannot read F, I, W, B from %s: %s" % (split_json, e))
                continue
            sim_json = os.path.join(run.out, "simulate_seq%d.json" % seq)

            def sim_ok(text, rc, killed, status, detail, sim_json=sim_json, b_note=b_note):
                if status == "pass":
                    sim = json.load(open(sim_json))
                    sp = {r["schedule"]: r.get("speedup_vs_standard") for r in sim.get("results", [])
                          if r.get("mode") == "2bp"}
                    detail = "2BP speedup: " + ", ".join("%s %.3f" % (k, v) for k, v in sp.items() if v is not None)
                    detail += ("; " + b_note) if b_note else ""
                return status, detail, None

            run.piece(name, [bench, "simulate", "--ranks", 4, "--microbatches", 8, "--f", f, "--i", i, "--w", w,
                             *batched, "--b", b, "--comm", COMMUNICATION_MS, "--json", sim_json], 30, min_s=3,
                      analyze=sim_ok)

    def example_pieces(self):
        """measure:example_2bp, measure:example_standard: llama_pipeline trains on the device (threads as ranks),
        then measure:example_compare puts the two runs side by side (losses agree; tokens/s of each)."""
        run, exe = self.run, self.build.example_binary()
        skip = self.build.missing(exe, "llama_pipeline")
        for mode in ("2bp", "standard"):
            out_json = os.path.join(run.tmp, "example_%s.json" % mode)  # not returned (8 files): summarized
            cmd = example_command(exe, self.example, mode) + ["--timeout", 60, "--json", out_json]

            def ran(text, rc, killed, status, detail, mode=mode, out_json=out_json):
                if status == "pass":
                    steps = json.load(open(out_json))["steps"]
                    self.example_runs[mode] = steps
                    peak = peak_of(steps)
                    detail = "loss %.4f -> %.4f in %d steps, median %.0f tokens/s after the first%s" % (
                        steps[0]["loss"], steps[-1]["loss"], len(steps), median_tokens_per_s(steps),
                        ", peak %.2f GiB per rank" % (peak / 2**30) if peak >= 0 else "")
                return status, detail, None

            run.piece("measure:example_" + mode, cmd, 150, min_s=20, analyze=ran, skip_reason=skip,
                      needs=self.build.needs("llama_pipeline"))

        def compare():
            a, b = self.example_runs.get("2bp"), self.example_runs.get("standard")
            if not a or not b:
                raise RuntimeError("needs measure:example_2bp and measure:example_standard to pass")
            # Same weights, data and seed: the first step's forward is the same computation (its loss agrees to
            # rounding) and 2BP changes only the order of the weight-gradient sums, so the first step's gradient norm
            # agrees to the precision's rounding; a lost or doubled gradient would be off by far more. Later losses
            # are reported only: a trajectory amplifies rounding differences (several % after a few steps in bf16).
            rel = relative_difference
            tol = 1e-4 if self.example["dtype"] == "fp32" else 1e-2
            loss0, norm0 = rel(a[0]["loss"], b[0]["loss"]), rel(a[0]["grad_norm"], b[0]["grad_norm"])
            later = max(rel(x["loss"], y["loss"]) for x, y in zip(a, b))
            detail = ("2BP vs standard, first step: loss %.2g, gradient norm %.2g relative difference (tolerance %g); "
                      "later losses up to %.2g apart; tokens/s 2BP/standard %.3f (threads sharing one device: not a "
                      "pipeline speedup)" % (loss0, norm0, tol, later, median_tokens_per_s(a) / median_tokens_per_s(b)))
            if not (loss0 <= tol and norm0 <= tol):
                raise RuntimeError(detail)
            return detail

        run.func_piece("measure:example_compare", compare)

    def example_memory_pieces(self):
        """measure:example_memory_2bp / _standard: the example's --dry-run estimate of a rank's memory, then real
        steps of the same configuration; the measured peak (the allocator's, over the steps) must not exceed the
        estimate by more than MEMORY_ESTIMATE_SLACK."""
        run, exe = self.run, self.build.example_binary()
        skip = self.build.missing(exe, "llama_pipeline")
        for mode in ("2bp", "standard"):
            args = example_command(exe, self.example_memory, mode) + ["--timeout", 120]
            out_json = os.path.join(run.tmp, "example_memory_%s.json" % mode)
            estimate = {}

            def estimated(text, rc, killed, status, detail, estimate=estimate):
                if status == "pass":
                    m = re.search(r"rank 0: .*\| total ([\d.]+) (B|KiB|MiB|GiB|TiB)", text)
                    if not m:
                        return "fail", "no 'rank 0: ... | total N GiB' line in the --dry-run output", None
                    estimate["bytes"] = float(m.group(1)) * SIZE_UNITS[m.group(2)]
                    detail = "rank 0 estimated at %.2f GiB" % (estimate["bytes"] / 2**30)
                return status, detail, None

            dry_name, run_name = "measure:example_memory_%s_estimate" % mode, "measure:example_memory_%s" % mode
            run.piece(dry_name, args + ["--dry-run"], 60, min_s=5, analyze=estimated, skip_reason=skip,
                      needs=self.build.needs("llama_pipeline"))

            def measured(text, rc, killed, status, detail, mode=mode, out_json=out_json, estimate=estimate):
                if status == "pass":
                    steps = json.load(open(out_json))["steps"]
                    peak = peak_of(steps)
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

            run.piece(run_name, args + ["--json", out_json], 240, min_s=60, analyze=measured, needs=(dry_name,))

    def stage_costs(self):
        """summary.json's stage_costs: per split_seqN.json, the fast path's costs, the general path's, the peak
        memory, and the simulated 4-GPU speedups of 2BP."""
        out = self.run.out
        stages = {}
        for name in sorted(os.listdir(out)):
            m = re.match(r"^split_seq(\d+)\.json$", name)
            if not m:
                continue
            seq = m.group(1)
            try:
                j = json.load(open(os.path.join(out, name)))
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
                sim_path = os.path.join(out, "simulate_seq%s.json" % seq)
                if os.path.exists(sim_path):
                    sim = json.load(open(sim_path))
                    stage["simulated_4gpu_m8_speedup_2bp_over_standard"] = {
                        r["schedule"]: r.get("speedup_vs_standard") for r in sim.get("results", [])
                        if r.get("mode") == "2bp"}
            except Exception as e:  # noqa: BLE001
                stage = {"error": "%s: %s" % (name, e)}
            stages["seq" + seq] = stage
        return stages

    def summary(self):
        return {"stage_costs": self.stage_costs(),  # one 7B stage on the GPU; a tiny model in the dry run
                "measurement": dict(self.measure),
                "example": {"config": self.example, "steps": self.example_runs},
                "example_memory": {"config": self.example_memory, "checks": self.memory_checks},
                "communication_ms_assumed": COMMUNICATION_MS}
