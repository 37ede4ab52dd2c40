"""The profiles: which pieces run, in which order, under which deadline. The one place that says so; the pieces
themselves live in their modules (environment, build, measure, gputests, gate, split_costs, partition, nccl4,
emulation).

  default     the suites (for code that changed since the last GPU run) and the default measurements: <= 8 minutes
  perf        the performance evidence of issue 61, in two parts of <= 5 minutes each (--part 1, --part 2; both
              when no part is named), so that both and a machine start fit a 15-minute loan. Pieces by value:
              part 1: the environment and peak TFLOP/s, the numerics gate (split_cuda_test, split's fast vs general
                      path with --check in both precisions), the split costs at seq 1024 (all-bfloat16, mixed), the real
                      partition's per-stage costs (2BP, standard) and the planner's 4-GPU prediction from them, the
                      split costs at seq 4096 (dropped first when time runs out)
              part 2: the 7B job as 4 processes over NCCL (1F1B and ZB-V x 2BP and standard), their first-step
                      losses, mixed precision where the card holds it, the green-context emulation (not implemented)
"""

from . import emulation
from .build import Build
from .environment import Environment
from .gate import NumericsGate
from .gputests import GpuTests
from .measure import Measurements
from .nccl4 import FourProcesses
from .partition import RealPartition
from .split_costs import SplitCosts

DEFAULT_DEADLINE_S = 450        # a call of <= 8 minutes
PERF_PART_DEADLINE_S = 280      # a call of <= 5 minutes, start-up included
# Pieces that run only when an --only glob names them: the 7B memory pieces (~150 s) do not fit a full default run's
# 8 minutes beside everything else, so they get a run of their own (`--only 'measure:example_memory*'`).
OPT_IN = {"default": ("measure:example_memory*",), "perf": ()}
# The measurement files a run may leave in OUTDIR (besides summary.json and the logs): removed before a run so that
# stale results are never summarized.
OUTPUTS = r"^((split|simulate)_seq\d+|split|costs_(2bp|standard)|plan|nccl4)\.json$"
PERF_DRY_SKIPS_CONFIGURE = ("perf dry run: the CPU build's binaries (GPU_CHECK_CPU_BUILD) are measured; the default "
                            "profile's dry run checks the GPU configuration")


def deadline(profile, parts):
    return DEFAULT_DEADLINE_S if profile == "default" else PERF_PART_DEADLINE_S * len(parts)


def describe(profile, parts):
    """What summary.json records of the profile."""
    if profile == "default":
        return {"profile": "default"}
    return {"profile": "perf", "part": "+".join(map(str, parts))}


def default(run, build_dir=None):
    env = Environment(run)
    env.pieces()
    build = Build(run, env, build_dir)
    build.setup_pieces()
    build.library_piece()
    build.build_piece("build:twobp_bench", ["twobp_bench"], 240, needs=("build:library",))
    measurements = Measurements(run, build)
    measurements.split_pieces()
    build.build_piece("build:llama_pipeline", ["llama_pipeline"], 240, needs=("build:library",))
    measurements.example_pieces()
    GpuTests(run, build).pieces()
    measurements.example_memory_pieces()


def perf(run, parts, build_dir=None):
    env = Environment(run)
    env.pieces()
    env.peak_piece()
    build = Build(run, env, build_dir)
    build.setup_pieces(discover=False, skip_configuration=PERF_DRY_SKIPS_CONFIGURE)
    build.library_piece()
    build.build_piece("build:twobp_bench", ["twobp_bench"], 240, needs=("build:library",))
    build.build_piece("build:llama_pipeline", ["llama_pipeline"], 240, needs=("build:library",))
    if 1 in parts:
        NumericsGate(run, build).pieces()
        split = SplitCosts(run, env, build)
        split.probe_piece()
        split.pieces(split.config["seqs"][0])
        RealPartition(run, env, build).pieces()
        split.pieces(split.config["seqs"][1])
    if 2 in parts:
        FourProcesses(run, env, build).pieces()
        emulation.pieces(run)


def run_profile(run, profile, parts, build_dir=None):
    if profile == "default":
        default(run, build_dir)
    else:
        perf(run, parts, build_dir)
