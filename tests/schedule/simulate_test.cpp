#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "twobp/error.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/simulate.h"
#include "twobp/schedule/text.h"

namespace twobp {
namespace {

Schedule make(const std::string& name, int p, int m, BackwardMode mode, int v = 1) {
  return make_schedule(name, ScheduleOptions{p, m, v, mode});
}

// F = 1 and B = 1 (B given directly for the fused form).
CostModel fb_costs(int stages, double f, double b) {
  CostModel c = CostModel::uniform(stages, f, b / 2, b / 2);
  c.backward.assign(stages, b);
  return c;
}

TEST(Simulate, TextbookBubbleGpipeAnd1f1b) {
  for (const char* name : {"gpipe", "1f1b"}) {
    for (int p : {1, 2, 3, 4, 8}) {
      for (int m : {1, 2, 4, 8, 16}) {
        const Schedule sc = make(name, p, m, BackwardMode::kStandard);
        const auto sim = simulate(sc, fb_costs(sc.num_stages, 1.0, 1.0));
        EXPECT_NEAR(sim.bubble_fraction, double(p - 1) / (m + p - 1), 1e-9) << name << " p=" << p << " m=" << m;
        EXPECT_NEAR(sim.step_time, 2.0 * (m + p - 1), 1e-9) << name << " p=" << p << " m=" << m;
      }
    }
  }
}

TEST(Simulate, RecomputationAddsTheForwardToEveryBackward) {
  // GPipe, F = 1, B = 2, recompute R = 1: each B costs 3, so the step is (m + p - 1) (F + B + R).
  for (int p : {2, 4}) {
    for (int m : {2, 8}) {
      const Schedule sc = make("gpipe", p, m, BackwardMode::kStandard);
      CostModel c = fb_costs(sc.num_stages, 1.0, 2.0);
      c.recompute.assign(sc.num_stages, 1.0);
      EXPECT_NEAR(simulate(sc, c).step_time, 4.0 * (m + p - 1), 1e-9) << "p=" << p << " m=" << m;
      // With 2BP the recompute opens every I, W is unchanged: the same as I costing I + R.
      const Schedule split = make("1f1b", p, m, BackwardMode::kSplit);
      CostModel with = CostModel::uniform(split.num_stages, 1.0, 1.0, 1.0), folded = with;
      with.recompute.assign(split.num_stages, 0.5);
      folded.backward_input.assign(split.num_stages, 1.5);
      EXPECT_NEAR(simulate(split, with).step_time, simulate(split, folded).step_time, 1e-9);
      with.recompute.assign(1, 0.5);
      EXPECT_THROW(simulate(split, with), UsageError);
    }
  }
}

TEST(Simulate, TextbookBubbleInterleaved) {
  for (int p : {2, 4}) {
    for (int v : {2, 3, 4}) {
      for (int m : {p, 2 * p, 4 * p}) {
        const Schedule sc = make("interleaved-1f1b", p, m, BackwardMode::kStandard, v);
        const auto sim = simulate(sc, fb_costs(sc.num_stages, 1.0 / v, 1.0 / v));
        EXPECT_NEAR(sim.bubble_fraction, double(p - 1) / (v * m + p - 1), 1e-9)
            << "p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
}

TEST(Simulate, ZeroBubbleSchedules) {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {p, 2 * p, 4 * p, 8 * p}) {
      const auto unit = CostModel::uniform(p, 1.0, 1.0, 1.0);
      const auto h1 = simulate(make("zb-h1", p, m, BackwardMode::kSplit), unit);
      const auto h2 = simulate(make("zb-h2", p, m, BackwardMode::kSplit), unit);
      const auto ofob = simulate(make("1f1b", p, m, BackwardMode::kStandard), unit);
      // Within one step rank r cannot start before r forwards ran upstream, so p-1 idle units per rank is the
      // floor under F = I = W = 1 (ZB-H2's remaining "bubble" is that ramp, which the paper overlaps with the
      // previous step by its post-validation optimizer step): bubble >= (p-1) / (3m + p-1). Both reach it.
      const double floor = double(p - 1) / (3 * m + p - 1);
      EXPECT_NEAR(h2.bubble_fraction, floor, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(h1.bubble_fraction, floor, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(ofob.bubble_fraction, double(p - 1) / (m + p - 1), 1e-9);
      // ZB-H1's idle time per rank is (p-1)(F+I-W), a third of 1F1B's (p-1)(F+I+W).
      const double idle_h1 = h1.bubble_fraction * h1.step_time;
      const double idle_1f1b = ofob.bubble_fraction * ofob.step_time;
      EXPECT_NEAR(idle_h1, idle_1f1b / 3, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_LT(h1.bubble_fraction, 0.5 * ofob.bubble_fraction);
    }
  }
}

TEST(Simulate, ZbvIsNearZeroBubble) {
  for (int p : {2, 4}) {
    for (int m : {2 * p, 4 * p}) {
      const Schedule sc = make("zb-v", p, m, BackwardMode::kSplit, 2);
      const auto sim = simulate(sc, CostModel::uniform(sc.num_stages, 1.0, 1.0, 1.0));
      const auto ofob = simulate(make("1f1b", p, m, BackwardMode::kStandard),
                                 CostModel::uniform(p, 2.0, 2.0, 2.0));  // same work per rank: 2 chunks
      EXPECT_LT(sim.bubble_fraction, 0.5 * ofob.bubble_fraction) << "p=" << p << " m=" << m;
    }
  }
}

TEST(Simulate, TwoBpBeats1f1bAtP2M2) {
  const auto unit = CostModel::uniform(2, 1.0, 1.0, 1.0);
  const auto standard = simulate(make("1f1b", 2, 2, BackwardMode::kStandard), unit);
  const auto split = simulate(make("1f1b", 2, 2, BackwardMode::kSplit), unit);
  EXPECT_DOUBLE_EQ(standard.step_time, 9.0);
  EXPECT_DOUBLE_EQ(split.step_time, 7.0);
  EXPECT_NEAR(standard.step_time / split.step_time, 9.0 / 7.0, 1e-12);  // 1.2857...
}

TEST(Simulate, PeakLiveMicroBatches) {
  for (int p : {2, 4}) {
    for (int m : {2, 4, 8}) {
      const auto g = simulate(make("gpipe", p, m, BackwardMode::kStandard), fb_costs(p, 1, 1));
      for (int r = 0; r < p; ++r) EXPECT_EQ(g.peak_live_micro_batches[r], m);
      const auto s = simulate(make("1f1b", p, m, BackwardMode::kStandard), fb_costs(p, 1, 1));
      EXPECT_EQ(s.peak_live_micro_batches[0], std::min(p, m)) << "p=" << p << " m=" << m;
      EXPECT_EQ(s.peak_live_micro_batches[p - 1], 1);
      const auto h1 = simulate(make("zb-h1", p, m, BackwardMode::kSplit), CostModel::uniform(p, 1, 1, 1));
      for (int r = 0; r < p; ++r) EXPECT_LE(h1.peak_live_micro_batches[r], p);
      const auto h2 = simulate(make("zb-h2", p, m, BackwardMode::kSplit), CostModel::uniform(p, 1, 1, 1));
      for (int r = 0; r < p; ++r) EXPECT_LE(h2.peak_live_micro_batches[r], 2 * p - 1);
    }
  }
}

// The most (stage, micro-batch) activations rank `r` holds between their F and the backward that frees
// `freed_by` (I: the part the controllable-memory paper bounds; W or B: everything, what simulate() counts), from
// the rank's action order alone (memory changes only by a rank's own actions).
int peak_held(const Schedule& sc, int r, bool until_weight) {
  int held = 0, peak = 0;
  for (const Action& a : sc.actions[r]) {
    if (a.type == ActionType::kForward) peak = std::max(peak, ++held);
    const bool frees = until_weight ? a.type == ActionType::kBackwardWeight || a.type == ActionType::kBackward
                                    : a.type == ActionType::kBackwardInput || a.type == ActionType::kBackward;
    if (frees) held -= static_cast<int>(a.micro_batches.size());
  }
  return peak;
}

// V-Half and V-Min (arXiv 2405.15362) bound a rank's activations: 1F1B on the same model (p stages of twice the
// layers) holds up to 2p chunk activations on rank 0; V-Half about half (p + 2), V-Min about a third
// (2 floor((p + 3) / 3)), counted to the I; the W's that follow keep at most two more. For every p and m, split and
// standard, and against zb-v (2p) wherever the bound is below it.
TEST(Simulate, VHalfAndVMinBoundActivationMemory) {
  for (int p = 2; p <= 8; ++p) {
    for (int m : {1, p, 2 * p, 3 * p + 1}) {
      for (BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
        const std::string what = "p=" + std::to_string(p) + " m=" + std::to_string(m);
        const Schedule half = make("v-half", p, m, mode, 2);
        const Schedule min = make("v-min", p, m, mode, 2);
        const Schedule zbv = make("zb-v", p, m, mode, 2);
        const auto unit = CostModel::uniform(2 * p, 1.0, 1.0, 1.0);
        const auto sim_half = simulate(half, unit), sim_min = simulate(min, unit), sim_zbv = simulate(zbv, unit);
        const int half_bound = p + 2, min_bound = 2 * ((p + 3) / 3);
        int zbv_peak = 0, half_peak = 0, min_peak = 0;
        for (int r = 0; r < p; ++r) {
          EXPECT_LE(peak_held(half, r, false), half_bound) << what << " rank " << r;
          EXPECT_LE(peak_held(min, r, false), min_bound) << what << " rank " << r;
          EXPECT_LE(sim_half.peak_live_micro_batches[r], half_bound + 2) << what << " rank " << r;
          EXPECT_LE(sim_min.peak_live_micro_batches[r], min_bound + 2) << what << " rank " << r;
          EXPECT_EQ(sim_half.peak_live_micro_batches[r], peak_held(half, r, true)) << what << " rank " << r;
          zbv_peak = std::max(zbv_peak, sim_zbv.peak_live_micro_batches[r]);
          half_peak = std::max(half_peak, sim_half.peak_live_micro_batches[r]);
          min_peak = std::max(min_peak, sim_min.peak_live_micro_batches[r]);
        }
        if (m >= 2 * p && p >= 6) {
          EXPECT_LT(half_peak, zbv_peak) << what;
          EXPECT_LT(min_peak, half_peak) << what;
        }
      }
    }
  }
}

// interleaved-zb (ZB1P over v looped chunks) fills interleaved 1F1B's bubble with W's as 2BP's cool-down W's do,
// while holding fewer activations: never slower than interleaved-1f1b's 2BP form under F = I = W, never more
// memory; and its standard form is interleaved 1F1B with a shorter warm-up.
TEST(Simulate, InterleavedZeroBubbleMatchesInterleaved2bpWithLessMemory) {
  for (int p : {2, 3, 4}) {
    for (int v : {2, 3}) {
      for (int m : {p, 2 * p, 4 * p}) {
        const std::string what = "p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m);
        const auto unit = CostModel::uniform(p * v, 1.0, 1.0, 1.0);
        const auto zb = simulate(make("interleaved-zb", p, m, BackwardMode::kSplit, v), unit);
        const auto il = simulate(make("interleaved-1f1b", p, m, BackwardMode::kSplit, v), unit);
        EXPECT_LE(zb.step_time, il.step_time + 1e-9) << what;
        for (int r = 0; r < p; ++r) {
          EXPECT_LE(zb.peak_live_micro_batches[r], il.peak_live_micro_batches[r]) << what << " rank " << r;
        }
      }
    }
  }
}

// DualPipeV with a full pipeline (m >= 2p): the split form is as short as zb-v's under F = I = W (both reach the
// ramp-only bubble), and the standard form (B's where DualPipeV fuses) is no slower than zb-v's standard form.
TEST(Simulate, DualPipeVIsNearZeroBubble) {
  for (int p : {2, 3, 4, 8}) {
    for (int m : {2 * p, 4 * p}) {
      const std::string what = "p=" + std::to_string(p) + " m=" + std::to_string(m);
      const auto unit = CostModel::uniform(2 * p, 1.0, 1.0, 1.0);
      for (BackwardMode mode : {BackwardMode::kSplit, BackwardMode::kStandard}) {
        const auto d = simulate(make("dualpipev", p, m, mode, 2), unit);
        const auto z = simulate(make("zb-v", p, m, mode, 2), unit);
        EXPECT_LE(d.step_time, z.step_time + 1e-9) << what;
      }
    }
  }
}

// CostModel::overlap: DualPipeV's overlapped pairs run at once. Each pair's two events span the same time, f + x -
// overlap * min(f, x) from when both parts could start; every other action lasts its cost; with overlap 0 a pair's
// parts run one after the other. Once pairs run at once, the step never gets longer as the overlap grows; the
// bubble counts a pair's span once (busy time never exceeds the step); schedules without pairs do not change.
TEST(Simulate, OverlappedPairsRunAtOnce) {
  CostModel costs;
  for (int p : {2, 3, 4}) {
    for (int m : {2 * p, 2 * p + 1}) {
      for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
        const Schedule sc = make("dualpipev", p, m, mode, 2);
        costs = CostModel::uniform(sc.num_stages, 1.0, 1.25, 0.75);
        for (int s = 0; s < sc.num_stages; ++s) {
          costs.forward[s] = 1.0 + 0.125 * s;  // parts of unequal cost, so that min(f, x) matters
          costs.backward.push_back(1.5 + 0.25 * s);
        }
        double previous = 0.0;
        int pairs = 0;
        for (double overlap : {0.0, 0.25, 0.5, 1.0}) {
          const std::string what = std::string(mode == BackwardMode::kSplit ? "2bp" : "standard") + " p=" +
                                   std::to_string(p) + " m=" + std::to_string(m) + " overlap " +
                                   std::to_string(overlap);
          costs.overlap = overlap;
          const SimulationResult sim = simulate(sc, costs);
          std::vector<std::vector<SimulatedEvent>> by_rank(p);
          for (const SimulatedEvent& e : sim.events) by_rank[e.rank].push_back(e);
          double idle = 0.0;  // over ranks, each pair's span once
          for (auto& events : by_rank) {  // in the rank's order (pairs start together: F first)
            idle += sim.step_time;
            std::stable_sort(events.begin(), events.end(), [](const auto& a, const auto& b) {
              return a.start < b.start;
            });
            for (std::size_t k = 0; k < events.size(); ++k) {
              const SimulatedEvent& e = events[k];
              auto cost = [&](const Action& a) {
                if (a.type == ActionType::kForward) return costs.forward[a.stage];
                if (a.type == ActionType::kBackward) return costs.backward[a.stage];
                if (a.type == ActionType::kBackwardInput) return costs.backward_input[a.stage];
                return costs.weight(a.stage, static_cast<int>(a.micro_batches.size()));
              };
              idle -= e.end - e.start;
              if (!e.action.overlapped_with_next) {
                EXPECT_NEAR(e.end - e.start, cost(e.action), 1e-12) << what << " " << describe(e.action);
                continue;
              }
              ASSERT_LT(k + 1, events.size()) << what;
              const SimulatedEvent& x = events[k + 1];
              const double f = cost(e.action), b = cost(x.action);
              if (overlap == 0.0) {
                EXPECT_LE(e.end, x.start + 1e-12) << what << " " << describe(e.action);
              } else {
                EXPECT_DOUBLE_EQ(x.start, e.start) << what << " " << describe(e.action);
                EXPECT_DOUBLE_EQ(x.end, e.end) << what << " " << describe(e.action);
                EXPECT_NEAR(e.end - e.start, f + b - overlap * std::min(f, b), 1e-12) << what;
                ++k;
              }
              ++pairs;
            }
          }
          // Once pairs run at once, more overlap never lengthens the step. (From 0, it may: run at once, an F's
          // output leaves at the pair's end, not its own -- a small overlap can delay more than it hides.)
          if (overlap > 0.25) EXPECT_LE(sim.step_time, previous + 1e-12) << what;
          EXPECT_NEAR(sim.bubble_fraction, idle / (p * sim.step_time), 1e-12) << what;
          previous = sim.step_time;
        }
        EXPECT_GT(pairs, 0);
      }
    }
  }
  costs.overlap = 0.5;  // no pairs: nothing changes
  const Schedule plain = make("zb-v", 3, 6, BackwardMode::kSplit, 2);
  CostModel in_order = CostModel::uniform(plain.num_stages, 1.0, 1.25, 0.75);
  CostModel at_once = in_order;
  at_once.overlap = 0.5;
  EXPECT_DOUBLE_EQ(simulate(plain, at_once).step_time, simulate(plain, in_order).step_time);
  for (double bad : {-0.25, 1.5, std::nan("")}) {
    at_once.overlap = bad;
    EXPECT_THROW(simulate(plain, at_once), UsageError) << bad;
  }
}

TEST(Simulate, CommunicationLatencyAndEvents) {
  const Schedule sc = make("1f1b", 2, 1, BackwardMode::kStandard);
  CostModel c = CostModel::uniform(2, 1.0, 1.0, 1.0, 0.5);
  const auto sim = simulate(sc, c);
  // F0 [0,1], F1 [1.5,2.5], B1 [2.5,4.5], B0 [5,7].
  EXPECT_DOUBLE_EQ(sim.step_time, 7.0);
  ASSERT_EQ(sim.events.size(), 4u);
  EXPECT_EQ(sim.events[1].rank, 1);
  EXPECT_DOUBLE_EQ(sim.events[1].start, 1.5);
  EXPECT_DOUBLE_EQ(sim.events.back().start, 5.0);
  EXPECT_NEAR(sim.bubble_fraction, (2 * 7.0 - 6.0) / 14.0, 1e-12);
  // Batched W costs k times the per-micro-batch weight cost.
  const Schedule g = make("gpipe", 1, 3, BackwardMode::kSplit);
  const auto gs = simulate(g, CostModel::uniform(1, 1.0, 1.0, 0.25));
  EXPECT_DOUBLE_EQ(gs.step_time, 3 + 3 + 0.75);
}

TEST(Simulate, RejectsBadCostModel) {
  const Schedule sc = make("1f1b", 2, 2, BackwardMode::kSplit);
  EXPECT_THROW(simulate(sc, CostModel::uniform(1, 1, 1, 1)), UsageError);
}

// Issue 69: every time of the cost model is a finite number >= 0 -- NaN, +inf, -inf and negative refused, naming
// the member and stage; 0 is a free action, taken. Finite costs that add up past the largest double are refused.
TEST(Simulate, RefusesCostsThatAreNotCosts) {
  const Schedule split = make("1f1b", 2, 2, BackwardMode::kSplit);
  const Schedule standard = make("1f1b", 2, 2, BackwardMode::kStandard);
  using Member = std::vector<double> CostModel::*;
  const std::pair<const char*, Member> members[] = {
      {"forward", &CostModel::forward},   {"backward_input", &CostModel::backward_input},
      {"backward_weight", &CostModel::backward_weight}, {"backward", &CostModel::backward},
      {"backward_weight_fixed", &CostModel::backward_weight_fixed}, {"recompute", &CostModel::recompute}};
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto& [name, member] : members) {
    for (double bad : {std::nan(""), inf, -inf, -1.0}) {
      CostModel c = fb_costs(2, 1.0, 2.0);
      c.backward_weight_fixed.assign(2, 0.0);
      c.recompute.assign(2, 0.0);
      (c.*member)[1] = bad;
      for (const Schedule* sc : {&split, &standard}) {
        try {
          simulate(*sc, c);
          ADD_FAILURE() << name << " = " << bad << " was taken";
        } catch (const UsageError& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find(std::string("simulate: CostModel.") + name + "[1] is "), std::string::npos) << what;
          EXPECT_NE(what.find("expected a finite time >= 0"), std::string::npos) << what;
        }
      }
    }
  }
  for (double bad : {std::nan(""), inf, -inf, -1.0}) {
    CostModel c = fb_costs(2, 1.0, 2.0);
    c.communication = bad;
    EXPECT_THROW(simulate(split, c), UsageError) << "communication " << bad;
  }
  // 0: a free action or message, a step of 0.
  CostModel zero = fb_costs(2, 0.0, 0.0);
  EXPECT_DOUBLE_EQ(simulate(split, zero).step_time, 0.0);
  EXPECT_DOUBLE_EQ(simulate(standard, zero).step_time, 0.0);
  // Each finite, the sum not: refused rather than an infinite (or, worse, finite) step.
  CostModel huge = fb_costs(2, 1.0, 2.0);
  huge.backward_weight.assign(2, 1e308);
  huge.forward.assign(2, 1e308);
  try {
    simulate(split, huge);
    ADD_FAILURE() << "W = 1e308 was taken";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("add up past the largest double"), std::string::npos) << e.what();
  }
}

// Issue 70: CostModel::per_action, a fixed cost of every compute action, charged once per action (a W of several
// micro-batches once, recomputation not again): on one rank every action is on the critical path, so k actions add
// exactly k x; a known two-rank step grows by the four actions of its one path; not a cost: refused.
TEST(Simulate, PerActionCostIsChargedOncePerAction) {
  const double x = 0.375;  // exact in binary: the sums below compare with ==
  auto compute_actions = [](const Schedule& sc) {
    int k = 0;
    for (const auto& list : sc.actions) {
      k += static_cast<int>(
          std::count_if(list.begin(), list.end(), [](const Action& a) { return is_compute(a.type); }));
    }
    return k;
  };
  for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
    for (int m : {1, 3, 8}) {
      const Schedule sc = make("gpipe", 1, m, mode);
      CostModel c = CostModel::uniform(1, 1.0, 1.0, 0.25);
      c.recompute.assign(1, 0.5);
      const double without = simulate(sc, c).step_time;
      c.per_action = x;
      const int k = compute_actions(sc);
      EXPECT_EQ(simulate(sc, c).step_time, without + k * x) << to_string(mode) << " m=" << m << ", " << k << " actions";
    }
  }
  // 2BP on one rank, 3 micro-batches: 3 F, 3 I and one W of all three (0.75): 7 actions.
  const Schedule g = make("gpipe", 1, 3, BackwardMode::kSplit);
  CostModel batched = CostModel::uniform(1, 1.0, 1.0, 0.25);
  batched.per_action = x;
  EXPECT_EQ(compute_actions(g), 7);
  EXPECT_EQ(simulate(g, batched).step_time, 3 + 3 + 0.75 + 7 * x);

