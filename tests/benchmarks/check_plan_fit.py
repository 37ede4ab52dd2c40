#!/usr/bin/env python3
"""The planner's measured cost model through its command line (twobp/plan/llama.h behind `twobp_bench plan`).

usage: check_plan_fit.py TWOBP_BENCH WORK_DIR

Writes `twobp_bench pipeline` JSONs whose per-chunk costs are exactly affine in what each chunk holds,
    X(chunk) = a + b * blocks + e * [embedding] + h * [head]      for X in F, I, W, B,
and checks that `twobp_bench plan --costs-json` (config.cost_model of its JSON)
  - recovers a, b, e, h of every X from results with two chunk shapes (4 blocks on p = 2: v = 1 gives chunks of
    2 blocks, v = 2 chunks of 1), whatever the schedules that measured them;
  - falls back to FLOP shares (kind "flop_shares") from results with one chunk shape, F still summing to what
    was measured;
  - carries the fit to another micro-batch size (b, e, h scale with it, a does not);
  - predicts from them what the simulator predicts from the measured costs themselves (`twobp_bench simulate
    --from-json` of the same result, whose stages keep their measured costs);
  - with a fixed W part (costs_ms.W0: W0 + k W for a W of k micro-batches), fits W0's terms apart from W's, so that
    1F1B's batched 2BP tail is planned as the simulator charges it from the measured costs;
  - with a result that names its partition (llama_pipeline --costs-json of a --partition run), fits its chunks as
    cut by that partition;
  - with results whose overlapped F&B pairs ran at once ("overlap": {"share", "pairs"}), plans at their share
    weighted by pairs (config.cost_model.overlap), DualPipeV as the simulator predicts it from such a result, and
    --overlap replaces the share (0: the same plan as results without pairs at once).
"""

import json
import math
import os
import subprocess
import sys

BENCH, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)

TERMS = {  # a, b, e, h (ms)
    "F": (0.5, 2.0, 0.3, 1.2),
    "I": (0.4, 2.5, 0.2, 0.9),
    "W": (0.1, 1.5, 0.6, 0.7),
    "B": (0.8, 4.2, 0.5, 1.9),
}
# The balanced partition of 4 blocks (twobp::models::make_partition; the head is a quarter of a block here):
# (blocks, has_embedding, has_head) per chunk.
CHUNKS = {1: [(2, 1, 0), (2, 0, 1)], 2: [(1, 1, 0), (1, 0, 0), (1, 0, 0), (1, 0, 1)]}
CONFIG = {"model": "llama", "dim": 96, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 256,
          "seq": 32, "micro_batch_size": 2}
problems = []


def cost(terms, chunk):
    a, b, e, h = terms
    blocks, emb, head = chunk
    return a + b * blocks + e * emb + h * head


def result(schedule, mode, v, terms=TERMS):
    chunks = CHUNKS[v]
    zeros = [0.0] * len(chunks)
    costs = {k: [cost(terms[k], c) for c in chunks] for k in "FIWB"}
    if mode == "2bp":
        costs["B"] = zeros
    else:
        costs["I"] = costs["W"] = zeros
    return {"schedule": schedule, "mode": mode, "p": 2, "m": 4, "v": v, "communication_ms": 0.1, "costs_ms": costs}


