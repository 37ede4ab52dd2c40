"""What travels to the GPU machine besides the tree, made HERE: .third_party/ (what the GPU image lacks: GoogleTest
sources, CLI11 and nlohmann/json headers; `gpu_check.sh prepare`) and .gpu-prebuilt/ (the GPU configuration's
binaries, built here, with a manifest of the sources' digest; `gpu_check.sh prebuild`). Also the one definition of
the GPU configuration (configure_args), so that carried binaries are built as the GPU machine would build them."""

import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

from .util import ROOT, dir_bytes, write_json

THIRD_PARTY = os.path.join(ROOT, ".third_party")
THIRD_PARTY_MAX_MIB = 48   # with the tree, under the device's 64 MiB carry limit
PREBUILT = os.path.join(ROOT, ".gpu-prebuilt")   # `prebuild`: GPU binaries built here, carried (git-ignored)
PREBUILT_MAX_MIB = 24      # with .third_party and the tree, under the 64 MiB carry limit
PREBUILT_BUILD = os.path.join(ROOT, "build-gpu-carry")
# What the binaries are built from: the carried ones are used only when these hash the same there as here.
DIGEST_PATHS = ("CMakeLists.txt", "cmake", "include", "src", "tests", "benchmarks", "examples")


def configure_args(build, torch_root, torch_python, path=None):
    """The GPU configuration (no MPI, GoogleTest/CLI11/json from .third_party), one place for the GPU
    machine, the dry run and `prebuild`, so that carried binaries are built as the GPU machine would build them."""
    args = ["cmake", "-S", ROOT, "-B", build]
    if shutil.which("ninja", path=path):
        args += ["-G", "Ninja"]
    args += ["-DCMAKE_BUILD_TYPE=Release", "-DTWOBP_WITH_MPI=OFF", "-DTWOBP_BUILD_EXAMPLES=ON",
             "-DTWOBP_GTEST_SOURCE_DIR=%s/.third_party/googletest" % ROOT,
             "-DTWOBP_THIRD_PARTY_INCLUDE_DIR=%s/.third_party/include" % ROOT]
    if torch_root:
        args.append("-DCMAKE_PREFIX_PATH=%s/share/cmake" % torch_root)
    if torch_python:
        args.append("-DPython3_EXECUTABLE=%s" % torch_python)
    if os.path.isdir("/usr/local/cuda"):
        args.append("-DCUDAToolkit_ROOT=/usr/local/cuda")
    return args


def gpu_tests_from_ctest(text, build):
    """The tests of `ctest -L gpu --show-only=json-v1` output: name, binary, mpi (launched by mpiexec), timeout."""
    j = json.loads(text[text.index("{"):text.rindex("}") + 1])
    found = []
    for t in j.get("tests", []):
        props = {p["name"]: p.get("value") for p in t.get("properties", [])}
        cmd = t.get("command") or []
        workdir = props.get("WORKING_DIRECTORY") or build
        exe = cmd[0] if cmd else os.path.join(workdir, t["name"])
        mpi = bool(cmd) and re.search(r"(mpiexec|mpirun|srun|orterun)$", os.path.basename(cmd[0]))
        mpi = mpi or (not cmd and re.search(r"_np\d+$", t["name"]))
        found.append({"name": t["name"], "binary": exe, "mpi": bool(mpi),
                      "timeout": float(props.get("TIMEOUT") or 600)})
    return found


def torch_version(torch_root):
    """The torch package's version string, read from its version.py (without importing torch)."""
    for line in open(os.path.join(torch_root, "version.py")):
        m = re.match(r"^__version__\b[^=]*=\s*['\"]([^'\"]*)", line)
        if m:
            return m.group(1)
    return ""


def torch_lib_dirs(torch_root):
    """torch's lib/ and the CUDA, NCCL, cuDNN... libraries of the pip packages beside it (site-packages/nvidia)."""
    dirs = [os.path.join(torch_root, "lib")]
    nvidia = os.path.join(os.path.dirname(torch_root), "nvidia")
    if os.path.isdir(nvidia):
        dirs += sorted(os.path.join(nvidia, d, "lib") for d in os.listdir(nvidia)
                       if os.path.isdir(os.path.join(nvidia, d, "lib")))
    return dirs


def torch_root_from_cache(build):
    """The torch package directory a CPU build used (when no Python can tell: a CPU-only install)."""
    try:
        for line in open(os.path.join(build, "CMakeCache.txt")):
            if line.startswith("Torch_DIR:") or line.startswith("TORCH_LIBRARY:"):
                value = line.split("=", 1)[1].strip()
                m = re.match(r"^(.*/torch)/(share/cmake/Torch|lib/libtorch\.so)$", value)
                if m:
                    return m.group(1)
    except OSError:
        pass
    return None


