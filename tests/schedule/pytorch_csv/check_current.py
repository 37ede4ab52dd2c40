"""Regenerates PyTorch's schedule CSVs with the installed torch (generate.py) into a scratch folder and compares
them with the committed ones, so that a torch upgrade that changes a schedule shows. Exits 77 (ctest: skipped)
when this Python cannot import torch.distributed.pipelining (the CPU-only setup's torch has no Python side).

Usage: python check_current.py SCRATCH_DIR"""
import filecmp
import os
import shutil
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
try:
    import torch.distributed.pipelining  # noqa: F401
except Exception as e:  # ImportError, or a torch whose native side does not load
    print("skipped: cannot import torch.distributed.pipelining: %r" % e)
    sys.exit(77)
scratch = sys.argv[1]
shutil.rmtree(scratch, ignore_errors=True)
subprocess.run([sys.executable, "-W", "ignore", os.path.join(here, "generate.py"), scratch], check=True)
committed = sorted(f for f in os.listdir(here) if f.endswith(".csv"))
fresh = sorted(f for f in os.listdir(scratch) if f.endswith(".csv"))
if committed != fresh:
    sys.exit("the installed torch writes %s, the folder holds %s" % (fresh, committed))
for f in committed:
    if not filecmp.cmp(os.path.join(here, f), os.path.join(scratch, f), shallow=False):
        sys.exit("%s: the installed torch writes another schedule:\n%s\ncommitted:\n%s\nrerun generate.py if intended"
                 % (f, open(os.path.join(scratch, f)).read(), open(os.path.join(here, f)).read()))
print("%d schedules as committed" % len(committed))
