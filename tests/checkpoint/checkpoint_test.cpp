// Sharded checkpoints: round trip of parameters and AdamW state, checksum verification, crash safety and
// configuration checks.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "common/temp_files.h"
#include "twobp/checkpoint.h"
#include "twobp/error.h"
#include "twobp/models/llama.h"
#include "twobp/runtime/launch.h"
#include "twobp/transport/local.h"

namespace ck = twobp::checkpoint;
namespace llm = twobp::models;

namespace {

const twobp::Duration kTimeout = std::chrono::seconds(30);

struct Rank {
  llm::LlamaChunk chunk{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  ck::NamedTensors params;

  Rank(const llm::LlamaConfig& c, const llm::ChunkSpec& spec, uint64_t seed) : chunk(c, spec, seed) {
    params = ck::module_tensors(*chunk);
    optimizer = std::make_unique<torch::optim::AdamW>(chunk->parameters(), torch::optim::AdamWOptions(1e-2));
  }
  // One optimizer step on a deterministic pseudo-gradient.
  void train_step(int step) {
    // Without the guard each .grad would carry a graph back to its own parameter: a reference cycle (leak).
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : params) p.mutable_grad() = torch::full_like(p, 0.01 * (step + 1)) + p * 0.1;
    optimizer->step();
  }
  ck::NamedTensors state() const {
    auto all = params;
    auto opt = ck::adamw_state_tensors(*optimizer, params);
    all.insert(all.end(), opt.begin(), opt.end());
    return all;
  }
};

using twobp::testing::file_exists;
using twobp::testing::file_size;
using twobp::testing::make_temp_dir;
using twobp::testing::remove_tree;

// A fresh path for a checkpoint directory that does not exist yet (save_checkpoint creates it).
std::string parent_dir(const std::string& dir) { return dir.substr(0, dir.rfind('/')); }

std::string fresh_dir(const std::string& name) { return make_temp_dir("ckpt_" + name) + "/ckpt"; }

ck::CheckpointConfig config_for(const std::string& model) {
  return {{"model", model}, {"stages", "2"}, {"schedule", "1f1b"}, {"partition", "2,2"}};
}

// Saves the state of both ranks (threads over a LocalTransport group) as checkpoint `step`.
void save_both(const std::string& dir, int64_t step, std::vector<Rank>& ranks, const ck::CheckpointConfig& config) {
  twobp::run_rank_threads(
      twobp::make_local_transports(2),
      [&](twobp::Transport& t) {
        ck::save_checkpoint(dir, step, config, ranks[t.rank()].state(), t, kTimeout);
      },
      /*abort_on_error=*/false)
      .rethrow_root_cause();
}

std::vector<Rank> make_ranks(uint64_t seed) {
  const auto c = llm::config_by_name("tiny");
  const auto part = llm::make_partition(c, 2, 64, "2,2");
  std::vector<Rank> ranks;
  for (int r = 0; r < 2; ++r) ranks.emplace_back(c, part.chunks[r], seed);
  return ranks;
}

void expect_equal_state(const Rank& a, const Rank& b) {
  auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (std::size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
}

}  // namespace

TEST(Crc32, KnownValue) {
  const char* s = "123456789";
  EXPECT_EQ(ck::crc32(s, 9), 0xCBF43926u);
  EXPECT_EQ(ck::crc32(s + 4, 5, ck::crc32(s, 4)), 0xCBF43926u);
}

TEST(Checkpoint, RoundTripParametersAndOptimizerState) {
  const auto dir = fresh_dir("roundtrip");
  auto ranks = make_ranks(1);
  for (int s = 0; s < 3; ++s)
    for (auto& r : ranks) r.train_step(s);
  save_both(dir, 3, ranks, config_for("tiny"));
  EXPECT_TRUE(ck::checkpoint_exists(dir));

  auto restored = make_ranks(99);  // other initial weights, no optimizer state
  for (int r = 0; r < 2; ++r) {
    auto loaded = ck::load_checkpoint(dir, config_for("tiny"), r, 2);
    EXPECT_EQ(loaded.step, 3);
    ck::restore(loaded.tensors, restored[r].params, restored[r].optimizer.get());
    expect_equal_state(ranks[r], restored[r]);
  }
  // Training continues identically.
  for (int r = 0; r < 2; ++r) {
    ranks[r].train_step(3);
    restored[r].train_step(3);
    expect_equal_state(ranks[r], restored[r]);
  }
  remove_tree(parent_dir(dir));
}

TEST(Checkpoint, CorruptShardFailsChecksum) {
  const auto dir = fresh_dir("corrupt");
  auto ranks = make_ranks(1);
  save_both(dir, 1, ranks, config_for("tiny"));
  const auto shard = dir + "/shard-step1-rank1.bin";
  ASSERT_TRUE(file_exists(shard));
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(file_size(shard) / 2));
    f.put('\x5a');
  }
  EXPECT_NO_THROW(ck::load_checkpoint(dir, config_for("tiny"), 0, 2));
  try {
    ck::load_checkpoint(dir, config_for("tiny"), 1, 2);
    FAIL() << "expected IOError";
  } catch (const twobp::IOError& e) {
    EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(shard), std::string::npos) << e.what();
  }
  // A truncated shard is reported by size.
  ASSERT_EQ(::truncate(shard.c_str(), 100), 0);
  EXPECT_THROW(ck::load_checkpoint(dir, config_for("tiny"), 1, 2), twobp::IOError);
  remove_tree(parent_dir(dir));
}