def source_digest():
    """sha256 over the files the binaries are built from (DIGEST_PATHS): equal on the GPU machine's copy of the
    tree exactly when the carried binaries are of these sources."""
    import hashlib
    h = hashlib.sha256()
    for top in DIGEST_PATHS:
        full = os.path.join(ROOT, top)
        files = [full] if os.path.isfile(full) else []
        for base, dirs, names in os.walk(full):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(base, n) for n in sorted(names) if not n.endswith((".pyc", ".swp"))]
        for f in files:
            h.update(os.path.relpath(f, ROOT).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def git_exclude(entry):
    """Adds entry to the checkout's info/exclude once (git-ignored locally; right in a worktree too)."""
    try:
        exclude = subprocess.run(["git", "-C", ROOT, "rev-parse", "--git-path", "info/exclude"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        exclude = os.path.join(ROOT, exclude)
        os.makedirs(os.path.dirname(exclude), exist_ok=True)
        lines = open(exclude).read().splitlines() if os.path.exists(exclude) else []
        if entry not in lines:
            with open(exclude, "a") as f:
                f.write(entry + "\n")
    except (OSError, subprocess.SubprocessError):
        pass


def third_party_complete(tp=THIRD_PARTY):
    return (os.path.isdir(os.path.join(tp, "googletest")) and os.path.isfile(os.path.join(tp, "include/CLI/CLI.hpp"))
            and os.path.isfile(os.path.join(tp, "include/nlohmann/json.hpp")))


def prepare(quiet=False, force=False):
    """Copies what the GPU image lacks into .third_party/ (git-ignored): GoogleTest's sources, CLI11's and
    nlohmann/json's headers. Atomic (built aside, then renamed) and locked, so two dry runs at once are safe."""
    import fcntl
    import hashlib
    tp = THIRD_PARTY
    lock_path = os.path.join(tempfile.gettempdir(), "gpu_check_prepare.%s.lock"
                             % hashlib.sha1(ROOT.encode()).hexdigest()[:12])
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and third_party_complete(tp):
            return
        sources = {"googletest": "/usr/src/googletest", "include/CLI": "/usr/include/CLI",
                   "include/nlohmann": "/usr/include/nlohmann"}
        missing = [s for s in sources.values() if not os.path.isdir(s)]
        if missing:
            raise RuntimeError("cannot prepare .third_party: missing %s (install libgtest-dev, libcli11-dev, "
                               "nlohmann-json3-dev)" % ", ".join(missing))
        work = tempfile.mkdtemp(prefix=".third_party.new.", dir=ROOT)
        try:
            for dest, src in sources.items():
                shutil.copytree(src, os.path.join(work, dest), symlinks=False)
            old = None
            if os.path.exists(tp):
                old = tp + ".old.%d" % os.getpid()
                os.rename(tp, old)
            os.rename(work, tp)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        git_exclude("/.third_party/")
    if not quiet:
        print("gpu_check: .third_party prepared: %.1f MiB" % (dir_bytes(tp) / 2**20))


def prebuild():
    """HERE: builds the GPU configuration's twobp_bench, llama_pipeline and gpu tests (the CUDA build of the torch
    wheel compiles and links GPU code without a GPU) into build-gpu-carry and copies them, with a manifest, into
    .gpu-prebuilt/ to carry: the GPU machine then skips its build (minutes of the loan) when they are of the same
    sources and load there. Returns the exit status."""
    prepare(quiet=True)
    py = os.environ.get("GPU_CHECK_TORCH_PYTHON", "")
    if not py:
        print("gpu_check prebuild: no Python with torch found (set PYTHON)", file=sys.stderr)
        return 1
    probe = "import importlib.util as u, os; print(os.path.dirname(u.find_spec('torch').origin))"
    torch_root = subprocess.run([py, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    version = torch_version(torch_root)
    digest = source_digest()
    jobs = str(int(os.environ.get("JOBS") or os.cpu_count() or 2))
    configure = configure_args(PREBUILT_BUILD, torch_root, py)
    subprocess.run(configure, check=True)
    show = subprocess.run(["ctest", "--test-dir", PREBUILT_BUILD, "-L", "gpu", "--show-only=json-v1"],
                          capture_output=True, text=True, check=True).stdout
    tests = [t for t in gpu_tests_from_ctest(show, PREBUILT_BUILD) if not t["mpi"]]
    targets = ["twobp_bench", "llama_pipeline"] + [t["name"] for t in tests]
    subprocess.run(["cmake", "--build", PREBUILT_BUILD, "-j", jobs, "--target"] + targets, check=True)
    if source_digest() != digest:
        print("gpu_check prebuild: the sources changed during the build; run it again", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix=".gpu-prebuilt.new.", dir=ROOT)
    try:
        shutil.copy2(os.path.join(PREBUILT_BUILD, "benchmarks", "twobp_bench"), os.path.join(work, "twobp_bench"))
        shutil.copy2(os.path.join(PREBUILT_BUILD, "examples", "llama_pipeline"),
                     os.path.join(work, "llama_pipeline"))
        for t in tests:
            shutil.copy2(t["binary"], os.path.join(work, t["name"]))
        manifest = {"digest": digest, "torch": version, "targets": targets, "bench": "twobp_bench",
                    "example": "llama_pipeline", "tests": [dict(t, binary=t["name"]) for t in tests],
                    "built_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                    "built_on": socket.gethostname(), "configure": configure}
        write_json(os.path.join(work, "manifest.json"), manifest)
        size = dir_bytes(work) / 2**20
        if size > PREBUILT_MAX_MIB:
            print("gpu_check prebuild: %.1f MiB, over %d MiB" % (size, PREBUILT_MAX_MIB), file=sys.stderr)
            return 1
        shutil.rmtree(PREBUILT, ignore_errors=True)
        os.rename(work, PREBUILT)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    git_exclude("/.gpu-prebuilt/")
    print("gpu_check prebuild: %s in %s (%.1f MiB, torch %s, sources %s): carry .gpu-prebuilt and .third_party"
          % (", ".join(targets), PREBUILT, dir_bytes(PREBUILT) / 2**20, version, digest[:12]))
    return 0
