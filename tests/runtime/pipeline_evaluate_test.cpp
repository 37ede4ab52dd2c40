// Pipeline::evaluate: a forward-only pass through the pipeline (forward_only() of the training schedule) that
// returns the global batch's mean loss on every rank, keeps no graph and touches no gradient, and runs the chunks
// in eval() mode. Every built-in schedule x mode x dp is also evaluated by the data-parallel parity tests
// (common/dp_cases.h: threads and mpiexec, float64 and mixed precision); this file covers the contract's other
// parts on rank threads, float64.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/split_cases.h"
#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp::testing {
namespace {

constexpr int64_t kEvalDim = 4, kEvalSeq = 3, kEvalMbs = 2;

// Stages alternate dropout (twobp::nn::Dropout: off in eval mode) and batch/instance norm with running statistics
// (in eval mode they normalise with them, and nothing updates them).
std::shared_ptr<CaseModule> make_stage(int s) {
  torch::manual_seed(40 + s);
  if (s % 2 == 0) return std::make_shared<StageDropout>(kEvalDim);
  return std::make_shared<Normalized>(kEvalDim);
}

struct Job {
  Schedule schedule;
  std::vector<std::shared_ptr<CaseModule>> chunks;  // by stage
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::unique_ptr<Pipeline>> pipelines;  // by rank
};

Job make_job(const std::string& name, BackwardMode mode, int p, int m, bool announce_shapes = false) {
  Job job;
  job.schedule = make_schedule(name, default_schedule_options(name, p, m, mode));
  for (int s = 0; s < job.schedule.num_stages; ++s) job.chunks.push_back(make_stage(s));
  job.transports = make_local_transports(p);
  for (int r = 0; r < p; ++r) {
    std::vector<PipelineChunk> chunks;
    for (int s : job.schedule.stages_of(r)) {
      auto* raw = job.chunks[s].get();
      chunks.push_back({s, job.chunks[s], [raw](const at::Tensor& x) { return raw->forward(x); }});
    }
    PipelineOptions o;
    o.executor.timeout = std::chrono::seconds(60);
    o.loss = mse;
    o.seed = 5;
    if (!announce_shapes) {
      o.executor.activation_spec = [](int) { return TensorSpec{{kEvalMbs, kEvalSeq, kEvalDim}, at::kDouble}; };
    }
    job.pipelines.push_back(std::make_unique<Pipeline>(job.schedule, std::move(chunks), *job.transports[r], o));
  }
  return job;
}

// The reference: each micro-batch through every chunk in eval() mode without autograd, the mean of the losses.
double reference_eval(Job& job, const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& ys) {
  torch::NoGradGuard no_grad;
  for (auto& c : job.chunks) c->eval();
  double sum = 0.0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    torch::Tensor h = xs[k];
    for (auto& c : job.chunks) h = c->forward(h);
    sum += mse(h, ys[k]).item<double>();
  }
  for (auto& c : job.chunks) c->train();
  return sum / static_cast<double>(xs.size());
}

// Every parameter's .grad and every buffer of every chunk, by stage and name.
std::map<std::string, at::Tensor> snapshot(const Job& job) {
  std::map<std::string, at::Tensor> out;
  for (std::size_t s = 0; s < job.chunks.size(); ++s) {
    for (const auto& item : job.chunks[s]->named_parameters()) {
      const at::Tensor& g = item.value().grad();
      out["stage " + std::to_string(s) + " grad " + item.key()] = g.defined() ? g.clone() : at::Tensor();
    }
    for (const auto& item : job.chunks[s]->named_buffers()) {
      out["stage " + std::to_string(s) + " buffer " + item.key()] = item.value().clone();
    }
  }
  return out;
}

void expect_same(const std::map<std::string, at::Tensor>& before, const std::map<std::string, at::Tensor>& after) {
  ASSERT_EQ(before.size(), after.size());
  for (const auto& [name, t] : before) {
    const at::Tensor& u = after.at(name);
    ASSERT_EQ(t.defined(), u.defined()) << name;
    if (t.defined()) EXPECT_TRUE(torch::equal(t, u)) << name << " changed during evaluate()";
  }
}