  // 1F1B p = 2, m = 1, comm 0.5: F0 [0,1], F1 [1.5,2.5], B1 [2.5,4.5], B0 [5,7] -- each action a little longer.
  const Schedule sc = make("1f1b", 2, 1, BackwardMode::kStandard);
  CostModel c = CostModel::uniform(2, 1.0, 1.0, 1.0, 0.5);
  c.per_action = x;
  const SimulationResult sim = simulate(sc, c);
  EXPECT_EQ(sim.step_time, 7.0 + 4 * x);
  ASSERT_EQ(sim.events.size(), 4u);
  EXPECT_EQ(sim.events[1].start, 1.5 + x);
  EXPECT_EQ(sim.events.back().start, 5.0 + 3 * x);
  EXPECT_EQ(sim.events.back().end - sim.events.back().start, 2.0 + x);
  // A larger pipeline: never faster, and at most every rank's actions one after the other longer.
  const Schedule big = make("interleaved-1f1b", 4, 8, BackwardMode::kSplit, 2);
  CostModel u = CostModel::uniform(big.num_stages, 0.5, 0.5, 0.5, 0.05);
  const double before = simulate(big, u).step_time;
  u.per_action = 0.1;
  const double after = simulate(big, u).step_time;
  EXPECT_GT(after, before);
  EXPECT_LE(after, before + 0.1 * compute_actions(big));

  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -1.0}) {
    CostModel b = CostModel::uniform(2, 1.0, 1.0, 1.0);
    b.per_action = bad;
    try {
      simulate(sc, b);
      ADD_FAILURE() << "per_action = " << bad << " was taken";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("simulate: CostModel.per_action is "), std::string::npos) << e.what();
    }
  }
}

