"""The perf profile's real partition: llama_pipeline runs the whole 7B model as ONE rank holding all four stages
as chunks (the first holds the embedding, the last the head, final norm and cross-entropy; nothing is shared
between ranks), with 2BP and standard, and writes each stage's measured F, I, W, B (--costs-json); then
`twobp_bench plan --costs-json` predicts every schedule x mode on 4 GPUs from them."""

import os

from . import sizing
from .measure import COMMUNICATION_MS, example_command
from .util import load_json

# 1f1b places one chunk per rank; with four chunks on one rank the same order is interleaved-1f1b with p = 1.
# Unequal chunks (9,8,7,8 of the 32 blocks; the embedding on the first, the head on the last) make the planner's
# per-chunk fit X = a + b * blocks + e * [embedding] + h * [head] exactly determined: with 8,8,8,8 every chunk has
# the same blocks and the fit cannot tell the per-action term a from the per-block one (it falls back to FLOP shares).
PARTITION_GPU = dict(device="cuda", model="7b", dtype="bf16-pure", ranks=1, chunks_per_rank=4,
                     schedule="interleaved-1f1b", micro_batch_size=1, steps=3, partition="9,8,7,8",
                     candidates=((4, 1024), (2, 1024), (1, 1024)))
# The dry run: the tiny model with 8 blocks in unequal chunks, as on the GPU (so that the planner has two chunks per
# rank to place and a fit to make), fp32 on the CPU; a pretend 80 GB card.
PARTITION_DRY = dict(device="cpu", model="tiny", layers=8, dtype="fp32", ranks=1, chunks_per_rank=4,
                     schedule="interleaved-1f1b", micro_batch_size=1, steps=2, partition="3,2,1,2",
                     candidates=((2, 16), (1, 16)), card_gib=sizing.H100_GIB)
MODES = ("2bp", "standard")
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "bf16-pure": 2}   # per element of a message, by the example's --dtype

# The planner's pipeline: 4 GPUs, one replica, no recomputation, 8 micro-batches of one sequence.
PLAN_RANKS, PLAN_MICRO_BATCHES = 4, 8
# One GPU cannot measure a link, so the message time is ASSUMED: the default profile's (measure.COMMUNICATION_MS,
# 0.1 ms per activation message: NVLink-class; an H100's NVLink moves the 8 MiB [1, 1024, 4096] bf16 activation in
# ~0.02 ms at 450 GB/s per direction, and 0.1 ms leaves room for protocol and launch overheads). The planner takes a
# link, not a time: the bandwidth that gives this time at the run's sequence length, with 5 us of latency.
MESSAGE_MS = COMMUNICATION_MS
LINK_LATENCY_US = 5.0


def link_gbps(seq, dim, dtype_bytes, micro_batch_size=1, message_ms=MESSAGE_MS, latency_us=LINK_LATENCY_US):
    """Gb/s at which one [micro_batch_size, seq, dim] activation takes message_ms, latency_us of it latency."""
    bits = 8.0 * micro_batch_size * seq * dim * dtype_bytes
    return bits / ((message_ms - latency_us / 1000.0) * 1e-3) / 1e9


def predictions(plan):
    """From a `twobp_bench plan --json` document: per schedule, the fastest candidate of each mode (its v, step ms,
    tokens/s, peak GiB, fits), 2BP's speedup over standard, and each mode's over 1F1B standard."""
    best = {}
    for c in plan.get("candidates", []):
        key = (c.get("schedule"), c.get("mode"))
        if c.get("sim_step_ms") and (key not in best or c["sim_step_ms"] < best[key]["sim_step_ms"]):
            best[key] = c
    base = best.get(("1f1b", "standard"), {}).get("sim_step_ms")
    out = {}
    for (schedule, mode), c in sorted(best.items()):
        row = out.setdefault(schedule, {})
        row[mode] = {"v": c.get("v"), "m": c.get("m"), "step_ms": round(c["sim_step_ms"], 3),
                     "tokens_per_s": c.get("sim_tokens_per_s"), "bubble": c.get("sim_bubble_fraction"),
                     "peak_gib": round(c["peak_memory_bytes"] / 2**30, 2)
                     if isinstance(c.get("peak_memory_bytes"), (int, float)) else None,
                     "fits": c.get("fits"),
                     "speedup_over_1f1b_standard": round(base / c["sim_step_ms"], 4) if base else None}
    for schedule, row in out.items():
        if "2bp" in row and "standard" in row:
            row["2bp_speedup_over_standard"] = round(row["standard"]["step_ms"] / row["2bp"]["step_ms"], 4)
    return out


