// Sharded checkpoints: round trip of parameters and AdamW state, checksum verification, crash safety,
// configuration checks, and checkpoints of dp replicas of a pipeline (one copy per stage, any replica resumes).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

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

// The ranks of a `stages`-chunk partition of the tiny model (each chunk names its blocks by global layer).
std::vector<Rank> make_layout(int stages, const std::string& partition, uint64_t seed) {
  const auto c = llm::config_by_name("tiny");
  const auto part = llm::make_partition(c, stages, 64, partition);
  std::vector<Rank> ranks;
  for (int r = 0; r < stages; ++r) ranks.emplace_back(c, part.chunks[r], seed);
  return ranks;
}

std::vector<Rank> make_ranks(uint64_t seed) { return make_layout(2, "2,2", seed); }

// Damages one byte of a file in place.
void overwrite_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put('\x5a');
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
  overwrite_byte(shard, file_size(shard) / 2);
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

// ---- Data parallelism: world = dp x pp ranks, replica = world rank / pp, pipeline rank = world rank % pp ----

namespace {

// One rank of a dp x pp job, with its groups split from the world exactly as the layout says.
struct DpRank {
  twobp::Transport* world = nullptr;
  int replica = 0;
  int pipeline_rank = 0;
  std::unique_ptr<twobp::Transport> pipeline;       // the replica's pipeline: rank = pipeline rank
  std::unique_ptr<twobp::Transport> data_parallel;  // same pipeline rank in every replica: rank = replica
  int dp = 1;

  ck::DataParallelCheckpoint dpc() const { return {dp, replica, data_parallel.get()}; }
};

// Runs body on dp x pp threads over LocalTransports and rethrows the first rank's failure.
void run_dp_pp(int dp, int pp, const std::function<void(DpRank&)>& body) {
  twobp::run_rank_threads(twobp::make_local_transports(dp * pp), [&](twobp::Transport& world) {
    DpRank r;
    r.world = &world;
    r.dp = dp;
    r.replica = world.rank() / pp;
    r.pipeline_rank = world.rank() % pp;
    // Both splits are collectives over the world: every rank makes them in the same order.
    r.pipeline = world.split(/*color=*/r.replica, /*key=*/r.pipeline_rank, kTimeout);
    r.data_parallel = world.split(/*color=*/r.pipeline_rank, /*key=*/r.replica, kTimeout);
    EXPECT_EQ(r.pipeline->rank(), r.pipeline_rank);
    EXPECT_EQ(r.pipeline->world_size(), pp);
    EXPECT_EQ(r.data_parallel->rank(), r.replica);
    EXPECT_EQ(r.data_parallel->world_size(), dp);
    body(r);
  }).rethrow_root_cause();
}

// The tensors stage `stage` owns at `step`: distinct per stage and step, identical on every replica (as data
// parallelism keeps them), several dtypes so that the comparison is bitwise for each. `offset` != 0 makes a copy
// that differs (a replica that must not be written).
ck::NamedTensors stage_tensors(int stage, int64_t step, double offset = 0) {
  const std::string s = "stage" + std::to_string(stage);
  return {{s + ".weight", torch::sin(torch::arange(12, torch::kFloat).reshape({3, 4}) * (stage + 1) + step) + offset},
          {s + ".norm", torch::full({5}, 0.25 * (stage + 1) + step + offset, torch::kBFloat16)},
          {"optim." + s + ".weight.step", torch::scalar_tensor(100 * step + stage + offset, torch::kLong)}};
}

void expect_bitwise(const ck::NamedTensors& got, const ck::NamedTensors& want, const std::string& who) {
  ASSERT_EQ(got.size(), want.size()) << who;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << who;
    EXPECT_EQ(got[i].second.scalar_type(), want[i].second.scalar_type()) << who << " " << want[i].first;
    EXPECT_TRUE(torch::equal(got[i].second, want[i].second)) << who << " " << want[i].first;
  }
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(slurp(path)); }

void write_json(const std::string& path, const nlohmann::json& j) { std::ofstream(path) << j.dump(2) << "\n"; }

// Every rank of a dp x pp job saves stage_tensors(pipeline rank, step).
void save_dp_pp(const std::string& dir, int64_t step, const ck::CheckpointConfig& config, int dp, int pp) {
  run_dp_pp(dp, pp, [&](DpRank& r) {
    ck::save_checkpoint(dir, step, config, stage_tensors(r.pipeline_rank, step), *r.pipeline, kTimeout, r.dpc());
  });
}

template <typename E>
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

void expect_contains(const std::string& what, const std::vector<std::string>& parts) {
  for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' in: " << what;
}

}  // namespace