TEST(Simulate, WorksWithoutCommunicationActions) {
  Schedule sc = make("1f1b", 2, 2, BackwardMode::kSplit);
  Schedule compute_only = sc;
  for (auto& list : compute_only.actions) {
    std::vector<Action> kept;
    for (const Action& a : list) {
      if (is_compute(a.type)) kept.push_back(a);
    }
    list = kept;
  }
  const auto unit = CostModel::uniform(2, 1, 1, 1, 0.25);
  EXPECT_DOUBLE_EQ(simulate(compute_only, unit).step_time, simulate(sc, unit).step_time);
  EXPECT_EQ(add_communication(compute_only).actions, sc.actions);
}

// ---- data parallelism: per-stage all-reduces on one link per rank ----

TEST(SimulateDataParallel, NoReductionCostsChangeNothing) {
  for (const std::string& name : schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const Schedule sc = make_schedule(name, default_schedule_options(name, 4, 8, mode));
      const CostModel base = CostModel::uniform(sc.num_stages, 1.0, 1.25, 0.75, 0.1);
      CostModel zero = base;
      zero.data_parallel_reduce.assign(sc.num_stages, 0.0);
      for (const CostModel& c : {base, zero}) {
        const auto sim = simulate(sc, c);
        // The step is the end of the last action, as without the data-parallel fields.
        double last_end = 0.0;
        for (const auto& e : sim.events) last_end = std::max(last_end, e.end);
        EXPECT_DOUBLE_EQ(sim.step_time, last_end) << name;
        EXPECT_EQ(sim.data_parallel_exposed, 0.0) << name;
        EXPECT_EQ(sim.data_parallel_exposed_per_rank, std::vector<double>(sc.num_ranks, 0.0)) << name;
      }
      const auto a = simulate(sc, base), b = simulate(sc, zero);
      EXPECT_EQ(a.step_time, b.step_time);
      EXPECT_EQ(a.bubble_fraction, b.bubble_fraction);
      EXPECT_EQ(a.peak_live_micro_batches, b.peak_live_micro_batches);
      ASSERT_EQ(a.events.size(), b.events.size());
      for (std::size_t k = 0; k < a.events.size(); ++k) EXPECT_EQ(a.events[k].end, b.events[k].end);
    }
  }
  // The known values are untouched (TwoBpBeats1f1bAtP2M2).
  EXPECT_DOUBLE_EQ(simulate(make("1f1b", 2, 2, BackwardMode::kSplit), CostModel::uniform(2, 1, 1, 1)).step_time, 7.0);
}

