// The library's BERT-like and ResNet-like chunks (twobp/models/bert.h, resnet.h): the same weights and function
// whatever the partition, and pipelines of them (general split path, BatchNorm buffers) that match
// loss.backward() over the micro-batches in float64 for every parameter's .grad and every buffer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/test_models.h"
#include "twobp/error.h"
#include "twobp/models/bert.h"
#include "twobp/models/resnet.h"
#include "twobp/runtime/launch.h"
#include "twobp/runtime/pipeline.h"
#include "twobp/schedule/registry.h"
#include "twobp/transport/local.h"

namespace twobp {
namespace {

constexpr int64_t kMbs = 2;
constexpr int kMicroBatches = 4;

using Chunk = std::shared_ptr<torch::nn::Module>;
using Forward = std::function<at::Tensor(const at::Tensor&)>;

// One model family: its chunks, a batch of kMicroBatches micro-batches, the boundary shape.
struct Family {
  std::string name;
  std::function<std::pair<Chunk, Forward>(int stage, int stages)> make;
  at::Tensor inputs, targets;
  std::vector<int64_t> boundary;  // one micro-batch's activation between stages
};

Family bert() {
  const models::BertConfig c{16, 4, 2, 32, 50, 6};
  Family f{"bert",
           [c](int s, int n) {
             models::BertChunk m(c, s, n, 7);
             return std::make_pair(Chunk(m.ptr()), Forward([m](const at::Tensor& x) mutable { return m->forward(x); }));
           },
           {}, {}, {kMbs, c.seq, c.dim}};
  at::manual_seed(3);
  f.inputs = at::randint(c.vocab, {kMicroBatches * kMbs, c.seq}, at::kLong);
  f.targets = at::randint(c.vocab, {kMicroBatches * kMbs, c.seq}, at::kLong);
  return f;
}

Family resnet() {
  const models::ResNetConfig c{4, 5, 3, 6, 4};
  Family f{"resnet",
           [c](int s, int n) {
             models::ResNetChunk m(c, s, n, 7);
             return std::make_pair(Chunk(m.ptr()), Forward([m](const at::Tensor& x) mutable { return m->forward(x); }));
           },
           {}, {}, {kMbs, c.channels, c.image_size, c.image_size}};
  at::manual_seed(4);
  f.inputs = at::randn({kMicroBatches * kMbs, c.in_channels, c.image_size, c.image_size}, at::kDouble);
  f.targets = at::randint(c.classes, {kMicroBatches * kMbs}, at::kLong);
  return f;
}

// Mean cross entropy in float64 over every token (bert) or sample (resnet).
at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

// Every parameter and buffer of `chunks` (by stage) under "<stage>/<name>".
std::map<std::string, at::Tensor> state_of(const std::vector<Chunk>& chunks, bool gradients) {
  std::map<std::string, at::Tensor> out;
  for (std::size_t s = 0; s < chunks.size(); ++s) {
    for (const auto& p : chunks[s]->named_parameters()) {
      out[std::to_string(s) + "/" + p.key()] = gradients ? p.value().grad() : p.value();
    }
    if (gradients) continue;
    for (const auto& b : chunks[s]->named_buffers()) out[std::to_string(s) + "/" + b.key()] = b.value();
  }
  return out;
}

class ReferenceModels : public ::testing::TestWithParam<std::function<Family()>> {
 protected:
  testing::Float64Default float64_;
};

// The same weights by global name, and the same output, for 1, 2 or 4 stages.
TEST_P(ReferenceModels, WeightsAndFunctionIndependentOfThePartition) {
  const Family f = GetParam()();
  std::map<std::string, at::Tensor> weights;
  at::Tensor first_output;
  for (int stages : {1, 2, 4}) {
    at::Tensor x = f.inputs;
    for (int s = 0; s < stages; ++s) {
      auto [chunk, forward] = f.make(s, stages);
      for (const auto& p : chunk->named_parameters()) {
        auto [it, fresh] = weights.emplace(p.key(), p.value());
        if (!fresh) EXPECT_TRUE(at::equal(it->second, p.value())) << f.name << " " << p.key() << " at " << stages;
      }
      x = forward(x);
    }
    if (!first_output.defined()) first_output = x;
    EXPECT_TRUE(at::allclose(x, first_output, 1e-12, 1e-12)) << f.name << " on " << stages << " stages";
  }
  EXPECT_THROW(f.make(0, 5), UsageError) << "5 stages for 4 blocks";
}

// Pipelines over 2 rank threads, both modes, one and two chunks per rank, against one process: every .grad (each
// defined where the reference's is) and every buffer (BatchNorm's running statistics) to float64 rounding.
TEST_P(ReferenceModels, PipelinesMatchLossBackward) {
  const Family f = GetParam()();
  for (const auto& [name, mode] : std::vector<std::pair<std::string, BackwardMode>>{
           {"1f1b", BackwardMode::kSplit}, {"gpipe", BackwardMode::kStandard}, {"zb-v", BackwardMode::kSplit}}) {
    const Schedule sc = make_schedule(name, default_schedule_options(name, 2, kMicroBatches, mode));
    SCOPED_TRACE(f.name + " " + sc.name + " " + to_string(mode));
    std::vector<Chunk> ref, piped;
    std::vector<Forward> ref_fwd, piped_fwd;
    for (int s = 0; s < sc.num_stages; ++s) {
      auto [a, fa] = f.make(s, sc.num_stages);
      auto [b, fb] = f.make(s, sc.num_stages);
      ref.push_back(a);
      ref_fwd.push_back(fa);
      piped.push_back(b);
      piped_fwd.push_back(fb);
    }
    const auto xs = f.inputs.split(kMbs), ys = f.targets.split(kMbs);
    for (int mb = 0; mb < kMicroBatches; ++mb) {
      at::Tensor h = xs[mb];
      for (int s = 0; s < sc.num_stages; ++s) h = ref_fwd[s](h);
      (loss(h, ys[mb]) / kMicroBatches).backward();
    }
    auto transports = make_local_transports(2);
    const RankErrors errors = run_rank_threads(transports, [&](Transport& t) {
      std::vector<PipelineChunk> chunks;
      for (int s : sc.stages_of(t.rank())) chunks.push_back({s, piped[s], piped_fwd[s]});
      PipelineOptions o;
      o.executor.timeout = std::chrono::seconds(60);
      o.loss = loss;
      const std::vector<int64_t> shape = f.boundary;
      o.executor.activation_spec = [shape](int) { return TensorSpec{shape, at::kDouble}; };
      Pipeline pipeline(sc, std::move(chunks), t, o);
      pipeline.step(f.inputs, f.targets);
    });
    ASSERT_TRUE(errors.ok()) << error_message(errors.root_cause());
    const auto want_grads = state_of(ref, true), got_grads = state_of(piped, true);
    for (const auto& [key, want] : want_grads) {
      const at::Tensor& got = got_grads.at(key);
      ASSERT_EQ(got.defined(), want.defined()) << key;
      if (want.defined()) EXPECT_TRUE(at::allclose(got, want, 1e-10, 1e-12)) << key;
    }
    const auto want_state = state_of(ref, false), got_state = state_of(piped, false);
    for (const auto& [key, want] : want_state) {
      EXPECT_TRUE(at::allclose(got_state.at(key).to(at::kDouble), want.to(at::kDouble), 1e-10, 1e-12)) << key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ReferenceModels, ::testing::Values(bert, resnet),
                         [](const auto& info) { return info.index == 0 ? std::string("Bert") : std::string("ResNet"); });

TEST(ReferenceModelConfigs, BadSizesAreRefusedNamingTheField) {
  EXPECT_THROW((models::BertConfig{30, 4, 4}.validate(1)), UsageError);  // dim not a multiple of heads
  EXPECT_THROW((models::BertConfig{16, 4, 2, 0}.validate(1)), UsageError);
  EXPECT_THROW((models::ResNetConfig{0}.validate(1)), UsageError);
  EXPECT_THROW((models::ResNetConfig{4, 5, 3, 6, 2}.validate(3)), UsageError);
  EXPECT_EQ(models::even_blocks(10, 2, 4), (std::pair<int64_t, int64_t>{5, 7}));
  EXPECT_THROW(models::even_blocks(10, 4, 4), UsageError);
}

}  // namespace
}  // namespace twobp
