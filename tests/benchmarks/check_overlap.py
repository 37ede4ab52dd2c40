#!/usr/bin/env python3
"""twobp_bench simulate --overlap S: dualpipev's overlapped F&B pairs run at once, hiding the share S of a pair's
shorter part (twobp::CostModel::overlap). Fully hidden (S = 1) dualpipev gets faster in both modes, schedules
without pairs (zb-v) do not move, and the config records S. From a `pipeline` JSON whose result measured pairs
run at once ("overlap": {"share", "pairs"}), the measured share is used unless --overlap replaces it.

Usage: check_overlap.py TWOBP_BENCH WORK_DIR
"""
import json
import os
import sys

from simulate_steps import simulate


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    shape = ["--ranks", "4", "--microbatches", "16"]
    doc, in_order = simulate(bench, os.path.join(work, "in_order.json"), shape)
    assert "overlap" not in doc["config"], doc["config"]
    doc, at_once = simulate(bench, os.path.join(work, "at_once.json"), shape + ["--overlap", "1"])
    assert doc["config"]["overlap"] == 1, doc["config"]
    for mode in ("standard", "2bp"):
        assert at_once[("dualpipev", mode)] < in_order[("dualpipev", mode)] - 1.0, (mode, at_once, in_order)
        assert at_once[("zb-v", mode)] == in_order[("zb-v", mode)], (mode, at_once, in_order)

    # A measured run whose pairs ran at once: its share is the simulator's.
    measured = os.path.join(work, "measured.json")
    with open(measured, "w") as f:
        json.dump({"results": [{"schedule": "dualpipev", "mode": "2bp", "p": 2, "m": 4, "v": 2,
                                "communication_ms": 0.0,
                                "costs_ms": {"F": [1, 1.5, 1, 2], "I": [1, 1, 1.25, 1], "W": [1, 1, 1, 0.5],
                                             "B": [2, 0, 0, 0]},
                                "overlap": {"share": 0.5, "pairs": 6}}]}, f)
    pair_shape = ["--ranks", "2", "--microbatches", "4", "--from-json", measured]
    doc, from_run = simulate(bench, os.path.join(work, "from_run.json"), pair_shape)
    assert doc["config"]["overlap"] == 0.5, doc["config"]
    _, given = simulate(bench, os.path.join(work, "given.json"), pair_shape + ["--overlap", "0.5"])
    _, none = simulate(bench, os.path.join(work, "none.json"), pair_shape + ["--overlap", "0"])
    assert from_run == given, (from_run, given)
    assert from_run[("dualpipev", "2bp")] != none[("dualpipev", "2bp")], (from_run, none)
    print(f"--overlap 1: dualpipev 2BP {in_order[('dualpipev', '2bp')]:.2f} -> {at_once[('dualpipev', '2bp')]:.2f} "
          f"ms, zb-v unchanged; a measured share of 0.5 is used ({from_run[('dualpipev', '2bp')]:.2f} ms, in order "
          f"{none[('dualpipev', '2bp')]:.2f})")


if __name__ == "__main__":
    main()
