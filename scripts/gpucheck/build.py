"""The build pieces: .third_party checked, carried binaries checked (they stand for configure and build when they
are of these sources and load here), configure, targets, the gpu tests discovered, and the builds. Also where each
binary is: the GPU build's, the carried one, or in the dry run the CPU build's (GPU_CHECK_CPU_BUILD)."""

import json
import os
import re
import shutil
import tempfile

from . import carry
from .util import ROOT, dir_bytes, tree_bytes


class Build:
    """The GPU configuration and its binaries. prebuilt is the carried binaries' manifest once they were checked to
    load here (None otherwise); targets the configuration's targets; discovered the gpu tests ctest knows."""

    def __init__(self, run, env, build_dir=None):
        self.run, self.env = run, env
        self.prebuilt_dir = os.path.abspath(os.environ.get("GPU_CHECK_PREBUILT") or carry.PREBUILT)
        self.prebuilt = None
        self.targets = None
        self.discovered = []
        self.configured = True     # False: the dry run left the configuration out (skip_configuration)
        build = build_dir or os.environ.get("GPU_CHECK_BUILD_DIR")
        if build:
            self.dir = os.path.abspath(build)
        elif run.dry:  # unique, next to OUTDIR (its name starts with build, which .gitignore covers at the root)
            self.dir = None    # made when configured (a dry run that does not configure leaves nothing)
        else:
            self.dir = os.path.join(ROOT, "build-gpu")
        run.add_section("build", self.summary)

    def build_dir(self):
        if self.dir is None:
            parent = os.path.dirname(self.run.out)
            os.makedirs(parent, exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix="build-gpu-dry.", dir=parent)
            if os.environ.get("GPU_CHECK_KEEP_BUILD", "") in ("", "0"):
                self.run.cleanups.append(lambda d=self.dir: shutil.rmtree(d, ignore_errors=True))
        return self.dir

    # ---- set-up pieces ----
    def setup_pieces(self, discover=True, skip_configuration=None):
        """third_party, prebuilt, configure, targets and (discover) discover. skip_configuration: in the dry run,
        the reason to leave configure and targets out (the measurements then use the CPU build's binaries)."""
        self.third_party_piece()
        self.prebuilt_piece()
        if skip_configuration and self.run.dry and not self.prebuilt:
            self.configured = False
            self.skip_reason = skip_configuration
            for name in ("configure", "targets") + (("discover",) if discover else ()):
                self.run.record(name, "skipped", 0, skip_configuration)
            return
        self.configure_piece()
        self.targets_piece()
        if discover:
            self.discover_piece()

    def third_party_piece(self):
        run = self.run

        def check():
            notes = []
            if not carry.third_party_complete():
                if not run.dry:
                    raise RuntimeError(".third_party is missing or incomplete: run `scripts/gpu_check.sh prepare` "
                                       "before and carry .third_party")
                carry.prepare(quiet=True)
                notes.append("prepared")
            size = dir_bytes(carry.THIRD_PARTY) / 2**20
            if size > carry.THIRD_PARTY_MAX_MIB:
                raise RuntimeError(".third_party is %.1f MiB: with the tree it must stay under the 64 MiB carry "
                                   "limit (at most %d MiB)" % (size, carry.THIRD_PARTY_MAX_MIB))
            notes.append(".third_party %.1f MiB" % size)
            tree = tree_bytes()
            if tree is not None:
                notes.append("tree %.1f MiB (git ls-files), total %.1f of 64 MiB" % (tree / 2**20, tree / 2**20 + size))
            return ", ".join(notes)

        run.func_piece("third_party", check)

    def prebuilt_piece(self):
        """Binaries carried in .gpu-prebuilt (`gpu_check.sh prebuild`, here) stand for configure and build when
        they were built from these very sources and load against this machine's torch; otherwise the check builds
        here, as without them. Their libraries come from this machine's torch package (LD_LIBRARY_PATH)."""
        run, record = self.run, self.run.record
        path = os.path.join(self.prebuilt_dir, "manifest.json")
        if run.dry and not os.environ.get("GPU_CHECK_PREBUILT"):
            return record("prebuilt", "skipped", 0, "dry run: carried binaries are used only with "
                          "GPU_CHECK_PREBUILT=DIR")
        if not os.path.isfile(path):
            return record("prebuilt", "skipped", 0, "no carried binaries in %s: building here" % self.prebuilt_dir)
        try:
            manifest = json.load(open(path))
            digest = carry.source_digest()
        except (OSError, ValueError) as e:
            return record("prebuilt", "skipped", 0, "unreadable %s (%s): building here" % (path, e))
        if manifest.get("digest") != digest:
            return record("prebuilt", "skipped", 0, "carried binaries are of other sources (digest %s, these "
                          "%s): building here" % (str(manifest.get("digest"))[:12], digest[:12]))
        versions = self.env.versions
        here = versions.get("torch") or versions.get("file_version") or ""
        if not self.env.torch_root or here.split(".")[:2] != str(manifest.get("torch")).split(".")[:2]:
            return record("prebuilt", "skipped", 0, "carried binaries were linked against torch %s, this "
                          "machine has %s: building here" % (manifest.get("torch"), here or "none"))
        env = dict(run.env)
        env["LD_LIBRARY_PATH"] = ":".join(carry.torch_lib_dirs(self.env.torch_root) + list(filter(None, [
            env.get("LD_LIBRARY_PATH")])))
        script = ('cd "$0" || exit 1; rc=0; for b in "$@"; do ldd "./$b" | grep "not found" && rc=1; done; '
                  '[ $rc = 0 ] || exit 1; ./"$1" --help > /dev/null || exit 1; ./"$2" --help > /dev/null || exit 1; '
                  'shift 2; for b in "$@"; do ./"$b" --gtest_list_tests > /dev/null || exit 1; done; echo "they load"')
        if not manifest.get("example"):
            return record("prebuilt", "skipped", 0, "carried binaries without the example (an older prebuild): "
                          "building here")
        binaries = [manifest["bench"], manifest["example"]] + [t["binary"] for t in manifest["tests"]]

        def verdict(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail + " -- building here instead", None
            return status, "%s, built %s against torch %s: they load here (LD_LIBRARY_PATH %s)" % (
                ", ".join(binaries), manifest["built_utc"], manifest["torch"], env["LD_LIBRARY_PATH"]), None

        piece, _ = run.piece("prebuilt", ["sh", "-c", script, self.prebuilt_dir] + binaries, 60, min_s=5, env=env,
                             analyze=verdict)
        if piece["status"] == "pass":
            run.env, self.prebuilt = env, manifest

    def configure_piece(self):
        run = self.run
        if not self.env.torch_root and run.dry:
            self.env.torch_root = carry.torch_root_from_cache(run.cpu_build) or ""
        if self.prebuilt:
            return run.provide("configure", "configured on the machine that built them, with the same options")
        args = carry.configure_args(self.build_dir(), self.env.torch_root, run.torch_python, run.env.get("PATH"))

        def summary_line(text, rc, killed, status, detail):
            line = next((l.strip() for l in text.splitlines() if l.startswith("-- twobp:")), "")
            self.env.facts["configure"] = line[3:] if line else None
            if status == "pass":
                return status, line[3:] or detail, None
            return status, detail, None

        run.piece("configure", args, 180, min_s=15, log="build.log", needs=("third_party",), analyze=summary_line)

    def targets_piece(self):
        run = self.run
        if self.prebuilt:
            self.targets = set(self.prebuilt["targets"])
            return run.provide("targets", ", ".join(sorted(self.targets)))

        def parse(text, rc, killed, status, detail):
            names = set()
            for line in text.splitlines():
                m = re.match(r"^([\w.+-]+): phony$", line.strip()) or re.match(r"^\.\.\. ([\w.+-]+)", line.strip())
                if m:
                    names.add(m.group(1))
            self.targets = names
            if status == "pass" and not names:
                return "fail", "no targets in the help output", None
            return status, "%d targets%s" % (len(names), "" if "twobp_nccl" in names else
                                              "; no twobp_nccl here (no NCCL transport in this configuration)"), None

        run.piece("targets", ["cmake", "--build", self.build_dir(), "--target", "help"], 60, needs=("configure",),
                  analyze=parse)

    def discover_piece(self):
        run = self.run
        if self.prebuilt:
            self.discovered = [dict(t, binary=os.path.join(self.prebuilt_dir, t["binary"]))
                               for t in self.prebuilt["tests"]]
            return run.provide("discover", "gpu tests: " + ", ".join(t["name"] for t in self.discovered))

        def parse(text, rc, killed, status, detail):
            if status != "pass":
                return status, detail, None
            found = carry.gpu_tests_from_ctest(text, self.build_dir())
            self.discovered = found
            return "pass", "gpu tests: " + (", ".join(t["name"] + (" (mpi: not run)" if t["mpi"] else "")
                                                       for t in found) or "none"), None

        run.piece("discover", ["ctest", "--test-dir", self.build_dir(), "-L", "gpu", "--show-only=json-v1"], 60,
                  needs=("configure",), analyze=parse)

    def build_piece(self, name, targets, timeout, min_s=20, needs=()):
        """On the GPU: builds targets. In the dry run: checks that they exist in the GPU configuration."""
        run = self.run
        needs = ("targets",) + tuple(needs)
        if self.prebuilt:
            return run.provide(name, "built here from the same sources (%s)" % self.prebuilt["built_utc"])
        if not self.configured:
            return run.record(name, "skipped", 0, self.skip_reason)
        if run.dry:
            missing = [t for t in targets if self.targets is not None and t not in self.targets]
            cmd = ["sh", "-c", 'echo "dry run: not built; target(s) %s exist"' % " ".join(targets)] if not missing \
                else ["sh", "-c", 'echo "target(s) %s missing from the GPU configuration" >&2; exit 1'
                      % " ".join(missing)]
            return run.piece(name, cmd, 30, min_s=1, log="build.log", needs=needs)[0]
        return run.piece(name, ["cmake", "--build", self.build_dir(), "-j", str(run.jobs), "--target"] + list(targets),
                         timeout, min_s=min_s, log="build.log", needs=needs)[0]

    def library_piece(self):
        libs = ["twobp_core", "twobp_kit"] + (["twobp_nccl"] if self.targets and "twobp_nccl" in self.targets else [])
        self.build_piece("build:library", libs, 360, min_s=30)

    # ---- the binaries ----
    def needs(self, target):
        """What a piece running target's binary needs: its build on the GPU machine, nothing in the dry run (which
        runs the CPU build's)."""
        return () if self.run.dry else ("build:" + target,)

    def bench_binary(self):
        if self.prebuilt:
            return os.path.join(self.prebuilt_dir, self.prebuilt["bench"])
        return os.path.join(self.run.cpu_build if self.run.dry else self.build_dir(), "benchmarks", "twobp_bench")

    def example_binary(self):
        if self.prebuilt and self.prebuilt.get("example"):
            return os.path.join(self.prebuilt_dir, self.prebuilt["example"])
        return os.path.join(self.run.cpu_build if self.run.dry else self.build_dir(), "examples", "llama_pipeline")

    def missing(self, exe, target):
        """Why pieces running exe are skipped (the dry run without the CPU build's target), or None."""
        if self.run.dry and not os.access(exe, os.X_OK):
            return "%s is missing: build %s in GPU_CHECK_CPU_BUILD first" % (exe, target)
        return None

    def test_binary(self, t):
        """The binary that runs: the GPU build's, or in the dry run the CPU build's of the same name and place."""
        if self.prebuilt:
            return t["binary"]
        run = self.run
        build = run.cpu_build if run.dry else self.build_dir()
        exe = os.path.join(build, os.path.relpath(t["binary"], self.build_dir())) if run.dry else t["binary"]
        if not os.access(exe, os.X_OK):  # not where ctest said (not built yet at discovery): look for it by name
            for base, dirs, files in os.walk(build):
                dirs[:] = [d for d in dirs if d != "CMakeFiles" and not d.startswith("_")]
                if t["name"] in files and os.access(os.path.join(base, t["name"]), os.X_OK):
                    return os.path.join(base, t["name"])
        return exe

    def summary(self):
        out = {"build_dir": self.dir or "none (the dry run configured nothing)"}
        if self.run.dry:
            out["cpu_build"] = self.run.cpu_build
        return out
