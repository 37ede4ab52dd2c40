"""Writes the compute_only CSVs of PyTorch's multi-stage pipeline schedules (torch.distributed.pipelining) into
this folder, as PipelineScheduleMulti._dump_csv(format="compute_only") would: one row per rank.

Usage: python generate.py [OUTDIR]   (default: this folder; needs `import torch`)

The schedules are built with stand-in stages (the attributes their constructors read) on one process: their
action lists do not depend on a process group. pytorch_csv_test loads every file, validates it and trains with it
(float64 parity); the ctest `pytorch_csv_current` regenerates them with the installed torch and compares."""
import csv
import os
import sys
import types

import torch
from torch.distributed.pipelining import schedules as S

# (class, ranks, micro-batches): V-shaped classes place 2 stages per rank (s and 2p-1-s), the others v = 2 looped.
CASES = [
    ("ScheduleInterleaved1F1B", 2, 4), ("ScheduleInterleaved1F1B", 4, 8),
    ("ScheduleLoopedBFS", 2, 4), ("ScheduleLoopedBFS", 4, 6),
    ("ScheduleInterleavedZeroBubble", 2, 4), ("ScheduleInterleavedZeroBubble", 4, 8),
    ("ScheduleZBVZeroBubble", 2, 4), ("ScheduleZBVZeroBubble", 4, 8),
    ("ScheduleDualPipeV", 2, 4), ("ScheduleDualPipeV", 4, 8),
]
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def stages(name, p, rank):
    ids = [rank, 2 * p - 1 - rank] if name in V_SHAPED else [rank, rank + p]
    return [types.SimpleNamespace(stage_index=s, num_stages=2 * p, group_size=p, group_rank=rank,
                                  is_first=s == 0, is_last=s == 2 * p - 1, submod=torch.nn.Module())
            for s in ids]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(out, exist_ok=True)
    for name, p, m in CASES:
        schedule = getattr(S, name)(stages(name, p, 0), m, loss_fn=lambda output, target: output)
        path = os.path.join(out, "%s_p%d_m%d.csv" % (name, p, m))
        with open(path, "w", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            for rank in sorted(schedule.pipeline_order):
                writer.writerow(schedule.pipeline_order[rank])
    print("torch %s: %d schedules written to %s" % (torch.__version__, len(CASES), out))


if __name__ == "__main__":
    main()