TEST(SimulateDataParallel, WithoutOverlapReductionsFollowTheRanksLastAction) {
  // 1F1B 2BP, p = 2, m = 2, F = I = W = 1: both ranks end at 7 (see Grid.RendersCells). Reductions 0.5 (stage 0)
  // and 1.5 (stage 1) start at 7: ends 7.5 and 8.5, so the step is 7 + max over ranks of its reductions.
  CostModel c = CostModel::uniform(2, 1, 1, 1);
  c.data_parallel_reduce = {0.5, 1.5};
  c.overlap_data_parallel = false;
  const auto sim = simulate(make("1f1b", 2, 2, BackwardMode::kSplit), c);
  EXPECT_DOUBLE_EQ(sim.step_time, 8.5);
  EXPECT_DOUBLE_EQ(sim.data_parallel_exposed, 1.5);
  EXPECT_EQ(sim.data_parallel_exposed_per_rank, (std::vector<double>{0.5, 1.5}));
  // Busy 6 per rank over a step of 8.5.
  EXPECT_NEAR(sim.bubble_fraction, 1.0 - 12.0 / (2 * 8.5), 1e-12);

  // Standard 1F1B, p = 2, m = 2, B = 2: rank 0 ends at 9, rank 1 at 7 (B1 [5,7]). Reductions 1 and 3: both ranks
  // end at 10, so the step grows by 1 while rank 1's exposed time is 3.
  c.data_parallel_reduce = {1.0, 3.0};
  const auto std_sim = simulate(make("1f1b", 2, 2, BackwardMode::kStandard), c);
  EXPECT_DOUBLE_EQ(std_sim.step_time, 10.0);
  EXPECT_DOUBLE_EQ(std_sim.data_parallel_exposed, 3.0);
  EXPECT_EQ(std_sim.data_parallel_exposed_per_rank, (std::vector<double>{1.0, 3.0}));
  // One chunk per rank whose last W/B is the rank's last action: overlapping cannot hide anything.
  c.overlap_data_parallel = true;
  EXPECT_DOUBLE_EQ(simulate(make("1f1b", 2, 2, BackwardMode::kStandard), c).step_time, 10.0);
}

