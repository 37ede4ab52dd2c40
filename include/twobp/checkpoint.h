#pragma once
// Sharded checkpoints of a pipeline: every pipeline rank writes the tensors it owns (parameters and optimizer state)
// to its own shard file; pipeline rank 0 then writes a JSON manifest naming the shards with their sizes and CRC-32
// checksums and the configuration they were written for.
//
// Data parallelism (world = dp x pp ranks, dp replicas of one pipeline of pp ranks): after every step all replicas
// hold identical parameters and optimizer state, so a checkpoint is replica-independent: it holds one copy per
// stage, written by replica 0 only (DataParallelCheckpoint), and any replica loads the shard of its pipeline rank.
// Hence "rank" below always means the pipeline rank (0 .. pp-1), never the world rank; the number of shards is pp.
// A checkpoint written with dp = D resumes with any number of replicas (dp may change between runs). pp may not
// change under load_checkpoint (by rank); load_checkpoint_by_name loads into any layout (pp, dp, chunks per rank,
// partition), when the tensors carry global names (a parameter's name does not depend on which chunk holds it).
//
// Directory layout (one checkpoint directory holds the latest complete checkpoint):
//   DIR/manifest.json                     the commit record, written last (temp file, fsync, rename, fsync DIR)
//   DIR/shard-step<S>-rank<R>.bin         one per pipeline rank R (pp files, whatever dp was); the step is in the
//                                         name so that writing step S+1 never touches the files the current
//                                         manifest points at
// Crash safety: a shard is written to "<name>.tmp", fsync'ed and renamed; the manifest is replaced atomically only
// after every pipeline rank's shard is complete. A crash at any point leaves the previous manifest and the shards
// it names intact, so the previous checkpoint stays loadable. After committing, pipeline rank 0 of replica 0 removes
// shard and temp files of other steps (best effort). The directory must be shared by all ranks of replica 0 (one
// machine or a shared filesystem), and visible to every rank that resumes from it.
//
// Shard format (little-endian):
//   "TWOBPCKP" | uint32 version=1 | uint32 count | count × { uint32 name_len | name | uint8 dtype (c10::ScalarType)
//   | uint32 ndim | ndim × int64 dims | uint64 nbytes | raw contiguous CPU bytes }
// The CRC-32 (IEEE 802.3, zlib's polynomial) of the whole file is stored in the manifest, so corruption anywhere
// (including a truncated file) is caught before anything is parsed.
//
// Manifest (JSON): {"format": "twobp-checkpoint", "version": 1, "step": S, "world_size": P, "pp": P, "dp": D,
//                   "config": {"model": "...", "stages": "4", ...},
//                   "shards": [{"rank": r, "file": "...", "bytes": n, "crc32": c}, ...]}
// "world_size" is the number of shards = the pipeline world size pp (its meaning since version 1; "pp" repeats it
// under the name used with data parallelism, and must agree with it). "dp" records how many replicas trained when
// the checkpoint was written: information only, never checked on load. Manifests written before "dp" and "pp"
// existed read as dp = 1, pp = world_size; readers that predate them ignore them, so the version stays 1.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "twobp/runtime/training_state.h"  // NamedTensors, module_tensors, restore, ...
#include "twobp/transport/transport.h"

namespace twobp::checkpoint {

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
  int world_size = 1;  ///< pipeline world size pp = number of shards (JSON "world_size" and "pp")
  int dp = 1;          ///< replicas when written (JSON "dp"; 1 for manifests without it); not checked on load
  CheckpointConfig config;
  std::vector<ShardInfo> shards;  ///< one per pipeline rank, by rank
};

/// Where this rank's pipeline sits in data parallelism, for save_checkpoint and load_checkpoint. The default
/// (dp = 1, replica 0, no group) is a pipeline without data parallelism.
///
/// With the world = dp x pp layout, world rank w is pipeline rank w % pp of replica w / pp, and the data-parallel
/// group of a rank is the transport of the ranks holding its pipeline rank in every replica, ordered by replica:
///   auto pipeline_group = world.split(/*color=*/replica, /*key=*/pipeline_rank, timeout);
///   auto dp_group       = world.split(/*color=*/pipeline_rank, /*key=*/replica, timeout);
///   ck::DataParallelCheckpoint dpc{dp, replica, dp_group.get()};
struct DataParallelCheckpoint {
  int dp = 1;                  ///< number of replicas (>= 1)
  int replica = 0;             ///< this rank's replica, 0 .. dp-1; equals group->rank()
  Transport* group = nullptr;  ///< this rank's data-parallel group (world_size() == dp); nullptr when dp == 1
};

// ---- Low-level pieces (the collective functions below combine them) ----

/// Serialises `tensors` (copied to CPU, contiguous) to DIR/shard-step<step>-rank<rank>.bin through a fsync'ed
/// temp file and a rename; creates DIR if needed. Throws IOError naming the file.
ShardInfo write_shard(const std::string& dir, int64_t step, int rank, const NamedTensors& tensors);

