"""The perf profile's 7B job in its 4-rank layout: 4 processes of llama_pipeline over NCCL on the one GPU (each its
own NCCL_HOSTID; launched by launch.py through a TCPStore, no MPI), 1F1B and ZB-V, 2BP and standard, a few steps.
It checks that the job runs, that the first step's loss is the same in every schedule and mode, and that the
measured peak memory is within MEMORY_TOLERANCE of llama_pipeline --dry-run's estimate for the same ranks. In the
dry run, 4 CPU processes (StoreTransport) stand for the GPU processes."""

import os
import sys

from . import sizing
from .measure import example_command
from .util import load_json, relative_difference, write_json

NCCL4_GPU = dict(device="cuda", model="7b", dtype="bf16-pure", ranks=4, micro_batch_size=1, steps=2,
                 candidates=((8, 1024), (4, 1024), (4, 512)), mixed_dtype="bf16")
NCCL4_DRY = dict(device="cpu", model="tiny", layers=8, dtype="fp32", ranks=4, micro_batch_size=1, steps=2,
                 candidates=((4, 16), (4, 8)), mixed_dtype="bf16", card_gib=sizing.H100_GIB)
RUNS = (("1f1b", "2bp"), ("1f1b", "standard"), ("zb-v", "2bp"), ("zb-v", "standard"))
# The mixed-precision run (float32 masters of all four ranks on the one card: ~113 GiB of state for 7B) runs only
# where the estimate fits: an H200, not an H100.
MIXED_RUN = ("1f1b", "2bp")
MEMORY_TOLERANCE = 0.10        # |measured peak / estimate - 1| at most this
# The first step's loss: the same weights, data and forward in every schedule and mode, so identical is expected;
# the tolerance only allows for a summation order that differs (bf16 rounding).
LOSS_TOLERANCE = {"fp32": 1e-6}
LOSS_TOLERANCE_DEFAULT = 1e-3
LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")


def label(schedule, mode, dtype=None):
    return "%s_%s%s" % (schedule, mode, "_" + dtype if dtype else "")


def memory_check(steps, estimate):
    """The measured peak against the estimate {label: [bytes per rank]} entry of this run: per rank where the
    example recorded each rank's peak (a step's peak_memory_bytes_per_rank), else the largest over the ranks (the
    example's peak_memory_bytes is the maximum over the pipeline's ranks). Returns {ratio(s), ok, how}."""
    per_rank = [s.get("peak_memory_bytes_per_rank") for s in steps if s.get("peak_memory_bytes_per_rank")]
    if per_rank:
        measured = [max(step[r] for step in per_rank) for r in range(len(estimate))]
        ratios = [round(m / e, 4) for m, e in zip(measured, estimate)]
        how = "per rank"
    else:
        measured = [max((s.get("peak_memory_bytes") or -1) for s in steps)]
        ratios = [round(measured[0] / max(estimate), 4)] if measured[0] > 0 else []
        how = "largest over the ranks (the example records no per-rank peak)"
    ok = bool(ratios) and all(abs(r - 1) <= MEMORY_TOLERANCE for r in ratios)
    return {"measured_bytes": measured, "estimate_bytes": estimate, "measured_over_estimate": ratios, "how": how,
            "ok": ok}


def first_losses_agree(losses, dtype):
    """(ok, largest relative difference, identical) of the first step's loss over runs {label: loss}."""
    values = list(losses.values())
    worst = max(relative_difference(v, values[0]) for v in values)
    return worst <= LOSS_TOLERANCE.get(dtype, LOSS_TOLERANCE_DEFAULT), worst, len(set(values)) == 1


