#!/usr/bin/env python3
"""twobp_bench simulate --w-batched K MS: every W is priced fixed + k x per micro-batch, the line through one
micro-batch's W (--w) and K's (MS). With W(1) = 8 and W(4) = 20 ms that is 4 + 4 k: the schedules that batch W
(gpipe's one W of all micro-batches with 2BP) get faster, those whose W's run one micro-batch at a time (zb-h1)
do not move, and standard forms (B = I + a W of one micro-batch) do not either.

Usage: check_w_batched.py TWOBP_BENCH WORK_DIR
"""
import os
import sys

import simulate_steps


def simulate(bench, path, extra):
    return simulate_steps.simulate(bench, path, ["--ranks", "4", "--microbatches", "8", "--f", "10", "--i", "12",
                                                 "--w", "8", *extra])


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    _, per_micro_batch = simulate(bench, os.path.join(work, "w.json"), [])
    doc, batched = simulate(bench, os.path.join(work, "w_batched.json"), ["--w-batched", "4", "20"])
    costs = doc["config"]["costs_ms_per_rank"]
    assert abs(costs["W0"] - 4.0) < 1e-9 and abs(costs["W"] - 4.0) < 1e-9, costs
    assert batched[("gpipe", "2bp")] < per_micro_batch[("gpipe", "2bp")] - 1.0, (batched, per_micro_batch)
    for key in [("zb-h1", "2bp")] + [k for k in batched if k[1] == "standard"]:
        assert abs(batched[key] - per_micro_batch[key]) < 1e-9, (key, batched[key], per_micro_batch[key])
    # Batching not cheaper (W(4) = 4 W(1)): no fixed part, W as given.
    doc, same = simulate(bench, os.path.join(work, "w_proportional.json"), ["--w-batched", "4", "32"])
    assert "W0" not in doc["config"]["costs_ms_per_rank"], doc["config"]
    assert same == per_micro_batch, "proportional W changed the simulation"
    print(f"--w-batched: gpipe 2BP {per_micro_batch[('gpipe', '2bp')]:.1f} -> {batched[('gpipe', '2bp')]:.1f} ms, "
          "zb-h1 and the standard forms unchanged; proportional W unchanged")


if __name__ == "__main__":
    main()
