// LLaMa model: analytic sizes, partitioning, and chunk-by-chunk parity (plain autograd and the 2BP Stage split).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

#include "twobp/error.h"
#include "twobp/models/llama.h"
#include "twobp/stage.h"

namespace llm = twobp::models;

namespace {

std::map<std::string, torch::Tensor> params_by_name(const std::vector<llm::LlamaChunk>& chunks) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& c : chunks) {
    for (const auto& item : c->named_parameters()) out.emplace(item.key(), item.value());
  }
  return out;
}

}  // namespace

TEST(LlamaConfig, SevenBillionParameters) {
  const auto c = llm::config_by_name("7b");
  EXPECT_EQ(c.dim, 4096);
  EXPECT_EQ(c.n_layers, 32);
  const double n = static_cast<double>(llm::parameter_count(c));
  EXPECT_NEAR(n / 6.74e9, 1.0, 0.005) << n;
}

TEST(LlamaConfig, UnknownNameListsKnownOnes) {
  try {
    llm::config_by_name("13b");
    FAIL() << "expected UsageError";
  } catch (const twobp::UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("13b"), std::string::npos) << what;
    for (const auto& name : llm::config_names()) EXPECT_NE(what.find(name), std::string::npos) << what;
  }
}

TEST(LlamaConfig, WithDimsReplacesOnlyTheGivenSizes) {
  const auto tiny = llm::config_by_name("tiny");
  const auto same = llm::with_dims(tiny, {});
  EXPECT_EQ(same.name, "tiny");
  EXPECT_EQ(same.dim, tiny.dim);
  llm::LlamaDims d;
  d.dim = 96;
  d.vocab = 1000;
  const auto c = llm::with_dims(tiny, d);
  EXPECT_EQ(c.name, "tiny-custom");
  EXPECT_EQ(c.dim, 96);
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.n_layers, tiny.n_layers);
  EXPECT_EQ(c.n_heads, tiny.n_heads);
  EXPECT_EQ(c.n_kv_heads, tiny.n_kv_heads);
  EXPECT_EQ(c.ffn_dim, tiny.ffn_dim);
  EXPECT_EQ(c.max_seq_len, tiny.max_seq_len);
  // Inconsistent sizes are refused, naming the field: 4 kv heads do not divide 6 heads.
  d = {};
  d.heads = 6;
  d.dim = 96;
  d.kv_heads = 4;
  try {
    llm::with_dims(tiny, d);
    FAIL() << "expected UsageError";
  } catch (const twobp::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("n_kv_heads 4"), std::string::npos) << e.what();
  }
}

TEST(LlamaConfig, AnalyticCountMatchesBuiltModel) {
  for (const char* name : {"tiny", "small"}) {
    const auto c = llm::config_by_name(name);
    llm::LlamaChunk whole(c, llm::make_partition(c, 1, c.max_seq_len).chunks[0]);
    int64_t n = 0;
    for (const auto& p : whole->parameters()) n += p.numel();
    EXPECT_EQ(n, llm::parameter_count(c)) << name;
    const auto part = llm::make_partition(c, 3, c.max_seq_len);
    int64_t sum = 0;
    for (const auto& spec : part.chunks) sum += llm::chunk_parameter_count(c, spec);
    EXPECT_EQ(sum, llm::parameter_count(c)) << name;
  }
}

TEST(Partition, SevenBOverFourStagesIsBalanced) {
  const auto c = llm::config_by_name("7b");
  const auto p = llm::make_partition(c, 4, c.max_seq_len);
  ASSERT_EQ(p.num_chunks(), 4);
  EXPECT_LE(p.imbalance(), 1.10) << p.layout();
  EXPECT_TRUE(p.chunks.front().has_embedding);
  EXPECT_TRUE(p.chunks.back().has_head);
  int next = 0;
  for (const auto& ch : p.chunks) {
    EXPECT_EQ(ch.first_layer, next);
    next = ch.end_layer;
  }
  EXPECT_EQ(next, 32);
  // The head costs 2·dim·vocab per token against ~2·202M + attention per block: about 0.6 of a block.
  const double head = llm::head_cost_in_blocks(c, 2048);
  EXPECT_GT(head, 0.5);
  EXPECT_LT(head, 0.7);
}

TEST(Partition, BalancedAcrossManyChunkCounts) {
  const auto c = llm::config_by_name("7b");
  for (int chunks : {2, 3, 4, 8, 16}) {
    const auto p = llm::make_partition(c, chunks, c.max_seq_len);
    EXPECT_EQ(p.num_chunks(), chunks);
    // Blocks are indivisible: the biggest chunk may exceed the mean by less than one block, not more.
    const double mean = p.imbalance() > 0 ? *std::max_element(p.cost.begin(), p.cost.end()) / p.imbalance() : 0;
    EXPECT_LT(*std::max_element(p.cost.begin(), p.cost.end()), mean + 1.0) << chunks << ": " << p.layout();
  }
  // More chunks than blocks: the last chunk holds only the head.
  const auto tiny = llm::config_by_name("tiny");
  const auto p = llm::make_partition(tiny, 5, tiny.max_seq_len);
  EXPECT_EQ(p.layout(), "1,1,1,1,0");
}