// ZB-V 2BP, p = 2, m = 2, F = I = W = 0.5 per chunk (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2):
//   rank 0 | F0.0 F0.1 ..   F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 I0.0 W0.0 ..   I0.1 W0.1   last W: stage 3 at 4.5, 0 at 7
//   rank 1 | ..   F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 I1.0 W1.0 I2.1 W2.1 I1.1 W1.1 ..   last W: stage 2 at 5.5, 1 at 6.5
// Rank 0 ends at 7, rank 1 at 6.5.
Schedule zbv_p2_m2() { return make("zb-v", 2, 2, BackwardMode::kSplit, 2); }
CostModel zbv_costs(std::vector<double> reduce, bool overlap) {
  CostModel c = CostModel::uniform(4, 0.5, 0.5, 0.5);
  c.data_parallel_reduce = std::move(reduce);
  c.overlap_data_parallel = overlap;
  return c;
}

TEST(SimulateDataParallel, OverlapStartsAStageReductionAtItsLastW) {
  const Schedule sc = zbv_p2_m2();
  ASSERT_DOUBLE_EQ(simulate(sc, zbv_costs({}, true)).step_time, 7.0);
  // Reductions of 1 per stage. Overlap: rank 0 reduces stage 3 in [4.5, 5.5] under its compute and stage 0 in
  // [7, 8]; rank 1 stage 2 in [5.5, 6.5], stage 1 in [6.5, 7.5]. Exposed 1 on both ranks, step 8.
  const auto on = simulate(sc, zbv_costs({1, 1, 1, 1}, true));
  EXPECT_DOUBLE_EQ(on.step_time, 8.0);
  EXPECT_DOUBLE_EQ(on.data_parallel_exposed, 1.0);
  EXPECT_EQ(on.data_parallel_exposed_per_rank, (std::vector<double>{1.0, 1.0}));
  // Without overlap both reductions follow the rank's end: rank 0 [7, 9], rank 1 [6.5, 8.5]. Exposed 2, step 9.
  const auto off = simulate(sc, zbv_costs({1, 1, 1, 1}, false));
  EXPECT_DOUBLE_EQ(off.step_time, 9.0);
  EXPECT_DOUBLE_EQ(off.data_parallel_exposed, 2.0);
  EXPECT_LT(on.data_parallel_exposed, off.data_parallel_exposed);
  EXPECT_LT(on.bubble_fraction, off.bubble_fraction);

  // Reductions of 2 make the link the bottleneck: rank 1 reduces stage 2 in [5.5, 7.5], so stage 1 (ready at 6.5)
  // waits for the link until 7.5 and ends at 9.5 (exposed 3); rank 0: stage 3 [4.5, 6.5], stage 0 [7, 9] (2).
  const auto busy_link = simulate(sc, zbv_costs({2, 2, 2, 2}, true));
  EXPECT_DOUBLE_EQ(busy_link.step_time, 9.5);
  EXPECT_EQ(busy_link.data_parallel_exposed_per_rank, (std::vector<double>{2.0, 3.0}));
  EXPECT_DOUBLE_EQ(busy_link.data_parallel_exposed, 3.0);
  EXPECT_DOUBLE_EQ(simulate(sc, zbv_costs({2, 2, 2, 2}, false)).data_parallel_exposed, 4.0);
}

