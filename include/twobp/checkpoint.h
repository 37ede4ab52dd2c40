#pragma once
// Sharded checkpoints of a pipeline: every rank writes the tensors it owns (parameters and optimizer state) to its
// own shard file; rank 0 then writes a JSON manifest naming the shards with their sizes and CRC-32 checksums and
// the configuration they were written for.
//
// Directory layout (one checkpoint directory holds the latest complete checkpoint):
//   DIR/manifest.json                     the commit record, written last (temp file, fsync, rename, fsync DIR)
//   DIR/shard-step<S>-rank<R>.bin         one per rank; the step is in the name so that writing step S+1 never
//                                         touches the files the current manifest points at
// Crash safety: a shard is written to "<name>.tmp", fsync'ed and renamed; the manifest is replaced atomically only
// after every rank's shard is complete. A crash at any point leaves the previous manifest and the shards it names
// intact, so the previous checkpoint stays loadable. After committing, rank 0 removes shard and temp files of other
// steps (best effort). The directory must be shared by all ranks (one machine or a shared filesystem).
//
// Shard format (little-endian):
//   "TWOBPCKP" | uint32 version=1 | uint32 count | count × { uint32 name_len | name | uint8 dtype (c10::ScalarType)
//   | uint32 ndim | ndim × int64 dims | uint64 nbytes | raw contiguous CPU bytes }
// The CRC-32 (IEEE 802.3, zlib's polynomial) of the whole file is stored in the manifest, so corruption anywhere
// (including a truncated file) is caught before anything is parsed.
//
// Manifest (JSON): {"format": "twobp-checkpoint", "version": 1, "step": S, "world_size": W,
//                   "config": {"model": "...", "stages": "4", ...},
//                   "shards": [{"rank": r, "file": "...", "bytes": n, "crc32": c}, ...]}

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "twobp/transport/transport.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class AdamW;
}

namespace twobp::checkpoint {

/// Tensors by unique name, in a stable order.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// What a checkpoint was written for (e.g. model, stages, world_size, schedule, partition). Loading compares every
/// key of the expected configuration with the manifest's and raises UsageError naming the first mismatch.
using CheckpointConfig = std::map<std::string, std::string>;

/// CRC-32 (reflected polynomial 0xEDB88320, as zlib's crc32); `crc` continues a previous value.
uint32_t crc32(const void* data, std::size_t size, uint32_t crc = 0);

struct ShardInfo {
  int rank = 0;
  std::string file;  ///< file name relative to the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct Manifest {
  int64_t step = 0;
  int world_size = 1;
  CheckpointConfig config;
  std::vector<ShardInfo> shards;  ///< one per rank, by rank
};

// ---- Low-level pieces (the collective functions below combine them) ----

/// Serialises `tensors` (copied to CPU, contiguous) to DIR/shard-step<step>-rank<rank>.bin through a fsync'ed
/// temp file and a rename; creates DIR if needed. Throws IOError naming the file.
ShardInfo write_shard(const std::string& dir, int64_t step, int rank, const NamedTensors& tensors);

/// Atomically replaces DIR/manifest.json, then removes shard files of other steps. Throws IOError.
void write_manifest(const std::string& dir, const Manifest& manifest);

/// Reads DIR/manifest.json. Throws IOError naming the file for a missing or malformed manifest.
Manifest read_manifest(const std::string& dir);

/// Throws UsageError when `expected` disagrees with the manifest (naming the key, both values and the directory),
/// or when the manifest's world size differs from `world_size`.
void check_config(const std::string& dir, const Manifest& manifest, const CheckpointConfig& expected, int world_size);

/// Reads and verifies (size, CRC-32, format) the shard of `rank`. Throws IOError naming the file and what failed.
NamedTensors read_shard(const std::string& dir, const Manifest& manifest, int rank);

// ---- Collective save/load: every rank calls them ----

/// Writes this rank's shard, gathers every shard's size and checksum with one all_reduce_sum, lets rank 0 commit
/// the manifest, and ends with a barrier so that no rank returns before the checkpoint is complete.
void save_checkpoint(const std::string& dir, int64_t step, const CheckpointConfig& config,
                     const NamedTensors& tensors, Transport& transport, Duration timeout);

/// True when DIR/manifest.json exists.
bool checkpoint_exists(const std::string& dir);

struct LoadedCheckpoint {
  int64_t step = 0;
  NamedTensors tensors;
};

/// Reads the manifest, checks configuration and world size, and returns this rank's verified tensors. Purely
/// local (no communication), so a rank that fails raises before any training step.
LoadedCheckpoint load_checkpoint(const std::string& dir, const CheckpointConfig& expected, int rank, int world_size);

// ---- Module and optimizer state ----

/// Parameters and buffers of `module`, named "<prefix><name>". Tied parameters (the same tensor under two names)
/// appear once, under the first name.
NamedTensors module_tensors(const torch::nn::Module& module, const std::string& prefix = {});

/// AdamW state of `params` (name -> parameter), as "optim.<name>.exp_avg", ".exp_avg_sq", ".step" (int64 scalar)
/// and ".max_exp_avg_sq" when amsgrad. Parameters the optimizer has not stepped yet have no entries.
NamedTensors adamw_state_tensors(const torch::optim::AdamW& optimizer, const NamedTensors& params);

/// Copies every tensor of `params` from `loaded` (same name, shape and dtype; converted to the parameter's device)
/// and restores AdamW state for them from the "optim.*" entries. Throws UsageError naming the first parameter that
/// is missing or has another shape (the checkpoint belongs to another model or partition), and for unknown names
/// left over in `loaded`.
void restore(const NamedTensors& loaded, const NamedTensors& params, torch::optim::AdamW* optimizer);

}  // namespace twobp::checkpoint