TEST(Partition, ExplicitLayout) {
  auto c = llm::config_by_name("small");  // 8 layers
  const auto p = llm::make_partition(c, 4, c.max_seq_len, "3,3,2,0");
  EXPECT_EQ(p.layout(), "3,3,2,0");
  EXPECT_EQ(p.chunks[3].num_layers(), 0);
  EXPECT_TRUE(p.chunks[3].has_head);
  EXPECT_EQ(p.chunks[2].first_layer, 6);
  EXPECT_EQ(p.chunks[2].end_layer, 8);
}

// Tied embeddings split over chunks: the last chunk's head is a copy of its own, drawn as the embedding (the
// pipeline then keeps the two one weight: PipelineOptions::tied_parameters, set by build_llama_rank).
TEST(Partition, TiedEmbeddingsSplitWithTheHeadACopyOfTheEmbedding) {
  auto tied = llm::config_by_name("tiny");
  tied.tie_embeddings = true;
  const llm::Partition p = llm::make_partition(tied, 2, 64);
  llm::LlamaChunk first(tied, p.chunks.front(), 5), last(tied, p.chunks.back(), 5);
  EXPECT_TRUE(torch::equal(first->embed->weight, last->head->weight));
  EXPECT_FALSE(first->embed->weight.is_same(last->head->weight));
  int64_t held = 0;
  for (const auto& t : last->parameters()) held += t.numel();
  EXPECT_EQ(llm::chunk_parameter_count(tied, p.chunks.back()), held) << "the head's copy is memory of its own";
  const llm::Partition one = llm::make_partition(tied, 1, 64);
  llm::LlamaChunk whole(tied, one.chunks.front(), 5);
  EXPECT_TRUE(whole->head->weight.is_same(whole->embed->weight)) << "one chunk: one tensor";
}

TEST(Partition, ImpossibleSplitsAreUsageErrors) {
  const auto tiny = llm::config_by_name("tiny");  // 4 layers: at most 5 chunks
  EXPECT_THROW(llm::make_partition(tiny, 6, 64), twobp::UsageError);
  EXPECT_THROW(llm::make_partition(tiny, 0, 64), twobp::UsageError);
  EXPECT_THROW(llm::make_partition(tiny, 2, 64, "3,3"), twobp::UsageError);      // wrong sum
  EXPECT_THROW(llm::make_partition(tiny, 3, 64, "2,2"), twobp::UsageError);      // wrong count
  EXPECT_THROW(llm::make_partition(tiny, 3, 64, "2,0,2"), twobp::UsageError);    // empty middle chunk
  EXPECT_THROW(llm::make_partition(tiny, 2, 64, "2,x"), twobp::UsageError);      // malformed
  try {
    llm::make_partition(tiny, 6, 64);
  } catch (const twobp::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("6 chunks"), std::string::npos) << e.what();
  }
}

TEST(LlamaChunk, InitialisationIsPartitionIndependent) {
  const auto c = llm::config_by_name("tiny");
  std::vector<llm::LlamaChunk> whole{llm::LlamaChunk(c, llm::make_partition(c, 1, 64).chunks[0], 7)};
  std::vector<llm::LlamaChunk> parts;
  for (const auto& spec : llm::make_partition(c, 3, 64).chunks) parts.emplace_back(c, spec, 7);
  auto a = params_by_name(whole), b = params_by_name(parts);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, b[name])) << name;
  }
  std::vector<llm::LlamaChunk> other{llm::LlamaChunk(c, llm::make_partition(c, 1, 64).chunks[0], 8)};
  EXPECT_FALSE(torch::equal(a["layers.0.wq.weight"], params_by_name(other)["layers.0.wq.weight"]));
}

class ChunkParity : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    config = llm::config_by_name("tiny");
    ids = torch::randint(0, config.vocab_size, {3, 32}, torch::kLong);
    targets = torch::randint(0, config.vocab_size, {3, 32}, torch::kLong);
    reference.push_back(llm::LlamaChunk(config, llm::make_partition(config, 1, 32).chunks[0], 1));
    ref_logits = reference[0]->forward(ids);
    ref_loss = llm::cross_entropy_loss(ref_logits, targets);
    ref_loss.backward();
    for (const auto& spec : llm::make_partition(config, 2, 32).chunks) chunks.emplace_back(config, spec, 1);
    ASSERT_FALSE(chunks[0]->spec().has_head);
    ASSERT_TRUE(chunks[1]->spec().has_head);
  }

  void expect_same_gradients() {
    auto ref = params_by_name(reference), got = params_by_name(chunks);
    ASSERT_EQ(ref.size(), got.size());
    for (const auto& [name, p] : ref) {
      ASSERT_TRUE(p.grad().defined()) << name;
      ASSERT_TRUE(got[name].grad().defined()) << name;
      EXPECT_TRUE(torch::allclose(got[name].grad(), p.grad(), 1e-4, 1e-6))
          << name << " max diff " << (got[name].grad() - p.grad()).abs().max().item<float>();
    }
  }

  llm::LlamaConfig config;
  torch::Tensor ids, targets, ref_logits, ref_loss;
  std::vector<llm::LlamaChunk> reference, chunks;
};