// Buckets: with 2BP a one-chunk rank still hides part of its reduction in its last W, as the runtime starts a
// bucket once the W's layers that fill it ran; after a B nothing starts early.
TEST(SimulateDataParallel, BucketsStartDuringTheLastW) {
  // 1F1B 2BP, p = 2, m = 2, F = I = W = 1: rank 0's last action is W(mb 1) in [6, 7], rank 1's W(mbs 0, 1) in
  // [5, 7]. Reductions 0.5 and 1.5 in 2 buckets: rank 0 reduces [6.5, 6.75] and [7, 7.25] (exposed 0.25); rank 1
  // [6, 6.75] and [7, 7.75] (0.75).
  CostModel c = CostModel::uniform(2, 1, 1, 1);
  c.data_parallel_reduce = {0.5, 1.5};
  c.data_parallel_buckets = 2;
  const auto split = simulate(make("1f1b", 2, 2, BackwardMode::kSplit), c);
  EXPECT_EQ(split.data_parallel_exposed_per_rank, (std::vector<double>{0.25, 0.75}));
  EXPECT_DOUBLE_EQ(split.step_time, 7.75);
  c.data_parallel_buckets = 1;
  EXPECT_DOUBLE_EQ(simulate(make("1f1b", 2, 2, BackwardMode::kSplit), c).data_parallel_exposed, 1.5);
  // Standard mode: the buckets of a B start at its end, however many there are.
  c.data_parallel_buckets = 4;
  c.data_parallel_reduce = {1.0, 3.0};
  EXPECT_EQ(simulate(make("1f1b", 2, 2, BackwardMode::kStandard), c).data_parallel_exposed_per_rank,
            (std::vector<double>{1.0, 3.0}));
  c.data_parallel_buckets = 0;
  EXPECT_THROW(simulate(make("1f1b", 2, 2, BackwardMode::kStandard), c), UsageError);
}