TEST(DataParallelCheckpoint, OneCopyPerStageThatEveryReplicaLoads) {
  const auto dir = fresh_dir("dp_save");
  const auto config = config_for("tiny");
  const auto delay = std::chrono::milliseconds(200);
  run_dp_pp(2, 2, [&](DpRank& r) {
    // Step 1: replica 0 (the writer) starts late. Replica 1 writes nothing, so only the data-parallel barrier keeps
    // it from returning, and loading, before the manifest exists.
    if (r.replica == 0) std::this_thread::sleep_for(delay);
    ck::save_checkpoint(dir, 1, config, stage_tensors(r.pipeline_rank, 1), *r.pipeline, kTimeout, r.dpc());
    auto loaded = ck::load_checkpoint(dir, config, r.pipeline_rank, 2, r.dpc());
    const std::string who = "replica " + std::to_string(r.replica) + " stage " + std::to_string(r.pipeline_rank);
    EXPECT_EQ(loaded.step, 1) << who;
    expect_bitwise(loaded.tensors, stage_tensors(r.pipeline_rank, 1), who + " step 1");
    // Nobody may still be reading step 1 when step 2's commit removes its shards.
    r.world->barrier(kTimeout);

    // Step 2: replica 1 starts late and hands in tensors that differ from replica 0's. A save that read or wrote
    // them would replace replica 0's committed files after the fact; a correct one ignores them.
    if (r.replica == 1) std::this_thread::sleep_for(delay);
    ck::save_checkpoint(dir, 2, config, stage_tensors(r.pipeline_rank, 2, r.replica == 0 ? 0.0 : 1000.0),
                        *r.pipeline, kTimeout, r.dpc());
    loaded = ck::load_checkpoint(dir, config, r.pipeline_rank, 2, r.dpc());
    EXPECT_EQ(loaded.step, 2) << who;
    expect_bitwise(loaded.tensors, stage_tensors(r.pipeline_rank, 2), who + " step 2");
  });

  // One copy per stage: pp shards (step 1's were collected), no temp files, the manifest records dp and pp.
  EXPECT_EQ(files_in(dir),
            (std::vector<std::string>{"manifest.json", "shard-step2-rank0.bin", "shard-step2-rank1.bin"}));
  const auto m = ck::read_manifest(dir);
  EXPECT_EQ(m.step, 2);
  EXPECT_EQ(m.dp, 2);
  EXPECT_EQ(m.world_size, 2);
  EXPECT_EQ(m.shards.size(), 2u);
  const auto j = read_json(dir + "/manifest.json");
  EXPECT_EQ(j.at("dp").get<int>(), 2);
  EXPECT_EQ(j.at("pp").get<int>(), 2);
  EXPECT_EQ(j.at("world_size").get<int>(), 2);

  // Replica-independent: dp=1 (no data parallelism, the default) and dp=3 resume from it.
  for (int stage = 0; stage < 2; ++stage) {
    expect_bitwise(ck::load_checkpoint(dir, config, stage, 2).tensors, stage_tensors(stage, 2), "dp=1");
    expect_bitwise(ck::load_checkpoint(dir, config, stage, 2, {3, 2, nullptr}).tensors, stage_tensors(stage, 2),
                   "dp=3 replica 2");
  }
  // The shards are those a single pipeline (dp=1) writes for the same state, byte for byte.
  const auto single = fresh_dir("dp_single");
  save_dp_pp(single, 2, config, /*dp=*/1, /*pp=*/2);
  for (const char* shard : {"/shard-step2-rank0.bin", "/shard-step2-rank1.bin"}) {
    EXPECT_EQ(slurp(dir + shard), slurp(single + shard)) << shard;
  }
  EXPECT_EQ(ck::read_manifest(single).dp, 1);
  remove_tree(parent_dir(single));
  remove_tree(parent_dir(dir));
}

TEST(DataParallelCheckpoint, OtherPipelineSizeIsRefused) {
  const auto dir = fresh_dir("dp_pp");
  const auto config = config_for("tiny");
  save_dp_pp(dir, 5, config, /*dp=*/2, /*pp=*/2);
  // A pipeline of 4 ranks (say dp=1 x pp=4 on the same 4 GPUs) cannot use 2 shards.
  const std::string what = message_of<twobp::UsageError>(
      [&] { ck::load_checkpoint(dir, config, 1, 4, {2, 1, nullptr}); });
  expect_contains(what, {dir, "pipeline rank 1 of replica 1", "pp=2", "pp=4", "dp=2 replicas", "resume with pp=2"});
  EXPECT_THROW(ck::load_checkpoint(dir, config, 0, 1), twobp::UsageError);
  // The same pp with another dp is fine (checked above for dp=1 and 3); a replica outside its dp is not.
  expect_contains(message_of<twobp::UsageError>([&] { ck::load_checkpoint(dir, config, 0, 2, {2, 2, nullptr}); }),
                  {dir, "replica 2 of dp=2"});
  remove_tree(parent_dir(dir));
}