TEST_F(ChunkParity, TwoChunksPlainAutograd) {
  auto hidden = chunks[0]->forward(ids);
  EXPECT_EQ(hidden.sizes(), (std::vector<int64_t>{3, 32, config.dim}));
  auto logits = chunks[1]->forward(hidden);
  EXPECT_TRUE(torch::allclose(logits, ref_logits, 1e-5, 1e-6));
  auto loss = llm::cross_entropy_loss(logits, targets);
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-6);
  EXPECT_NEAR(loss.item<double>(), std::log(256.0), 0.5);  // near-uniform predictions at initialisation
  loss.backward();
  expect_same_gradients();
}

TEST_F(ChunkParity, TwoChunksAsStagesWithSplitBackward) {
  twobp::StageOptions o0;
  o0.stage_index = 0;
  o0.num_stages = 2;
  twobp::StageOptions o1 = o0;
  o1.stage_index = 1;
  o1.loss = llm::cross_entropy_loss;
  auto c0 = chunks[0].ptr(), c1 = chunks[1].ptr();
  twobp::Stage s0(c0, [c0](const at::Tensor& x) { return c0->forward(x); }, o0);
  twobp::Stage s1(c1, [c1](const at::Tensor& x) { return c1->forward(x); }, o1);
  // Two micro-batches with the same data, each with loss_scale 1: gradients are twice the reference.
  for (int mb = 0; mb < 2; ++mb) {
    auto hidden = s0.forward(mb, ids);
    auto loss = s1.forward(mb, hidden, targets);
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-6);
  }
  for (int mb = 0; mb < 2; ++mb) {
    auto g = s1.backward_input(mb);
    s0.backward_input(mb, g);
  }
  s1.backward_weight({0, 1});
  s0.backward_weight({1, 0});
  for (auto& c : chunks) {
    for (auto& p : c->parameters()) p.mutable_grad() = p.grad() / 2;
  }
  expect_same_gradients();
}

TEST(PackedDocuments, DocumentsAndPositionsRestartAfterEachSeparator) {
  const int64_t sep = 10;
  auto tokens = torch::tensor({5, 10, 7, 8, 10, 3, 4, 9, 10, 10, 2, 2}, torch::kLong).view({2, 6});
  auto docs = llm::pack_documents(tokens, sep);
  EXPECT_TRUE(torch::equal(docs.doc_ids, torch::tensor({0, 0, 1, 1, 1, 2, 0, 0, 0, 1, 2, 2}).view({2, 6})))
      << docs.doc_ids;
  EXPECT_TRUE(torch::equal(docs.positions, torch::tensor({0, 1, 0, 1, 2, 0, 0, 1, 2, 0, 0, 1}).view({2, 6})))
      << docs.positions;
  auto targets = llm::packed_targets(tokens, tokens, sep);
  EXPECT_TRUE(torch::equal(targets[llm::kLossMask], (tokens != sep).to(torch::kFloat)));
}

TEST(PackedDocuments, DocumentMaskingMakesEachDocumentSeeOnlyItself) {
  // A row packing documents A and B gives, on B's tokens, the logits of B run alone: B attends to nothing of A
  // and its rotary positions restart at 0. Float64 so that the comparison is tight.
  torch::set_default_dtype(caffe2::TypeMeta::Make<double>());
  const auto c = llm::config_by_name("tiny");
  llm::LlamaChunk whole(c, llm::make_partition(c, 1, 32).chunks[0], 3);
  whole->to(torch::kDouble);
  torch::set_default_dtype(caffe2::TypeMeta::Make<float>());
  const int64_t sep = 10;
  torch::manual_seed(5);
  auto a = torch::randint(11, c.vocab_size, {1, 5}, torch::kLong);
  a[0][4] = sep;  // A ends with the separator
  auto b = torch::randint(11, c.vocab_size, {1, 7}, torch::kLong);
  auto packed = torch::cat({a, b}, 1);
  torch::NoGradGuard no_grad;
  auto logits = whole->forward(llm::packed_inputs(packed, sep))["logits"];
  auto alone = whole->forward(b);
  EXPECT_LT((logits.narrow(1, 5, 7) - alone).abs().max().item<double>(), 1e-10);
  // Without the mask B would see A: the test can tell the difference.
  auto unmasked = whole->forward(packed);
  EXPECT_GT((unmasked.narrow(1, 5, 7) - alone).abs().max().item<double>(), 1e-6);
}