TEST(SimulateDataParallel, ReductionsThatFitInTheRanksRemainingTimeAreHidden) {
  const Schedule sc = zbv_p2_m2();
  // Only the chunks that finish early have gradients to reduce (0.5 each): stage 3 in [4.5, 5] before rank 0's end
  // at 7, stage 2 in [5.5, 6] before rank 1's at 6.5. Nothing is exposed and the step is unchanged.
  const auto on = simulate(sc, zbv_costs({0, 0, 0.5, 0.5}, true));
  EXPECT_EQ(on.data_parallel_exposed, 0.0);
  EXPECT_EQ(on.data_parallel_exposed_per_rank, (std::vector<double>{0.0, 0.0}));
  EXPECT_DOUBLE_EQ(on.step_time, 7.0);
  // The same reductions after the ranks' last actions are exposed.
  const auto off = simulate(sc, zbv_costs({0, 0, 0.5, 0.5}, false));
  EXPECT_DOUBLE_EQ(off.data_parallel_exposed, 0.5);
  EXPECT_DOUBLE_EQ(off.step_time, 7.5);
  // Interleaved 1F1B (p = 2, m = 2, v = 2): rank 0's last W of stage 2 ends at 5.5 and the rank at 6.5, so 1 on
  // stage 2 and nothing on stage 0 is hidden exactly (it ends with the rank); 1.25 exposes the excess 0.25.
  const Schedule il = make("interleaved-1f1b", 2, 2, BackwardMode::kSplit, 2);
  CostModel c = CostModel::uniform(4, 0.5, 0.5, 0.5);
  c.data_parallel_reduce = {0, 0, 1, 0};
  EXPECT_EQ(simulate(il, c).data_parallel_exposed, 0.0);
  c.data_parallel_reduce = {0, 0, 1.25, 0};
  EXPECT_DOUBLE_EQ(simulate(il, c).data_parallel_exposed, 0.25);
}

TEST(SimulateDataParallel, OverlapNeverExposesMoreThanReducingAfterBackward) {
  for (const std::string& name : schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (int p : {2, 4}) {
        const Schedule sc = make_schedule(name, default_schedule_options(name, p, 2 * p, mode));
        CostModel c = CostModel::uniform(sc.num_stages, 1.0, 1.0, 1.0, 0.1);
        c.data_parallel_reduce.resize(sc.num_stages);
        for (int s = 0; s < sc.num_stages; ++s) c.data_parallel_reduce[s] = 0.5 + 0.75 * s;
        c.overlap_data_parallel = false;
        const auto off = simulate(sc, c);
        c.overlap_data_parallel = true;
        const auto on = simulate(sc, c);
        const std::string what = name + (mode == BackwardMode::kSplit ? " 2bp" : " standard") + " p=" +
                                 std::to_string(p);
        EXPECT_LE(on.data_parallel_exposed, off.data_parallel_exposed) << what;
        EXPECT_LE(on.step_time, off.step_time) << what;
        // Without overlap every rank is extended by exactly the sum of its stages' reductions.
        for (int r = 0; r < p; ++r) {
          double sum = 0.0;
          for (int s : sc.stages_of(r)) sum += c.data_parallel_reduce[s];
          EXPECT_NEAR(off.data_parallel_exposed_per_rank[r], sum, 1e-9) << what << " rank " << r;
          EXPECT_GT(on.data_parallel_exposed_per_rank[r], 0.0) << what;  // the last chunk is never hidden
        }
        // Two chunks per rank: the earlier chunk's reduction is hidden at least in part.
        if (sc.num_stages > p) EXPECT_LT(on.data_parallel_exposed, off.data_parallel_exposed) << what;
      }
    }
  }
}

TEST(SimulateDataParallel, RejectsBadReductionCosts) {
  const Schedule sc = make("1f1b", 2, 2, BackwardMode::kSplit);
  CostModel c = CostModel::uniform(2, 1, 1, 1);
  c.data_parallel_reduce = {1.0};
  EXPECT_THROW(simulate(sc, c), UsageError);
  c.data_parallel_reduce = {1.0, -1.0};
  EXPECT_THROW(simulate(sc, c), UsageError);
  c.data_parallel_reduce = {1.0, std::nan("")};
  EXPECT_THROW(simulate(sc, c), UsageError);
}