class RealPartition:
    """measure:stage_costs_size_*, measure:stage_costs_2bp, measure:stage_costs_standard, measure:plan_4gpu."""

    def __init__(self, run, env, build):
        self.run, self.env, self.build = run, env, build
        self.config = PARTITION_DRY if run.dry else PARTITION_GPU
        self.sizer = sizing.Sizer(run, env, "measure:stage_costs", processes=1)
        self.runs = {}     # mode -> {steps, costs: the --costs-json document}
        self.plan = None   # {"command", "link", "predictions", ...}
        run.add_section("stage_costs_real_partition", self.summary)

    def command(self, mode, m, seq):
        e = dict(self.config, microbatches=m, seq_len=seq)
        return example_command(self.build.example_binary(), e, mode)

    def pieces(self):
        run, c = self.run, self.config
        exe = self.build.example_binary()
        skip = self.build.missing(exe, "llama_pipeline")
        needs = self.build.needs("llama_pipeline")
        chosen = self.sizer.pieces(c["candidates"], lambda m, seq: [(mode, self.command(mode, m, seq))
                                                                    for mode in MODES],
                                   c.get("card_gib"), required=MODES, skip_reason=skip, needs=needs)
        for mode in MODES:
            name = "measure:stage_costs_" + mode
            if chosen is None:
                run.record(name, "skipped", 0, "no size: see the measure:stage_costs_size_* pieces")
                continue
            costs = os.path.join(run.out, "costs_%s.json" % mode)
            out_json = os.path.join(run.tmp, "stage_costs_%s.json" % mode)
            cmd = self.command(mode, chosen["m"], chosen["seq"]) + ["--timeout", 90, "--json", out_json,
                                                                    "--costs-json", costs]

            def ran(text, rc, killed, status, detail, mode=mode, costs=costs, out_json=out_json):
                if status != "pass":
                    return status, detail, None
                doc = load_json(costs)
                steps = load_json(out_json)["steps"]
                self.runs[mode] = {"costs": doc, "steps": steps}
                result = (doc.get("results") or [{}])[0]
                per = result.get("costs_ms") or {}
                parts = ["%s %s" % (k, "/".join("%.2f" % x for x in v)) for k, v in sorted(per.items()) if any(v)]
                return "pass", "per stage ms: %s; %d steps measured; peak %.2f GiB" % (
                    "; ".join(parts) or "none", doc.get("config", {}).get("steps_measured", 0),
                    max(s.get("peak_memory_bytes") or 0 for s in steps) / 2**30), None

            # The whole 7B model is built on the CPU first (~60 s of the ~70 s a run took on an H200, docs/GPU.md):
            # a run with less than min_s left would be killed before its costs are written.
            run.piece(name, cmd, 150, min_s=70 if not run.dry else 3, analyze=ran, needs=needs)
        self.plan_piece(chosen)

    def plan_piece(self, chosen):
        run, c = self.run, self.config
        name = "measure:plan_4gpu"
        if chosen is None:
            return run.record(name, "skipped", 0, "no size: see the measure:stage_costs_size_* pieces")
        bench = self.build.bench_binary()
        plan_json = os.path.join(run.out, "plan.json")
        try:  # the model's width as the measured run wrote it
            dim = load_json(os.path.join(run.out, "costs_2bp.json"))["config"]["dim"]
        except (OSError, ValueError, KeyError):
            return run.piece(name, [], 30, needs=("measure:stage_costs_2bp",))
        gbps = link_gbps(chosen["seq"], dim, ACTIVATION_BYTES[c["dtype"]], c["micro_batch_size"])
        link = {"message_ms_assumed": MESSAGE_MS, "link_gbps": round(gbps, 3), "link_latency_us": LINK_LATENCY_US,
                "why": "one GPU cannot measure a link: NVLink-class, 0.1 ms per [1, seq, dim] activation message "
                       "(partition.MESSAGE_MS)"}
        card = c.get("card_gib") if run.dry else self.env.card_gib()
        cmd = [bench, "plan", "--costs-json", os.path.join(run.out, "costs_2bp.json"),
               os.path.join(run.out, "costs_standard.json"), "--ranks", PLAN_RANKS, "--max-dp", 1,
               "--recompute", "off", "--dtype", c["dtype"], "--seq", chosen["seq"], "--micro-batch-size",
               c["micro_batch_size"], "--global-batch", PLAN_MICRO_BATCHES * c["micro_batch_size"],
               "--link-gbps", "%.3f" % gbps, "--link-latency-us", LINK_LATENCY_US, "--top", 200, "--json", plan_json]
        if card:
            cmd += ["--gpu-memory-gb", "%.1f" % card]

        def ran(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail, None
            doc = load_json(plan_json)
            pred = predictions(doc)
            kind = (((doc.get("config") or {}).get("cost_model")) or {}).get("kind")
            self.plan = {"link": link, "costs_model": (doc.get("config") or {}).get("costs"),
                         "cost_model_kind": kind, "ranks": PLAN_RANKS, "micro_batches": PLAN_MICRO_BATCHES,
                         "seq": chosen["seq"], "predictions": pred}
            if not pred:
                return "fail", "the plan has no candidates", None
            if kind != "fitted":  # the unequal partition exists to make the per-action term identifiable
                return "fail", "the per-chunk costs were not fitted (cost model %r): give chunks of unequal " \
                               "blocks (PARTITION_*['partition'])" % kind, None
            return "pass", "2BP over standard: " + ", ".join(
                "%s %.3f" % (s, r["2bp_speedup_over_standard"]) for s, r in pred.items()
                if "2bp_speedup_over_standard" in r), None

        run.piece(name, cmd, 30, min_s=3, analyze=ran, skip_reason=self.build.missing(bench, "twobp_bench"),
                  needs=("measure:stage_costs_2bp", "measure:stage_costs_standard"))

    def summary(self):
        return {"stage_costs_real_partition": {
            "config": {k: v for k, v in self.config.items() if k != "candidates"},
            "candidates": [list(x) for x in self.config["candidates"]], "sizing": self.sizer.summary(),
            "runs": {mode: {"costs": r["costs"], "losses": [s.get("loss") for s in r["steps"]],
                            "peak_memory_gib": round(max(s.get("peak_memory_bytes") or 0 for s in r["steps"]) / 2**30,
                                                     3)}
                     for mode, r in self.runs.items()},
            "plan_4gpu": self.plan}}
