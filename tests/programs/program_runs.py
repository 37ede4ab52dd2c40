"""What the program tests here share: run a command and fail the test, with its output, when it ends otherwise
than expected."""
import subprocess
import sys

# mpiexec's flags for the programs' tests on this 2-core machine as root (Open MPI): shared memory, 4 ranks on 2 cores.
MPI_FLAGS = ["--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader", "--mca",
             "btl_vader_single_copy_mechanism", "none"]


def run(cmd, ok=True, must_say=None, timeout=300):
    """Runs `cmd`; exits the test when its status is not as `ok` says, or its output lacks `must_say`. Returns the
    output (stdout, then stderr)."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if ok != (p.returncode == 0) or (must_say and must_say not in out):
        sys.exit(f"FAILED (status {p.returncode}, expected {'0' if ok else 'non-zero'}"
                 f"{', saying ' + repr(must_say) if must_say else ''}): {' '.join(cmd)}\n{out}")
    return out