TEST(DataParallelCheckpoint, InconsistentDataParallelArgumentIsRefusedBeforeWriting) {
  const auto dir = fresh_dir("dp_args");
  auto ts = twobp::make_local_transports(1);
  const auto tensors = stage_tensors(0, 1);
  // dp > 1 without the group: the other replicas could not be held until the commit.
  expect_contains(message_of<twobp::UsageError>([&] {
                    ck::save_checkpoint(dir, 1, config_for("tiny"), tensors, *ts[0], kTimeout, {2, 0, nullptr});
                  }),
                  {dir, "pipeline rank 0 of replica 0 (dp=2)", "data-parallel group", "null"});
  // A group that is not one rank per replica (here: 1 rank for dp=2).
  expect_contains(message_of<twobp::UsageError>([&] {
                    ck::save_checkpoint(dir, 1, config_for("tiny"), tensors, *ts[0], kTimeout, {2, 0, ts[0].get()});
                  }),
                  {dir, "group of 1 ranks", "dp=2"});
  EXPECT_THROW(ck::save_checkpoint(dir, 1, config_for("tiny"), tensors, *ts[0], kTimeout, {0, 0, nullptr}),
               twobp::UsageError);
  EXPECT_FALSE(file_exists(dir));  // refused before anything was written
}

TEST(DataParallelCheckpoint, ManifestWithoutDpReadsAsOneReplica) {
  const auto dir = fresh_dir("dp_old");
  auto ranks = make_ranks(1);
  ranks[0].train_step(0);
  ranks[1].train_step(0);
  save_both(dir, 1, ranks, config_for("tiny"));  // the API without data parallelism
  const std::string path = dir + "/manifest.json";
  auto j = read_json(path);
  EXPECT_EQ(j.at("dp").get<int>(), 1);
  EXPECT_EQ(j.at("pp").get<int>(), 2);
  // A manifest written before "dp" and "pp" existed.
  j.erase("dp");
  j.erase("pp");
  write_json(path, j);
  const auto m = ck::read_manifest(dir);
  EXPECT_EQ(m.dp, 1);
  EXPECT_EQ(m.world_size, 2);
  for (int r = 0; r < 2; ++r) {
    for (const ck::DataParallelCheckpoint& dpc : {ck::DataParallelCheckpoint{}, ck::DataParallelCheckpoint{2, 1}}) {
      auto loaded = ck::load_checkpoint(dir, config_for("tiny"), r, 2, dpc);
      EXPECT_EQ(loaded.step, 1);
      expect_bitwise(loaded.tensors, ranks[r].state(), "rank " + std::to_string(r) + " dp=" + std::to_string(dpc.dp));
    }
  }
  // "pp" and "world_size" are one fact: a manifest where they disagree is malformed.
  j["pp"] = 3;
  write_json(path, j);
  EXPECT_THROW(ck::read_manifest(dir), twobp::IOError);
  remove_tree(parent_dir(dir));
}


// The manifest's step is checked against the shards' names: every edit (another step, negative, huge) is refused
// as an edited manifest, by read_manifest and by both loaders, before a rank resumes at a wrong step.
TEST(Checkpoint, AnEditedStepIsDiagnosedAsSuch) {
  const auto dir = fresh_dir("edited_step");
  auto ranks = make_ranks(1);
  ranks[0].train_step(0);
  ranks[1].train_step(0);
  save_both(dir, 3, ranks, config_for("tiny"));
  const std::string path = dir + "/manifest.json";
  const auto original = read_json(path);
  for (int64_t edited : {int64_t{0}, int64_t{2}, int64_t{4}, int64_t{-1}, int64_t{1} << 40}) {
    auto j = original;
    j["step"] = edited;
    write_json(path, j);
    const std::string what = "step " + std::to_string(edited);
    for (const std::function<void()>& load :
         {std::function<void()>([&] { ck::read_manifest(dir); }),
          std::function<void()>([&] { ck::load_checkpoint(dir, config_for("tiny"), 0, 2); })}) {
      try {
        load();
        ADD_FAILURE() << "an edited manifest (" << what << ") was accepted";
      } catch (const twobp::IOError& e) {
        EXPECT_NE(std::string(e.what()).find("says " + what), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("edited"), std::string::npos) << e.what();
      }
    }
  }
  write_json(path, original);
  EXPECT_EQ(ck::load_checkpoint(dir, config_for("tiny"), 1, 2).step, 3);
  remove_tree(parent_dir(dir));
}

