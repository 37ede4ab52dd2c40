#!/usr/bin/env python3
"""The GPU check's entry point (stdlib only, Python >= 3.9). Run it through scripts/gpu_check.sh, whose header
describes the usage, the profiles, the environment and the output files. This file parses the command line and
hands over: scripts/gpucheck/runner.py runs pieces (timeouts, process groups, the deadline, summary.json),
scripts/gpucheck/profiles.py says which pieces run in which order, and the other modules of scripts/gpucheck are the
pieces (environment, build and carry, measure, gputests, split_costs, partition, nccl4, emulation)."""

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpucheck import carry, profiles  # noqa: E402
from gpucheck.runner import Interrupted, Runner  # noqa: E402
from gpucheck.util import now, write_json  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description="see the header of scripts/gpu_check.sh")
    ap.add_argument("--dry-run", action="store_true", help="the CPU-side check (this machine)")
    ap.add_argument("--profile", choices=("default", "perf"), default="default",
                    help="default: the suites and measurements; perf: the performance evidence (issue 61)")
    ap.add_argument("--part", type=int, choices=(1, 2), help="perf only: run this part (default: both)")
    ap.add_argument("--deadline", type=float, help="overall deadline in seconds (GPU_CHECK_DEADLINE; default 450, "
                                                   "perf 280 per part)")
    ap.add_argument("--build-dir", help="the GPU configuration's build directory (GPU_CHECK_BUILD_DIR)")
    ap.add_argument("--only", help="comma-separated globs: run only the measure:/test: pieces they match (with or "
                                   "without the prefix); set-up pieces always run")
    ap.add_argument("outdir")
    args = ap.parse_args(argv)
    if args.part and args.profile != "perf":
        ap.error("--part needs --profile perf")
    args.parts = (args.part,) if args.part else (1, 2)
    if args.deadline is None:
        env = os.environ.get("GPU_CHECK_DEADLINE")
        args.deadline = float(env) if env else float(profiles.deadline(args.profile, args.parts))
    return args


def main(argv):
    if argv[:1] == ["prepare"]:
        carry.prepare(force=True)
        return 0
    if argv[:1] == ["prebuild"]:
        return carry.prebuild()
    args = parse(argv)
    try:
        t0 = float(os.environ.get("GPU_CHECK_T0", ""))
        t0 = now() - max(0.0, min(time.time() - t0, 120.0))  # the wrapper's start (bounded, in case)
    except ValueError:
        t0 = now()
    try:
        run = Runner(args.dry_run, args.outdir, t0, args.deadline,
                     only=[g for g in (args.only or "").split(",") if g], opt_in=profiles.OPT_IN[args.profile],
                     profile=profiles.describe(args.profile, args.parts), stale=profiles.OUTPUTS)
    except Exception as e:  # noqa: BLE001 - still leave a summary where one is expected
        os.makedirs(args.outdir, exist_ok=True)
        write_json(os.path.join(args.outdir, "summary.json"),
                   {"gpu": False, "mode": "dry-run" if args.dry_run else "gpu", "ok": False, "pieces": [],
                    "error": "gpu_check could not start: %r\n%s" % (e, traceback.format_exc()[-2000:]),
                    "deadline_s": args.deadline, "total_s": round(now() - t0, 1)})
        raise

    def on_signal(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        run.say("gpu_check: %s UTC on %s, %s, %s, python %s (torch python %s), %d jobs, deadline %.0f s%s" % (
            datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), socket.gethostname(),
            json.dumps(run.profile), "dry run" if run.dry else "GPU run", sys.executable, run.torch_python or "none",
            run.jobs, run.deadline_s, (", CPU build " + run.cpu_build) if run.dry else ""))
        if run.inject:
            run.say("gpu_check: fault injection: %s" % run.inject)
        profiles.run_profile(run, args.profile, args.parts, args.build_dir)
    except Interrupted as e:
        run.interrupted = str(e)
        run.say("gpu_check: interrupted by %s: writing the summary" % e)
    except BaseException as e:  # noqa: BLE001 - the summary is written whatever happened
        run.error = "gpu_check crashed: %r\n%s" % (e, traceback.format_exc()[-3000:])
        run.say(run.error)
    finally:
        ok = run.finish()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
