"""The profiles: which pieces run, in which order, under which deadline. The one place that says so; the pieces
themselves live in their modules (environment, build, measure, gputests).

  default     the suites (for code that changed since the last GPU run) and the default measurements: <= 8 minutes
"""

from .build import Build
from .environment import Environment
from .gputests import GpuTests
from .measure import Measurements

DEFAULT_DEADLINE_S = 450        # a call of <= 8 minutes
# Pieces that run only when an --only glob names them: the 7B memory pieces (~150 s) do not fit a full default run's
# 8 minutes beside everything else, so they get a run of their own (`--only 'measure:example_memory*'`).
OPT_IN = {"default": ("measure:example_memory*",)}
# The measurement files a run may leave in OUTDIR (besides summary.json and the logs): removed before a run so that
# stale results are never summarized.
OUTPUTS = r"^(split|simulate)_seq\d+\.json$"


def deadline(profile, parts):
    return DEFAULT_DEADLINE_S


def describe(profile, parts):
    """What summary.json records of the profile."""
    return {"profile": profile}


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


def run_profile(run, profile, parts, build_dir=None):
    default(run, build_dir)