def plan(name, results, mbs=2, extra=()):
    costs = os.path.join(WORK, name + "_costs.json")
    out = os.path.join(WORK, name + "_plan.json")
    with open(costs, "w") as f:
        json.dump({"config": CONFIG, "results": results}, f)
    run = subprocess.run([BENCH, "plan", "--costs-json", costs, "--ranks", "2", "--global-batch", "8",
                          "--micro-batch-size", str(mbs), "--precision", "fp32", "--recompute", "off",
                          "--max-dp", "1", "--json", out, *extra], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"twobp_bench plan --costs-json {costs} failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    with open(out) as f:
        return json.load(f)


def expect_terms(doc, want, what):
    model = doc["config"]["cost_model"]
    for k, terms in want.items():
        got = model[k]
        for name, w in zip(("per_action", "per_block", "embedding", "head"), terms):
            if not math.isclose(got[name], w, rel_tol=1e-6, abs_tol=1e-9):
                problems.append(f"{what}: {k}.{name} = {got[name]}, expected {w}")


two = [result("1f1b", "standard", 1), result("1f1b", "2bp", 1), result("zb-v", "standard", 2),
       result("interleaved-1f1b", "2bp", 2)]
fitted = plan("two_shapes", two)
if fitted["config"]["cost_model"]["kind"] != "fitted":
    problems.append(f"two chunk shapes: kind {fitted['config']['cost_model']['kind']}, expected fitted")
expect_terms(fitted, TERMS, "two chunk shapes")

# Without a standard result B = I + W.
no_standard = plan("no_standard", [result("1f1b", "2bp", 1), result("interleaved-1f1b", "2bp", 2)])
expect_terms(no_standard, {"B": tuple(i + w for i, w in zip(TERMS["I"], TERMS["W"]))}, "no standard result")

# Twice the micro-batch size: the per-action term stays, the others double.
doubled = plan("mbs4", two, mbs=4)
expect_terms(doubled, {k: (t[0], 2 * t[1], 2 * t[2], 2 * t[3]) for k, t in TERMS.items()}, "micro-batch size 4")

# One chunk shape: FLOP shares, F's total kept (b · Σ(blocks + head share) = Σ F measured), no per-action term.
one = plan("one_shape", [result("1f1b", "standard", 1), result("1f1b", "2bp", 1)])
model = one["config"]["cost_model"]
if model["kind"] != "flop_shares":
    problems.append(f"one chunk shape: kind {model['kind']}, expected flop_shares")
f = model["F"]
measured_f = sum(cost(TERMS["F"], c) for c in CHUNKS[1])
modelled_f = sum(f["per_action"] + f["per_block"] * b + f["embedding"] * e + f["head"] * h for b, e, h in CHUNKS[1])
if f["per_action"] != 0 or f["embedding"] != 0 or not math.isclose(modelled_f, measured_f, rel_tol=1e-9):
    problems.append(f"one chunk shape: F {f} sums to {modelled_f} per step of chunks, measured {measured_f}")


def expect_simulated(name, doc, index, schedule, v):
    """The plan's 2BP prediction for `schedule` equals the simulator's from result `index` of `name`'s costs."""
    sim_out = os.path.join(WORK, f"{name}_simulate.json")
    run = subprocess.run([BENCH, "simulate", "--from-json", os.path.join(WORK, f"{name}_costs.json"), "--result",
                          str(index), "--ranks", "2", "--microbatches", "4", "--chunks-per-rank", str(v),
                          "--schedule", schedule, "--json", sim_out], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"twobp_bench simulate failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    with open(sim_out) as f:
        sim = [r for r in json.load(f)["results"] if r["mode"] == "2bp"]
    planned = [c for c in doc["candidates"] if c["schedule"] == schedule and c["mode"] == "2bp"]
    if len(sim) != 1 or len(planned) != 1 or planned[0]["m"] != 4:
        problems.append(f"{name}: expected one {schedule} 2bp row at m = 4 from simulate ({len(sim)}) and plan")
    elif not math.isclose(planned[0]["sim_step_ms"], sim[0]["sim_step_ms"], rel_tol=1e-6):
        problems.append(f"{name}: {schedule} 2bp: plan predicts {planned[0]['sim_step_ms']} ms, the simulator "
                        f"{sim[0]['sim_step_ms']} ms from the measured costs")


# The prediction of a candidate that was measured equals the simulator's from its measured costs.
expect_simulated("two_shapes", fitted, 3, "interleaved-1f1b", 2)

# A fixed W part in the 2BP results: fitted as its own terms, W's unchanged, and 1F1B 2BP -- whose tail runs one W
# of all 4 micro-batches per stage -- planned at W0 + 4 W, as the simulator charges it.
W0_TERMS = (0.3, 0.25, 0.05, 0.15)


def with_fixed_w(r):
    if r["mode"] == "2bp":
        r["costs_ms"]["W0"] = [cost(W0_TERMS, c) for c in CHUNKS[r["v"]]]
    return r


fixed = plan("fixed_w", [with_fixed_w(r) for r in two])
expect_terms(fixed, {"W": TERMS["W"], "W0": W0_TERMS}, "fixed W part")
expect_simulated("fixed_w", fixed, 1, "1f1b", 1)
if "W0" in fitted["config"]["cost_model"]:
    problems.append(f"no W0 measured, yet the plan has {fitted['config']['cost_model']['W0']}")

# Pairs run at once: a dualpipev 2BP result whose 6 pairs hid 0.5 of their shorter parts. DualPipeV's 2BP form
# runs fused B's too (in its pairs), so its result measured B as well.
def with_pairs(r, share, pairs):
    r["costs_ms"]["B"] = [cost(TERMS["B"], c) for c in CHUNKS[r["v"]]]
    r["overlap"] = {"share": share, "pairs": pairs}
    return r


def overlap_of(doc):
    return doc["config"]["cost_model"].get("overlap")


def dualpipev_2bp_ms(doc):
    return [c["sim_step_ms"] for c in doc["candidates"] if c["schedule"] == "dualpipev" and c["mode"] == "2bp"]


# (fresh results: with_fixed_w above gave `two`'s 2BP result a W0)
base = [result("1f1b", "standard", 1), result("1f1b", "2bp", 1), result("zb-v", "standard", 2)]
at_once = base + [with_pairs(result("dualpipev", "2bp", 2), 0.5, 6)]
paired = plan("pairs", at_once)
if overlap_of(paired) != 0.5:
    problems.append(f"one result with pairs at 0.5: the plan's overlap is {overlap_of(paired)}")
expect_simulated("pairs", paired, 3, "dualpipev", 2)
weighted = plan("pairs_weighted", at_once + [with_pairs(result("dualpipev", "2bp", 2), 0.25, 2)])
if not math.isclose(overlap_of(weighted) or -1, (0.5 * 6 + 0.25 * 2) / 8, rel_tol=1e-12):
    problems.append(f"shares 0.5 over 6 pairs and 0.25 over 2: the plan's overlap is {overlap_of(weighted)}")
in_order = plan("pairs_in_order", at_once, extra=("--overlap", "0"))
in_order_result = with_pairs(result("dualpipev", "2bp", 2), 0.5, 6)
del in_order_result["overlap"]
no_pairs = plan("no_pairs", base + [in_order_result])
if overlap_of(in_order) != 0 or overlap_of(no_pairs) != 0:
    problems.append(f"--overlap 0 / no pairs at once: overlap {overlap_of(in_order)} / {overlap_of(no_pairs)}")
if dualpipev_2bp_ms(in_order) != dualpipev_2bp_ms(no_pairs) or dualpipev_2bp_ms(in_order) == dualpipev_2bp_ms(paired):
    problems.append(f"dualpipev 2bp: {dualpipev_2bp_ms(in_order)} ms with --overlap 0, {dualpipev_2bp_ms(no_pairs)} "
                    f"without pairs at once, {dualpipev_2bp_ms(paired)} at 0.5")

# A result that names its partition: its chunks are that partition's (3 blocks with the embedding, 1 with the head),
# so the same terms come back only when the plan cuts the model as the result says.
uneven = result("1f1b", "2bp", 1)
uneven["partition"] = "3,1"
uneven["costs_ms"] = {k: [cost(TERMS[k], c) for c in [(3, 1, 0), (1, 0, 1)]] for k in "FIW"}
uneven["costs_ms"]["B"] = [0.0, 0.0]
named = plan("named_partition", [uneven, result("interleaved-1f1b", "2bp", 2), result("1f1b", "standard", 1),
                                  result("zb-v", "standard", 2)])
expect_terms(named, {k: TERMS[k] for k in "FIW"}, "a result naming its partition")

# A measured model's command line gives its sizes (no preset has them).
if "--dim 96 --layers 4 --heads 4 --kv-heads 2 --ffn 256 --vocab 256" not in fitted["best"]["command"]:
    problems.append(f"the best candidate's command does not give the model's sizes: {fitted['best']['command']}")

if problems:
    sys.exit("planner cost model:\n  " + "\n  ".join(problems))
print(f"planner cost model: fitted F {fitted['config']['cost_model']['F']}; best {fitted['best']['command']}")