class PipelineEvaluate : public ::testing::TestWithParam<std::pair<std::string, BackwardMode>> {
 protected:
  Float64Default float64_;
};

// Between a step and the optimizer: evaluate() returns the eval-mode forward loss on every rank, leaves every
// gradient and buffer as the step left it (the forward counter aside, which counts forwards), restores the
// chunks' train/eval flags (a submodule put in eval() by the user stays there), and the next step is unchanged.
TEST_P(PipelineEvaluate, BetweenStepsLeavesTrainingUntouched) {
  const auto [name, mode] = GetParam();
  const int p = 2, m = 4;
  Job job = make_job(name, mode, p, m);
  Job twin = make_job(name, mode, p, m);  // the same run without evaluations
  torch::manual_seed(3);
  const auto inputs = torch::randn({m * kEvalMbs, kEvalSeq, kEvalDim});
  const auto targets = torch::randn({m * kEvalMbs, kEvalSeq, kEvalDim});
  const auto xs = inputs.split(kEvalMbs), ys = targets.split(kEvalMbs);
  // A user's own choice that evaluate() must not undo.
  for (Job* j : {&job, &twin}) static_cast<Normalized&>(*j->chunks[1]).instance_norm->eval();

  std::vector<double> evaluated(p, -1.0);
  std::map<std::string, at::Tensor> before;
  std::vector<std::vector<double>> losses(2);  // second step's, job and twin (last rank)
  const int last = job.schedule.stage_to_rank.back();
  for (Job* j : {&job, &twin}) {
    const bool evaluating = j == &job;
    run_rank_threads(j->transports, [&](Transport& t) {
      Pipeline& pipeline = *j->pipelines[t.rank()];
      pipeline.step(inputs, targets);
      if (evaluating) {
        t.barrier(std::chrono::seconds(60));
        if (t.rank() == 0) before = snapshot(*j);
        t.barrier(std::chrono::seconds(60));
        evaluated[t.rank()] = pipeline.evaluate(inputs, targets);
      }
      StepResult second = pipeline.step(inputs, targets);
      if (t.rank() == last) losses[evaluating ? 0 : 1] = second.losses;
    }).rethrow_root_cause();
  }
  EXPECT_EQ(losses[0], losses[1]) << "a step after evaluate() must be the step without it";
  // The step after evaluate accumulated on top: compare the evaluation's own effect on a fresh run instead.
  Job third = make_job(name, mode, p, m);
  static_cast<Normalized&>(*third.chunks[1]).instance_norm->eval();
  std::vector<double> again(p, -1.0);
  run_rank_threads(third.transports, [&](Transport& t) {
    Pipeline& pipeline = *third.pipelines[t.rank()];
    pipeline.step(inputs, targets);
    t.barrier(std::chrono::seconds(60));
    if (t.rank() == 0) before = snapshot(third);
    t.barrier(std::chrono::seconds(60));
    again[t.rank()] = pipeline.evaluate(inputs, targets);
  }).rethrow_root_cause();
  auto after = snapshot(third);
  // The counter buffer counts forwards: evaluate ran each micro-batch's forward once.
  for (std::size_t s = 1; s < third.chunks.size(); s += 2) {
    const std::string counter = "stage " + std::to_string(s) + " buffer forwards";
    EXPECT_EQ(after.at(counter).item<double>(), before.at(counter).item<double>() + m) << counter;
    after.erase(counter);
    before.erase(counter);
  }
  expect_same(before, after);
  for (std::size_t s = 0; s < third.chunks.size(); ++s) {
    for (const auto& sub : third.chunks[s]->modules()) {
      const bool user_eval = s == 1 && sub.get() == static_cast<Normalized&>(*third.chunks[1]).instance_norm.get();
      EXPECT_EQ(sub->is_training(), !user_eval) << "stage " << s << ": train/eval flags restored";
    }
  }
  // The value: the reference's eval-mode forward on the same modules (evaluate left them as they were).
  const double want = reference_eval(third, xs, ys);
  static_cast<Normalized&>(*third.chunks[1]).instance_norm->eval();
  for (int r = 0; r < p; ++r) {
    EXPECT_NEAR(again[r], want, 1e-12 * std::abs(want)) << "rank " << r;
    EXPECT_EQ(again[r], evaluated[r]) << "rank " << r << ": the same evaluation in both jobs";
  }
}