class FourProcesses:
    """measure:nccl4_size_*, measure:nccl4_<schedule>_<mode> (x4), measure:nccl4_compare, and the mixed-precision
    measure:nccl4_1f1b_2bp_bf16 where it fits."""

    def __init__(self, run, env, build):
        self.run, self.env, self.build = run, env, build
        self.config = NCCL4_DRY if run.dry else NCCL4_GPU
        self.sizer = sizing.Sizer(run, env, "measure:nccl4", processes=self.config["ranks"])
        self.results = {}   # label -> {losses, peak, memory, tokens_per_s, ...}
        self.raw = {}       # label -> the example's --json document (nccl4.json)
        self.comparison = None
        run.add_section("nccl_4_processes", self.summary)

    def command(self, schedule, mode, m, seq, dtype=None):
        c = self.config
        e = dict(c, schedule=schedule, microbatches=m, seq_len=seq, dtype=dtype or c["dtype"])
        return example_command(self.build.example_binary(), e, mode)

    def configs(self, m, seq):
        out = [(label(s, mode), self.command(s, mode, m, seq)) for s, mode in RUNS]
        s, mode = MIXED_RUN
        return out + [(label(s, mode, self.config["mixed_dtype"]), self.command(s, mode, m, seq,
                                                                                 self.config["mixed_dtype"]))]

    def pieces(self):
        run, c = self.run, self.config
        exe = self.build.example_binary()
        needs = self.build.needs("llama_pipeline")
        chosen = self.sizer.pieces(c["candidates"], self.configs, c.get("card_gib"),
                                   required=[label(s, mode) for s, mode in RUNS],
                                   skip_reason=self.build.missing(exe, "llama_pipeline"), needs=needs)
        for schedule, mode in RUNS:
            self.run_piece(chosen, schedule, mode)
        run.func_piece("measure:nccl4_compare", self.compare,
                       needs=["measure:nccl4_" + label(s, mode) for s, mode in RUNS])
        schedule, mode = MIXED_RUN
        mixed = label(schedule, mode, c["mixed_dtype"])
        skip = None
        if chosen is not None and not sizing.fits(chosen["needs_gib"][mixed], chosen["card_gib"] or 0):
            skip = "mixed precision needs %.1f GiB with %d processes: does not fit %.2f x %.1f GiB" % (
                chosen["needs_gib"][mixed], c["ranks"], sizing.FIT_SHARE, chosen["card_gib"] or 0)
        self.run_piece(chosen, schedule, mode, c["mixed_dtype"], skip)

    def run_piece(self, chosen, schedule, mode, dtype=None, skip=None):
        run, c = self.run, self.config
        key = label(schedule, mode, dtype)
        name = "measure:nccl4_" + key
        if chosen is None:
            return run.record(name, "skipped", 0, "no size: see the measure:nccl4_size_* pieces")
        out_json = os.path.join(run.tmp, "nccl4_%s.json" % key)
        launch = [sys.executable, LAUNCH, "--nproc", c["ranks"]] + ([] if run.dry else ["--one-gpu"]) + ["--"]
        cmd = launch + self.command(schedule, mode, chosen["m"], chosen["seq"], dtype) + [
            "--timeout", 60, "--json", out_json]
        estimate = chosen["estimates"][key]

        def ran(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail, None
            doc = load_json(out_json)
            steps = doc["steps"]
            self.raw[key] = dict(doc, estimate_bytes_per_rank=estimate)
            write_json(os.path.join(run.out, "nccl4.json"), self.raw)
            mem = memory_check(steps, estimate)
            self.results[key] = {"dtype": dtype or c["dtype"], "losses": [s.get("loss") for s in steps],
                                 "grad_norms": [s.get("grad_norm") for s in steps],
                                 "tokens_per_s": [s.get("tokens_per_s") for s in steps], "memory": mem,
                                 "world_size": doc.get("world_size")}
            detail = "loss %s, %s tokens/s, peak/estimate %s (%s), world size %s" % (
                " -> ".join("%.4f" % s["loss"] for s in steps), "/".join("%.0f" % s["tokens_per_s"] for s in steps),
                ", ".join("%.3f" % r for r in mem["measured_over_estimate"]) or "n/a", mem["how"],
                doc.get("world_size"))
            if not mem["ok"]:
                return "fail", detail + ": not within %.0f %% of the estimate" % (100 * MEMORY_TOLERANCE), None
            return "pass", detail, None

        run.piece(name, cmd, 120, min_s=45 if not run.dry else 3, analyze=ran, needs=self.build.needs("llama_pipeline"),
                  skip_reason=skip)

    def compare(self):
        """The first step's loss of every schedule x mode (same weights, data, forward): identical, up to
        LOSS_TOLERANCE."""
        wanted = [label(s, mode) for s, mode in RUNS]
        losses = {k: self.results[k]["losses"][0] for k in wanted}
        ok, worst, identical = first_losses_agree(losses, self.config["dtype"])
        tol = LOSS_TOLERANCE.get(self.config["dtype"], LOSS_TOLERANCE_DEFAULT)
        self.comparison = {"first_step_losses": losses, "largest_relative_difference": worst,
                           "identical": identical, "tolerance": tol, "ok": ok}
        detail = "first-step losses %s: %s (largest relative difference %.2g, tolerance %g)" % (
            ", ".join("%s %.6f" % kv for kv in losses.items()), "identical" if identical else "differ", worst, tol)
        if not ok:
            raise RuntimeError(detail)
        return detail

    def summary(self):
        return {"nccl_4_processes": {
            "config": {k: v for k, v in self.config.items() if k != "candidates"},
            "candidates": [list(x) for x in self.config["candidates"]],
            "launcher": "scripts/gpucheck/launch.py (TCPStore rendezvous, torchrun's variables%s)" % (
                "" if self.run.dry else ", NCCL_HOSTID per rank"),
            "stands_for_gpu": "4 CPU processes over the StoreTransport" if self.run.dry else None,
            "sizing": self.sizer.summary(), "runs": self.results, "first_step": self.comparison,
            "memory_tolerance": MEMORY_TOLERANCE}}