TEST(Checkpoint, CrashMidSaveKeepsPreviousCheckpoint) {
  const auto dir = fresh_dir("crash");
  auto ranks = make_ranks(1);
  ranks[0].train_step(0);
  ranks[1].train_step(0);
  save_both(dir, 1, ranks, config_for("tiny"));
  auto saved = make_ranks(5);
  for (int r = 0; r < 2; ++r) {
    ck::restore(ck::load_checkpoint(dir, config_for("tiny"), r, 2).tensors, saved[r].params,
                saved[r].optimizer.get());
  }

  // Step 2 crashes: rank 0's shard is complete, rank 1 died mid-write (temp file, no rename), and the manifest
  // was never committed (a half-written temp manifest is lying around).
  ranks[0].train_step(1);
  ranks[1].train_step(1);
  ck::write_shard(dir, 2, 0, ranks[0].state());
  { std::ofstream(dir + "/shard-step2-rank1.bin.tmp") << "TWOBPCKP partial"; }
  { std::ofstream(dir + "/manifest.json.tmp") << "{\"format\": \"twobp-checkp"; }

  for (int r = 0; r < 2; ++r) {
    auto loaded = ck::load_checkpoint(dir, config_for("tiny"), r, 2);
    EXPECT_EQ(loaded.step, 1);
    auto fresh = make_ranks(6);
    ck::restore(loaded.tensors, fresh[r].params, fresh[r].optimizer.get());
    expect_equal_state(saved[r], fresh[r]);
  }
  // The next successful save cleans up the debris of the failed one.
  save_both(dir, 3, ranks, config_for("tiny"));
  EXPECT_FALSE(file_exists(dir + "/shard-step2-rank0.bin"));
  EXPECT_FALSE(file_exists(dir + "/shard-step2-rank1.bin.tmp"));
  EXPECT_FALSE(file_exists(dir + "/shard-step1-rank0.bin"));
  EXPECT_TRUE(file_exists(dir + "/shard-step3-rank1.bin"));
  remove_tree(parent_dir(dir));
}

TEST(Checkpoint, ConfigurationMismatchIsUsageError) {
  const auto dir = fresh_dir("mismatch");
  auto ranks = make_ranks(1);
  save_both(dir, 1, ranks, config_for("tiny"));
  try {
    ck::load_checkpoint(dir, config_for("small"), 0, 2);
    FAIL() << "expected UsageError";
  } catch (const twobp::UsageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("model=tiny"), std::string::npos) << what;
    EXPECT_NE(what.find("model=small"), std::string::npos) << what;
  }
  EXPECT_THROW(ck::load_checkpoint(dir, config_for("tiny"), 0, 4), twobp::UsageError);
  // Parameters of another partition: names do not match.
  const auto c = llm::config_by_name("tiny");
  Rank other(c, llm::make_partition(c, 2, 64, "1,3").chunks[0], 1);
  auto loaded = ck::load_checkpoint(dir, config_for("tiny"), 0, 2);
  EXPECT_THROW(ck::restore(loaded.tensors, other.params, other.optimizer.get()), twobp::UsageError);
  // No checkpoint at all.
  EXPECT_THROW(ck::load_checkpoint((dir + "/nothing"), config_for("tiny"), 0, 2), twobp::IOError);
  // Malformed manifest.
  { std::ofstream(dir + "/manifest.json") << "{ not json"; }
  EXPECT_THROW(ck::load_checkpoint(dir, config_for("tiny"), 0, 2), twobp::IOError);
  remove_tree(parent_dir(dir));
}