std::vector<std::pair<std::string, BackwardMode>> cases() {
  std::vector<std::pair<std::string, BackwardMode>> out;
  for (const auto& s : builtin_schedule_names()) {
    for (BackwardMode m : {BackwardMode::kStandard, BackwardMode::kSplit}) out.emplace_back(s, m);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineEvaluate, ::testing::ValuesIn(cases()), [](const auto& info) {
  std::string n = info.param.first + (info.param.second == BackwardMode::kSplit ? "_2bp" : "_standard");
  std::replace_if(n.begin(), n.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  return n;
});

// Before any step, on four ranks of an interleaved schedule (8 stages), with micro-batches of different sizes
// given one by one and shapes announced (no spec): the eval-mode forward loss, the mean over micro-batches.
TEST(PipelineEvaluateAlone, BeforeAnyStepWithMicroBatchesOfDifferentSizes) {
  Float64Default f;
  const int p = 4, m = 4;
  Job job = make_job("interleaved-1f1b", BackwardMode::kSplit, p, m, /*announce_shapes=*/true);
  ASSERT_EQ(job.schedule.num_stages, 8);
  torch::manual_seed(8);
  std::vector<NamedTensors> ins, outs;
  std::vector<torch::Tensor> xs, ys;
  for (int k = 0; k < m; ++k) {
    xs.push_back(torch::randn({1 + k, kEvalSeq, kEvalDim}));
    ys.push_back(torch::randn({1 + k, kEvalSeq, kEvalDim}));
  }
  std::vector<double> got(p, -1.0);
  run_rank_threads(job.transports, [&](Transport& t) {
    const int r = t.rank();
    std::vector<NamedTensors> in, out;
    for (int k = 0; k < m; ++k) {
      if (r == job.schedule.stage_to_rank.front()) in.push_back(NamedTensors{{"x", xs[k]}});
      if (r == job.schedule.stage_to_rank.back()) out.push_back(NamedTensors{{"y", ys[k]}});
    }
    got[r] = job.pipelines[r]->evaluate(in, out);
  }).rethrow_root_cause();
  const double want = reference_eval(job, xs, ys);
  for (int r = 0; r < p; ++r) EXPECT_NEAR(got[r], want, 1e-12 * std::abs(want)) << "rank " << r;
}

// forward_only() keeps each rank's forward actions and activation messages in order and nothing else (no
// overlapped pairs: their B's are gone).
TEST(ForwardOnly, KeepsTheForwardHalfInOrder) {
  for (const auto& name : builtin_schedule_names()) {
    for (BackwardMode mode : {BackwardMode::kStandard, BackwardMode::kSplit}) {
      const Schedule s = make_schedule(name, default_schedule_options(name, 4, 8, mode));
      const Schedule f = forward_only(s);
      EXPECT_EQ(f.stage_to_rank, s.stage_to_rank);
      int forwards = 0;
      for (int r = 0; r < s.num_ranks; ++r) {
        std::vector<Action> kept;
        for (const Action& a : s.actions[r]) {
          if (a.type == ActionType::kForward || a.type == ActionType::kSendForward ||
              a.type == ActionType::kRecvForward) {
            kept.push_back(a);
            kept.back().overlapped_with_next = false;  // an overlapped pair's flag goes with its B
          }
        }
        EXPECT_EQ(f.actions[r], kept) << name << " rank " << r;
        for (const Action& a : f.actions[r]) forwards += a.type == ActionType::kForward;
      }
      EXPECT_EQ(forwards, s.num_stages * s.num_micro_batches) << name;
    }
  }
}

}  // namespace
}  // namespace twobp::testing
