// PyTorch's compute_only schedule CSV: every schedule round-trips as the header promises; the schedules PyTorch's
// own generators wrote (tests/schedule/pytorch_csv/, by generate.py: interleaved 1F1B, looped BFS, interleaved
// zero bubble, ZBV, DualPipeV with its overlapped F&B cells) load, validate for by-tag and in-order (NCCL)
// pairing, and train with the gradients of loss.backward() (float64, every .grad); malformed files are refused
// naming row and cell.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/pipeline_fixtures.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/text.h"
#include "twobp/schedule/validate.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

const std::string kDir = TWOBP_PYTORCH_CSV_DIR;

std::vector<std::string> csv_files() {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(kDir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 4 && n.compare(n.size() - 4, 4, ".csv") == 0) out.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Each rank's compute actions, in order (what the CSV holds).
std::vector<std::vector<Action>> compute_actions(const Schedule& s) {
  std::vector<std::vector<Action>> out;
  for (const auto& actions : s.actions) {
    out.emplace_back();
    for (const Action& a : actions) {
      if (is_compute(a.type)) out.back().push_back(a);
    }
  }
  return out;
}

// `s` with every W of k > 1 micro-batches run as a W of its first micro-batch and a W of the other k - 1: W's of
// one stage back to back, in two sizes.
Schedule first_weight_apart(Schedule s) {
  for (auto& actions : s.actions) {
    std::vector<Action> out;
    for (const Action& a : actions) {
      if (a.type == ActionType::kBackwardWeight && a.micro_batches.size() > 1) {
        Action first = a, rest = a;
        first.micro_batches.resize(1);
        rest.micro_batches.erase(rest.micro_batches.begin());
        out.push_back(first);
        out.push_back(rest);
      } else {
        out.push_back(a);
      }
    }
    actions = std::move(out);
  }
  return s;
}

// The header's promise as stated, read with the default options: every built-in's actions exactly (communication
// included), and the compute actions of any schedule, W sizes included: the built-ins with their W's one
// micro-batch at a time and with their batched W's cut in two (W's of a stage back to back, which a reader that
// joined every run of W cells would merge).
TEST(PytorchCsv, EveryScheduleRoundTripsWithTheDefaultOptions) {
  int checked = 0, apart = 0;
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      for (const auto& [p, m] : std::vector<std::pair<int, int>>{{2, 2}, {2, 4}, {4, 4}, {4, 8}, {3, 5}}) {
        Schedule s;
        try {
          s = make_schedule(name, default_schedule_options(name, p, m, mode));
        } catch (const ScheduleError&) {
          continue;  // a shape this schedule does not take
        }
        const std::string what = name + " " + to_string(mode) + " p=" + std::to_string(p) + " m=" + std::to_string(m);
        const std::string csv = to_pytorch_csv(s);
        PytorchCsvOptions named;
        named.name = s.name;
        const Schedule back = from_pytorch_csv(csv, named);
        EXPECT_EQ(back.num_ranks, s.num_ranks) << what;
        EXPECT_EQ(back.num_stages, s.num_stages) << what;
        EXPECT_EQ(back.num_micro_batches, s.num_micro_batches) << what;
        EXPECT_EQ(back.stage_to_rank, s.stage_to_rank) << what;
        EXPECT_EQ(back.backward, s.backward) << what;
        EXPECT_TRUE(back.actions == s.actions) << what;
        EXPECT_EQ(to_pytorch_csv(back), csv) << what;
        EXPECT_NO_THROW(validate(back, Pairing::kInOrderPerChannel)) << what;
        for (const Schedule& variant : {one_micro_batch_per_weight(s), first_weight_apart(s)}) {
          const std::string vcsv = to_pytorch_csv(variant);
          EXPECT_TRUE(compute_actions(from_pytorch_csv(vcsv)) == compute_actions(variant)) << what << "\n" << vcsv;
          apart += vcsv.find(",,") != std::string::npos;
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 40);
  EXPECT_GT(apart, 20);  // the W's kept apart by an empty cell were exercised
}

TEST(PytorchCsv, WritesPytorchsCells) {
  const Schedule s = make_schedule("gpipe", ScheduleOptions{2, 2, 1, BackwardMode::kSplit});
  // gpipe 2BP: all F, all I, one batched W per stage -- written as one W cell per micro-batch.
  EXPECT_EQ(to_pytorch_csv(s), "0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1F1,1I0,1I1,1W0,1W1\n");
  // Its W's one micro-batch at a time: an empty cell (PyTorch's idle slot) keeps them apart.
  EXPECT_EQ(to_pytorch_csv(one_micro_batch_per_weight(s)), "0F0,0F1,0I0,0I1,0W0,,0W1\n1F0,1F1,1I0,1I1,1W0,,1W1\n");
  PytorchCsvOptions separate;
  separate.merge_weight_runs = false;
  const Schedule unmerged = from_pytorch_csv(to_pytorch_csv(s), separate);
  int weights = 0;
  for (const Action& a : unmerged.actions[0]) weights += a.type == ActionType::kBackwardWeight;
  EXPECT_EQ(weights, 2);
}

class PytorchSchedules : public ::testing::TestWithParam<std::string> {
 protected:
  Float64Default float64_;
};

TEST_P(PytorchSchedules, LoadValidateAndTrainExactly) {
  const Schedule schedule = load_schedule_file(kDir + "/" + GetParam());
  ASSERT_NO_THROW(validate(schedule, Pairing::kByTag));
  ASSERT_NO_THROW(validate(schedule, Pairing::kInOrderPerChannel)) << "would mis-pair on NCCL";
  const int m = schedule.num_micro_batches;
  torch::manual_seed(1);
  const auto inputs = torch::randn({m * kMicroBatchSize, kDim}), targets = torch::randn({m * kMicroBatchSize, kDim});
  const Reference ref = run_reference(schedule.num_stages, m, inputs, targets);
  // Every rank's chunks built here (the global generator), trained on threads over the in-order Local transport.
  LocalOptions lo;
  lo.pairing = Pairing::kInOrderPerChannel;
  auto transports = make_local_transports(schedule.num_ranks, lo);
  std::vector<std::shared_ptr<torch::nn::Module>> chunks(schedule.num_stages);
  std::vector<std::unique_ptr<Pipeline>> pipelines;
  for (int r = 0; r < schedule.num_ranks; ++r) {
    std::vector<PipelineChunk> mine;
    for (int s : schedule.stages_of(r)) {
      chunks[s] = make_chunk(s);
      auto* raw = chunks[s].get();
      mine.push_back({s, chunks[s], [raw, s](const at::Tensor& x) { return run_chunk(*raw, s, x); }});
    }
    PipelineOptions o;
    o.executor.timeout = std::chrono::seconds(60);
    o.loss = mse;
    o.executor.activation_spec = [](int) { return TensorSpec{{kMicroBatchSize, kDim}, at::kDouble}; };
    pipelines.push_back(std::make_unique<Pipeline>(schedule, std::move(mine), *transports[r], o));
  }
  std::vector<double> losses;
  run_rank_threads(transports, [&](Transport& t) {
    StepResult r = pipelines[t.rank()]->step(inputs, targets);
    if (t.rank() == schedule.stage_to_rank.back()) losses = r.losses;
  }).rethrow_root_cause();
  ASSERT_EQ(losses.size(), static_cast<std::size_t>(m));
  for (int mb = 0; mb < m; ++mb) EXPECT_NEAR(losses[mb], ref.losses[mb], 1e-12) << "micro-batch " << mb;
  for (int s = 0; s < schedule.num_stages; ++s) {
    auto got = chunks[s]->named_parameters();
    for (const auto& item : ref.chunks[s]->named_parameters()) {
      const at::Tensor& g = got[item.key()].grad();
      ASSERT_TRUE(g.defined()) << "stage " << s << " " << item.key();
      EXPECT_LE((g - item.value().grad()).abs().max().item<double>(), 1e-12) << "stage " << s << " " << item.key();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Generated, PytorchSchedules, ::testing::ValuesIn(csv_files()), [](const auto& info) {
  std::string n = info.param.substr(0, info.param.size() - 4);
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
});

// twobp's looped-bfs writes the CSV PyTorch's ScheduleLoopedBFS writes (standard mode: PyTorch's has no 2BP form).
TEST(PytorchCsv, LoopedBfsIsPytorchs) {
  for (const auto& [p, m] : std::vector<std::pair<int, int>>{{2, 4}, {4, 6}}) {
    std::ifstream in(kDir + "/ScheduleLoopedBFS_p" + std::to_string(p) + "_m" + std::to_string(m) + ".csv");
    std::stringstream theirs;
    theirs << in.rdbuf();
    const Schedule ours = make_schedule("looped-bfs", ScheduleOptions{p, m, 2, BackwardMode::kStandard});
    EXPECT_EQ(to_pytorch_csv(ours), to_pytorch_csv(from_pytorch_csv(theirs.str()))) << "p=" << p << " m=" << m;
  }
}

// `csv` without its empty cells (idle slots: PyTorch's None; twobp writes one between two W's of a stage).
std::string without_idle_slots(std::string csv) {
  for (std::size_t at; (at = csv.find(",,")) != std::string::npos;) csv.erase(at, 1);
  for (std::size_t at; (at = csv.find(",\n")) != std::string::npos;) csv.erase(at, 1);
  return csv;
}

// twobp's interleaved-zb and dualpipev (2BP form) write the CSVs PyTorch's ScheduleInterleavedZeroBubble and
// ScheduleDualPipeV write, action for action (DualPipeV's overlapped pairs as their F and B, in order; PyTorch's
// W's are one micro-batch each, so W cells side by side are the same actions with or without an idle slot).
TEST(PytorchCsv, InterleavedZeroBubbleAndDualPipeVArePytorchs) {
  for (const auto& [ours_name, theirs_name] :
       std::vector<std::pair<std::string, std::string>>{{"interleaved-zb", "ScheduleInterleavedZeroBubble"},
                                                        {"dualpipev", "ScheduleDualPipeV"}}) {
    for (const auto& [p, m] : std::vector<std::pair<int, int>>{{2, 4}, {4, 8}}) {
      std::ifstream in(kDir + "/" + theirs_name + "_p" + std::to_string(p) + "_m" + std::to_string(m) + ".csv");
      ASSERT_TRUE(in) << theirs_name;
      std::stringstream theirs;
      theirs << in.rdbuf();
      const Schedule ours = make_schedule(ours_name, ScheduleOptions{p, m, 2, BackwardMode::kSplit});
      EXPECT_EQ(without_idle_slots(to_pytorch_csv(ours)),
                without_idle_slots(to_pytorch_csv(from_pytorch_csv(theirs.str()))))
          << ours_name << " p=" << p << " m=" << m;
    }
  }
}

TEST(PytorchCsv, TheGeneratedFilesAreThere) { EXPECT_EQ(csv_files().size(), 10u) << kDir; }

void expect_refused(const std::string& csv, const std::string& words) {
  try {
    validate(from_pytorch_csv(csv));
    ADD_FAILURE() << "accepted: " << csv;
  } catch (const ScheduleError& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(PytorchCsv, MalformedFilesAreRefusedNamingTheCell) {
  expect_refused("0F0,0SEND_F0,0B0\n", "row 1 (rank 0), cell 2 '0SEND_F0'");
  expect_refused("0F0,0X0\n1F0\n", "cell 2 '0X0'");
  expect_refused("0F0,0B0\n0F0,0B0\n", "stage 0 is already in the row of rank 0");
  expect_refused("0F0,0B0\n2F0,2B0\n", "stage 1 appears in no row");
  expect_refused("(0F1;0Q0)OVERLAP_F_B\n", "'0Q0' is not");
  expect_refused("\n", "no action");
  // Well-formed cells, but a backward before its forward: validate() says so.
  expect_refused("0B0,0F0\n", "");
}

}  // namespace
}  // namespace twobp::testing