/// Atomically replaces DIR/manifest.json, then removes shard files of other steps. Throws IOError.
void write_manifest(const std::string& dir, const Manifest& manifest);

/// Reads DIR/manifest.json. Throws IOError naming the file for a missing or malformed manifest, and for a step
/// that is negative or disagrees with the shards' names (an edited manifest).
Manifest read_manifest(const std::string& dir);

/// Throws UsageError when `expected` disagrees with the manifest (naming the key, both values and the directory),
/// or when the manifest's pipeline world size (pp, its number of shards) differs from `world_size`, this run's
/// pipeline world size (pp, not dp x pp). The manifest's dp is not compared: any number of replicas may resume.
void check_config(const std::string& dir, const Manifest& manifest, const CheckpointConfig& expected, int world_size);
/// The configuration only (any pipeline world size): for checkpoints loaded by name.
void check_config(const std::string& dir, const Manifest& manifest, const CheckpointConfig& expected);

/// Reads and verifies (size, CRC-32, format) the shard of `rank`. Throws IOError naming the file and what failed.
NamedTensors read_shard(const std::string& dir, const Manifest& manifest, int rank);

// ---- Collective save/load: every rank calls them ----

/// Saves checkpoint `step` of the pipeline in DIR. Collective: every rank of the job calls it, with `pipeline` =
/// the transport of its pipeline (its group with data parallelism: rank() = pipeline rank, world_size() = pp), the
/// same `step` and `config`, and the tensors it owns (identical across replicas, as data parallelism keeps them).
///
/// Replica 0 (always, when dp = 1): each pipeline rank writes its shard, one all_reduce_sum over `pipeline` gathers
/// every shard's size and checksum, pipeline rank 0 commits the manifest (recording pp and data_parallel.dp), and
/// a barrier over `pipeline` holds every rank until the manifest is committed.
/// Other replicas write nothing: their tensors are copies of replica 0's (not even read).
/// Then, when data_parallel.group is set, every rank waits on a barrier over its data-parallel group, so that no
/// rank of any replica returns before the checkpoint is committed (a rank may then load it, or stop the job).
///
/// `timeout` bounds each wait; the data-parallel barrier of replicas > 0 also covers the time replica 0 takes to
/// write, so it must exceed that. A rank of replica 0 that fails (IOError) throws; the other ranks then throw
/// TimeoutError or, where the failing rank aborted its transports, TransportError, and the previous checkpoint
/// stays the committed one. Throws UsageError, before any communication, for an inconsistent `data_parallel`
/// (dp < 1, replica outside 0 .. dp-1, dp > 1 without a group, or a group whose size and rank are not dp and
/// replica) on the rank that passed it; its peers then time out like above.
void save_checkpoint(const std::string& dir, int64_t step, const CheckpointConfig& config,
                     const NamedTensors& tensors, Transport& pipeline, Duration timeout,
                     const DataParallelCheckpoint& data_parallel = {});

/// True when DIR/manifest.json exists.
bool checkpoint_exists(const std::string& dir);

struct LoadedCheckpoint {
  int64_t step = 0;
  NamedTensors tensors;
};

/// Reads the manifest, checks configuration and pipeline world size, and returns the verified tensors of pipeline
/// rank `rank` (of `world_size` = pp pipeline ranks). Purely local (no communication), so a rank that fails raises
/// before any training step.
///
/// With data parallelism every replica calls it with its own pipeline rank and gets the same stage's tensors:
/// the checkpoint does not depend on the replica, and data_parallel.dp may differ from the dp it was written with
/// (resume a dp = 2 run with dp = 1, or the other way round). Only data_parallel.dp and .replica are read, to check
/// them and to name this rank in errors; the group is not used. A manifest whose pp differs from `world_size` is a
/// UsageError naming both, the directory and this rank.
LoadedCheckpoint load_checkpoint(const std::string& dir, const CheckpointConfig& expected, int rank, int world_size,
                                 const DataParallelCheckpoint& data_parallel = {});

/// Layout-independent load: every tensor for which `wanted(name)` holds, from whichever shards hold it, after
/// checking the configuration (not the pipeline world size: the checkpoint may come from any pp, dp, partition).
/// Names must be global -- the same whichever chunk, stage or rank holds the tensor -- as a model whose chunks name
/// their layers by global index gives them (twobp::models::LlamaChunk). Reads each shard's names by seeking past
/// its data, then reads (and verifies: size, CRC-32, format) only the shards holding a wanted tensor. Purely
/// local. `who` names this rank in errors. IOError for a name held by two shards or a damaged shard; a wanted
/// name that no shard holds is left for restore() to report (naming it).
LoadedCheckpoint load_checkpoint_by_name(const std::string& dir, const CheckpointConfig& expected,
                                         const std::function<bool(const std::string&)>& wanted,
                                         const std::string& who);

// The module and optimizer state under the names a checkpoint stores (module_tensors, adamw_state_tensors,
// restore, state_of, optimizer_state_name): twobp/runtime/training_state.h, included above.

}  // namespace twobp::checkpoint
