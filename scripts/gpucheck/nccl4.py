"""The perf profile's 7B job in its 4-rank layout: 4 processes of llama_pipeline over NCCL on the one GPU (each its
own NCCL_HOSTID; launched by launch.py through a TCPStore, no MPI), 1F1B and ZB-V, 2BP and standard, a few steps.
It checks that the job runs, that the first step's loss and gradient norm are the same in every schedule and mode,
and that the measured peak memory is within MEMORY_TOLERANCE of llama_pipeline --dry-run's estimate for the same
ranks. In the dry run, 4 CPU processes (StoreTransport) stand for the GPU processes."""

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
# The receive-wait A/B (issue 70): this run again with --nccl-stream-waits (NcclOptions::stream_waits: receives
# waited on the compute stream, a watchdog thread for their timeouts) against its host-waited run above. Same
# computation, so the first step's loss and gradient norm must agree as between the other runs; the GPU run's
# tokens/s decide the default: stream waits where they are at least STREAM_WAITS_MIN_GAIN faster, host waits
# otherwise (2 steps of one run each: a smaller gain is within the noise).
STREAM_RUN = ("1f1b", "2bp")
STREAM_SUFFIX = "_stream"
STREAM_WAITS_MIN_GAIN = 0.02
MEMORY_TOLERANCE = 0.10        # |measured peak / estimate - 1| at most this
# The first step's loss: the same weights, data and forward in every schedule and mode, so identical is expected;
# the tolerance only allows for a summation order that differs (bf16 rounding).
LOSS_TOLERANCE = {"fp32": 1e-6}
LOSS_TOLERANCE_DEFAULT = 1e-3
# The first step's gradient norm (the example's grad_norm: the global norm over every rank's gradients): the same
# gradients summed over the micro-batches in another order (2BP's W against standard's B, ZB-V against 1F1B), so
# equal up to that order's rounding -- float32's few ulps, bfloat16's 2^-8 per rounding.
GRAD_NORM_TOLERANCE = {"fp32": 1e-5}
GRAD_NORM_TOLERANCE_DEFAULT = 2e-2
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


def first_grad_norms_agree(norms, dtype):
    """(ok, largest relative difference) of the first step's gradient norm over runs {label: norm}; a missing or
    non-positive norm (the example wrote none) is not ok."""
    values = list(norms.values())
    if not values or any(not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 for v in values):
        return False, None
    worst = max(relative_difference(v, values[0]) for v in values)
    return worst <= GRAD_NORM_TOLERANCE.get(dtype, GRAD_NORM_TOLERANCE_DEFAULT), worst


def receive_waits_verdict(host_tokens_per_s, stream_tokens_per_s, dry):
    """{host/stream tokens/s, stream_over_host, default, rule}: NcclOptions::stream_waits' default as this run
    proposes it -- "stream" where stream waits were at least STREAM_WAITS_MIN_GAIN faster, else "host" (the
    default today); in a dry run (CPU processes, no NCCL: the flag had no effect) "undecided"."""
    ratio = stream_tokens_per_s / host_tokens_per_s if host_tokens_per_s else 0.0
    default = "undecided" if dry else ("stream" if ratio >= 1 + STREAM_WAITS_MIN_GAIN else "host")
    return {"host_tokens_per_s": host_tokens_per_s, "stream_tokens_per_s": stream_tokens_per_s,
            "stream_over_host": round(ratio, 4), "default": default,
            "rule": "stream where stream/host >= %.2f (the last step's tokens/s), else host" % (
                1 + STREAM_WAITS_MIN_GAIN)}


