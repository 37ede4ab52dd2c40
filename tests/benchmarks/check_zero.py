#!/usr/bin/env python3
"""twobp_bench zero: every rank of ZeRO 0, 1 and 2 reports its parameter, gradient-peak, master, optimizer-state and
data-parallel bytes (byte counts, never a timing), and the summary ratios hold what ZeRO-2 promises where W finishes
each bucket once per step (gpipe 2BP): gradient peak + masters + optimizer state <= 0.55 x ZeRO 0's, data-parallel
bytes per step <= ZeRO 1's.

Usage: check_zero.py TWOBP_BENCH WORK_DIR
"""
import json
import os
import subprocess
import sys

FIELDS = ["zero", "world_rank", "replica", "pipeline_rank", "parameter_bytes", "gradient_peak_bytes", "master_bytes",
          "optimizer_state_bytes", "sharded_bytes", "dp_bytes_sent"]


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "zero.json")
    subprocess.run([bench, "zero", "--dp", "2", "--pp", "2", "--schedule", "gpipe", "--mode", "2bp", "--json", out],
                   check=True)
    with open(out) as f:
        doc = json.load(f)
    rows = doc["results"]
    assert sorted({r["zero"] for r in rows}) == ["0", "1", "2"], rows
    assert len(rows) == 12, len(rows)
    for r in rows:
        missing = [k for k in FIELDS if k not in r]
        assert not missing, (missing, r)
        assert not any("ms" in k or "time" in k for k in r), r
        assert r["parameter_bytes"] > 0 and r["gradient_peak_bytes"] > 0 and r["optimizer_state_bytes"] > 0, r
        assert r["sharded_bytes"] == r["gradient_peak_bytes"] + r["master_bytes"] + r["optimizer_state_bytes"], r
    ratios = doc["ratios"]
    assert ratios["zero2_over_zero0_sharded_bytes"] <= 0.55, ratios
    assert ratios["zero2_over_zero1_dp_bytes_sent"] <= 1.0, ratios
    print("zero ratios:", ratios)


if __name__ == "__main__":
    main()
