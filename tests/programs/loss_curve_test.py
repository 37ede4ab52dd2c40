#!/usr/bin/env python3
"""scripts/loss_curve.py on a real llama_pipeline JSON: one point per step, one marker per evaluation, the title
from the run; a JSON that is not a training run and an unwritable output are refused.

Usage: loss_curve_test.py LLAMA_PIPELINE WORK_DIR
"""
import os
import re
import sys

from program_runs import run

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "loss_curve.py")


def main():
    example, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    run_json, svg = os.path.join(work, "run.json"), os.path.join(work, "loss.svg")
    run([example, "--steps", "6", "--eval-every", "3", "--seq-len", "16", "--microbatches", "2",
         "--micro-batch-size", "1", "--no-2bp", "--json", run_json])
    run([sys.executable, SCRIPT, run_json, svg], must_say="6 steps")
    text = open(svg).read()
    points = re.search(r'<polyline id="train" points="([^"]*)"', text).group(1).split()
    assert len(points) == 6, f"{len(points)} points for 6 steps"
    assert text.count('class="eval"') == 2, "expected 2 evaluations (steps 3 and 6)"
    assert "tiny 1f1b standard: loss over 6 steps" in text, "title"
    bad = os.path.join(work, "bad.json")
    with open(bad, "w") as f:
        f.write('{"results": []}')
    run([sys.executable, SCRIPT, bad, svg], ok=False, must_say="no \"steps\"")
    run([sys.executable, SCRIPT, run_json, "/proc/twobp-nonexistent/loss.svg"], ok=False, must_say="cannot write")
    print("loss_curve.py: 6 steps and 2 evaluations drawn; 2 bad inputs refused")


if __name__ == "__main__":
    main()