// A checkpoint of 2 ranks loads by name into 4 ranks (a block each) and into 1 rank (everything): every tensor and
// its optimizer state is where the new layout needs it, bit for bit, and training continues identically.
TEST(LoadByName, AnyLayoutGetsItsTensorsWhereverTheyWere) {
  const auto dir = fresh_dir("by_name");
  auto ranks = make_ranks(1);
  for (int s = 0; s < 2; ++s)
    for (auto& r : ranks) r.train_step(s);
  save_both(dir, 2, ranks, config_for("tiny"));
  std::map<std::string, at::Tensor> saved;
  for (const auto& r : ranks) {
    for (const auto& [name, t] : r.state()) saved.emplace(name, t);
  }
  for (const auto& [stages, partition] : std::vector<std::pair<int, std::string>>{{4, "1,1,1,1"}, {1, "4"}}) {
    SCOPED_TRACE(std::to_string(stages) + " ranks");
    auto other = make_layout(stages, partition, 99);  // other weights, no optimizer state
    std::size_t seen = 0;
    for (int r = 0; r < stages; ++r) {
      // The layout keys of the manifest (stages, partition) are not compared: only what is expected.
      auto loaded = ck::load_checkpoint_by_name(dir, {{"model", "tiny"}}, ck::state_of(other[r].params),
                                                "rank " + std::to_string(r));
      EXPECT_EQ(loaded.step, 2);
      ck::restore(loaded.tensors, other[r].params, other[r].optimizer.get());
      for (const auto& [name, t] : other[r].state()) {
        ASSERT_TRUE(saved.count(name)) << name;
        EXPECT_TRUE(torch::equal(t, saved.at(name))) << name;
        ++seen;
      }
    }
    EXPECT_EQ(seen, saved.size()) << "every saved tensor lands on exactly one rank";
  }
  remove_tree(parent_dir(dir));
}

// Only the shards holding a wanted tensor are read (and verified): a damaged shard fails exactly the loads that
// need it, naming it. A checkpoint holding one name in two shards is refused, naming both.
TEST(LoadByName, ReadsAndVerifiesTheShardsItNeeds) {
  const auto dir = fresh_dir("by_name_corrupt");
  auto ranks = make_ranks(1);
  save_both(dir, 1, ranks, config_for("tiny"));
  const auto shard = dir + "/shard-step1-rank1.bin";
  overwrite_byte(shard, file_size(shard) - 8);  // inside the last tensor's data
  auto first = make_layout(2, "2,2", 7);
  EXPECT_NO_THROW(ck::load_checkpoint_by_name(dir, {}, ck::state_of(first[0].params), "rank 0"));
  try {
    ck::load_checkpoint_by_name(dir, {}, ck::state_of(first[1].params), "rank 1");
    FAIL() << "expected IOError";
  } catch (const twobp::IOError& e) {
    EXPECT_NE(std::string(e.what()).find("CRC-32 mismatch"), std::string::npos) << e.what();
  }
  // A configuration mismatch names this rank.
  try {
    ck::load_checkpoint_by_name(dir, {{"model", "7b"}}, ck::state_of(first[0].params), "rank 0 (replica 1)");
    FAIL() << "expected UsageError";
  } catch (const twobp::UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 (replica 1)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model=tiny"), std::string::npos) << e.what();
  }
  remove_tree(parent_dir(dir));

  const auto twice = fresh_dir("by_name_twice");
  std::vector<Rank> same = make_layout(2, "2,2", 3);
  same[1] = std::move(make_layout(2, "2,2", 3)[0]);  // both ranks hold stage 0's tensors
  save_both(twice, 1, same, config_for("tiny"));
  try {
    ck::load_checkpoint_by_name(twice, {}, ck::state_of(same[0].params), "rank 0");
    FAIL() << "expected IOError";
  } catch (const twobp::IOError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks 0 and 1"), std::string::npos) << e.what();
  }
  remove_tree(parent_dir(twice));
}

TEST(LoadByName, StateOfMatchesParametersAndTheirOptimizerState) {
  const ck::NamedTensors params = {{"layers.1.wq.weight", at::Tensor()}, {"embed.weight", at::Tensor()}};
  const auto wanted = ck::state_of(params);
  EXPECT_TRUE(wanted("layers.1.wq.weight"));
  EXPECT_TRUE(wanted("optim.layers.1.wq.weight.exp_avg_sq"));
  EXPECT_TRUE(wanted("optim.embed.weight.step"));
  EXPECT_FALSE(wanted("layers.1.wk.weight"));
  EXPECT_FALSE(wanted("optim.layers.1.wq.exp_avg"));
  EXPECT_FALSE(wanted("optim.layers.1.wq.weight"));  // "optim.<name>" without a field
  EXPECT_FALSE(wanted("layers.1.wq.weight.exp_avg"));
}