class FourProcesses:
    """measure:nccl4_size_*, measure:nccl4_<schedule>_<mode> (x4), measure:nccl4_compare, the receive-wait A/B
    (measure:nccl4_1f1b_2bp_stream, measure:nccl4_receive_waits), and the mixed-precision measure:nccl4_1f1b_2bp_bf16
    where it fits."""

    def __init__(self, run, env, build):
        self.run, self.env, self.build = run, env, build
        self.config = NCCL4_DRY if run.dry else NCCL4_GPU
        self.sizer = sizing.Sizer(run, env, "measure:nccl4", processes=self.config["ranks"])
        self.results = {}   # label -> {losses, peak, memory, tokens_per_s, ...}
        self.raw = {}       # label -> the example's --json document (nccl4.json)
        self.comparison = None
        self.stream_comparison = None  # measure:nccl4_receive_waits
        run.add_section("nccl_4_processes", self.summary)

    def command(self, schedule, mode, m, seq, dtype=None, stream=False):
        c = self.config
        e = dict(c, schedule=schedule, microbatches=m, seq_len=seq, dtype=dtype or c["dtype"])
        return example_command(self.build.example_binary(), e, mode) + (["--nccl-stream-waits"] if stream else [])

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
        schedule, mode = STREAM_RUN
        self.run_piece(chosen, schedule, mode, stream=True)
        run.func_piece("measure:nccl4_receive_waits", self.receive_waits,
                       needs=["measure:nccl4_" + label(schedule, mode) + suffix for suffix in ("", STREAM_SUFFIX)])
        schedule, mode = MIXED_RUN
        mixed = label(schedule, mode, c["mixed_dtype"])
        skip = None
        if chosen is not None and not sizing.fits(chosen["needs_gib"][mixed], chosen["card_gib"] or 0):
            skip = "mixed precision needs %.1f GiB with %d processes: does not fit %.2f x %.1f GiB" % (
                chosen["needs_gib"][mixed], c["ranks"], sizing.FIT_SHARE, chosen["card_gib"] or 0)
        self.run_piece(chosen, schedule, mode, c["mixed_dtype"], skip)

    def run_piece(self, chosen, schedule, mode, dtype=None, skip=None, stream=False):
        run, c = self.run, self.config
        key = label(schedule, mode, dtype) + (STREAM_SUFFIX if stream else "")
        name = "measure:nccl4_" + key
        if chosen is None:
            return run.record(name, "skipped", 0, "no size: see the measure:nccl4_size_* pieces")
        out_json = os.path.join(run.tmp, "nccl4_%s.json" % key)
        launch = [sys.executable, LAUNCH, "--nproc", c["ranks"]] + ([] if run.dry else ["--one-gpu"]) + ["--"]
        cmd = launch + self.command(schedule, mode, chosen["m"], chosen["seq"], dtype, stream) + [
            "--timeout", 60, "--json", out_json]
        estimate = chosen["estimates"][label(schedule, mode, dtype)]  # the receive mode moves no memory

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
                                 "world_size": doc.get("world_size"),
                                 "nccl_stream_waits": doc.get("nccl_stream_waits")}
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
        """The first step's loss and gradient norm of every schedule x mode (same weights, data, forward): the
        losses identical up to LOSS_TOLERANCE, the norms up to GRAD_NORM_TOLERANCE."""
        wanted = [label(s, mode) for s, mode in RUNS]
        dtype = self.config["dtype"]
        losses = {k: self.results[k]["losses"][0] for k in wanted}
        ok, worst, identical = first_losses_agree(losses, dtype)
        tol = LOSS_TOLERANCE.get(dtype, LOSS_TOLERANCE_DEFAULT)
        norms = {k: (self.results[k]["grad_norms"] or [None])[0] for k in wanted}
        norms_ok, norms_worst = first_grad_norms_agree(norms, dtype)
        norms_tol = GRAD_NORM_TOLERANCE.get(dtype, GRAD_NORM_TOLERANCE_DEFAULT)
        self.comparison = {"first_step_losses": losses, "largest_relative_difference": worst,
                           "identical": identical, "tolerance": tol, "ok": ok and norms_ok,
                           "losses_ok": ok,
                           "grad_norms": {"first_step": norms, "largest_relative_difference": norms_worst,
                                          "tolerance": norms_tol, "ok": norms_ok}}
        detail = "first-step losses %s: %s (largest relative difference %.2g, tolerance %g); grad norms %s: %s" % (
            ", ".join("%s %.6f" % kv for kv in losses.items()), "identical" if identical else "differ", worst, tol,
            ", ".join("%s %s" % (k, "%.6g" % v if isinstance(v, (int, float)) else v) for k, v in norms.items()),
            "largest relative difference %.2g, tolerance %g" % (norms_worst, norms_tol) if norms_worst is not None
            else "missing from the example's JSON")
        if not (ok and norms_ok):
            raise RuntimeError(detail)
        return detail

    def receive_waits(self):
        """measure:nccl4_receive_waits: the same run with receives waited on the host and on the stream: the first
        step's loss and gradient norm agree, and the stream/host ratio of the last step's tokens/s proposes
        NcclOptions::stream_waits' default (receive_waits_verdict)."""
        schedule, mode = STREAM_RUN
        host, stream = self.results[label(schedule, mode)], self.results[label(schedule, mode) + STREAM_SUFFIX]
        dtype = self.config["dtype"]
        ok, worst, _ = first_losses_agree({"host": host["losses"][0], "stream": stream["losses"][0]}, dtype)
        norms_ok, norms_worst = first_grad_norms_agree(
            {"host": (host["grad_norms"] or [None])[0], "stream": (stream["grad_norms"] or [None])[0]}, dtype)
        self.stream_comparison = receive_waits_verdict(host["tokens_per_s"][-1], stream["tokens_per_s"][-1],
                                                       self.run.dry)
        self.stream_comparison.update({"run": label(schedule, mode), "first_step_loss_difference": worst,
                                       "first_step_grad_norm_difference": norms_worst, "ok": ok and norms_ok,
                                       "flag_recorded": stream.get("nccl_stream_waits")})
        v = self.stream_comparison
        detail = "%s: host waits %.0f tokens/s, stream waits %.0f tokens/s (x%.3f): default %s%s; first step %s" % (
            v["run"], v["host_tokens_per_s"], v["stream_tokens_per_s"], v["stream_over_host"], v["default"],
            " (dry run: no NCCL, nothing decided)" if self.run.dry else "",
            "agrees" if ok and norms_ok else "DIFFERS (loss %.2g, grad norm %s)" % (worst, norms_worst))
        if not (ok and norms_ok) or stream.get("nccl_stream_waits") is not True:
            raise RuntimeError(detail + ("" if stream.get("nccl_stream_waits") is True
                                         else "; the example's JSON does not say nccl_stream_waits: true"))
        return detail

    def summary(self):
        return {"nccl_4_processes": {
            "config": {k: v for k, v in self.config.items() if k != "candidates"},
            "candidates": [list(x) for x in self.config["candidates"]],
            "launcher": "scripts/gpucheck/launch.py (TCPStore rendezvous, torchrun's variables%s)" % (
                "" if self.run.dry else ", NCCL_HOSTID per rank"),
            "stands_for_gpu": "4 CPU processes over the StoreTransport" if self.run.dry else None,
            "sizing": self.sizer.summary(), "runs": self.results, "first_step": self.comparison,
            "receive_waits": self.stream_comparison,
            "memory_tolerance": MEMORY_TOLERANCE}}