// simulate_peak_memory with one unit of memory per live micro-batch (F adds 1; B, or W per micro-batch, frees it)
// is the simulator's peak_live_micro_batches, for every schedule: two accounts of the same lifetimes.
TEST(SimulatePeakMemory, UnitActivationsAreThePeakLiveMicroBatches) {
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (auto [p, m] : std::vector<std::pair<int, int>>{{2, 2}, {2, 5}, {3, 6}, {4, 8}, {4, 12}}) {
        Schedule sc;
        try {
          sc = make_schedule(name, default_schedule_options(name, p, m, mode));
        } catch (const ScheduleError&) {
          continue;  // this shape is not one the schedule takes
        }
        MemoryModel model;
        model.base.assign(sc.num_ranks, 0.0);
        model.stages.resize(sc.num_stages);
        for (auto& s : model.stages) {
          s[static_cast<int>(ActionType::kForward)] = {1.0, 1.0};
          s[static_cast<int>(ActionType::kBackward)] = {-1.0, 0.0};
          s[static_cast<int>(ActionType::kBackwardWeight)] = {-1.0, 0.0};
        }
        const std::vector<double> peaks = simulate_peak_memory(sc, model);
        const SimulationResult sim = simulate(sc, CostModel::uniform(sc.num_stages, 1.0, 1.0, 1.0));
        for (int r = 0; r < sc.num_ranks; ++r) {
          EXPECT_EQ(peaks[r], sim.peak_live_micro_batches[r]) << name << " p=" << p << " m=" << m << " rank " << r;
        }
      }
    }
  }
}

// By hand: 1F1B with 2BP, 2 ranks, 2 micro-batches; rank 1 runs F0 I0 F1 I1 W0 W1 (plus messages).
TEST(SimulatePeakMemory, WalksEachRanksActionsInOrder) {
  const Schedule sc = make("1f1b", 2, 2, BackwardMode::kSplit);
  MemoryModel model;
  model.base = {100.0, 50.0};
  model.stages.resize(2);
  for (auto& s : model.stages) {
    s[static_cast<int>(ActionType::kForward)] = {10.0, 12.0};         // keeps 10, 2 more while it runs
    s[static_cast<int>(ActionType::kBackwardInput)] = {-6.0, 3.0};    // frees 6 of the 10, works with 3
    s[static_cast<int>(ActionType::kBackwardWeight)] = {-4.0, 1.0};   // frees the rest
    s[static_cast<int>(ActionType::kRecvBackward)] = {0.5, 0.5};      // a gradient buffer
    s[static_cast<int>(ActionType::kSendBackward)] = {-0.5, 0.0};
  }
  model.gradients = {0.0, 7.0};  // stage 1's first W allocates its .grad
  const std::vector<double> peaks = simulate_peak_memory(sc, model);
  // Rank 1 (the last stage: RECV_F costs nothing here, SEND_B frees a gradient buffer): levels
  //   F0 50 -> 60 (peak 62); I0 -> 54 (peak 63); SEND_B -> 53.5; RECV_F/F1 -> 63.5 (peak 65.5); I1 -> 57.5
  //   (peak 66.5); SEND_B -> 57; W0 -> 57 - 4 + 7 = 60 (peak 57 + 1 + 7 = 65); W1 -> 56.
  EXPECT_DOUBLE_EQ(peaks[1], 66.5);
  // Rank 0: F0 -> 110 (112); F1 -> 120 (122); RECV_B -> 120.5; I0 -> 114.5 (123.5); ... so the peak is 123.5.
  EXPECT_DOUBLE_EQ(peaks[0], 123.5);
}

TEST(SimulatePeakMemory, RejectsModelsThatDoNotCoverTheSchedule) {
  const Schedule sc = make("1f1b", 2, 2, BackwardMode::kSplit);
  MemoryModel model;
  model.base = {0.0};
  model.stages.resize(2);
  EXPECT_THROW(simulate_peak_memory(sc, model), UsageError);
  model.base = {0.0, 0.0};
  model.stages.resize(3);
  EXPECT_THROW(simulate_peak_memory(sc, model), UsageError);
  model.stages.resize(2);
  model.gradients = {1.0};
  EXPECT_THROW(simulate_peak_memory(sc, model), UsageError);
  model.gradients.clear();
  EXPECT_NO_THROW(simulate_peak_memory(sc, model));
}

TEST(Grid, RendersCells) {
  const Schedule sc = make("1f1b", 2, 2, BackwardMode::kSplit);
  const std::string grid = render_grid(sc);
  EXPECT_NE(grid.find("rank 0 | F0 F1 .. I0 W0 I1 W1"), std::string::npos) << grid;
  EXPECT_NE(grid.find("rank 1 | .. F0 I0 F1 I1 W0 W1"), std::string::npos) << grid;
  const Action mark{ActionType::kBackwardInput, 1, {1}};
  const std::string marked = render_grid(sc, &mark, 1);
  EXPECT_NE(marked.find("[I1]"), std::string::npos) << marked;
  EXPECT_NE(marked.find("marks rank 1: I stage 1 micro-batch 1"), std::string::npos) << marked;
  const Schedule il = make("interleaved-1f1b", 2, 2, BackwardMode::kStandard, 2);
  const std::string g2 = render_grid(il);
  EXPECT_NE(g2.find("F2.1"), std::string::npos) << g2;
  EXPECT_NE(g2.find("B3.0 B3.0"), std::string::npos) << g2;
}

}  // namespace
}  // namespace twobp
