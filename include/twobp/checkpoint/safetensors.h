#pragma once
// safetensors: Hugging Face's tensor file format, read and written without Python.
//
// File layout (little-endian):  uint64 N | N bytes of JSON header | data buffer
//   header: {"__metadata__": {str: str}  (optional),
//            "<name>": {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...}
//   Offsets are relative to the data buffer. As the reference implementation demands, the tensors tile the buffer
//   exactly: sorted by begin, each starts where the previous ends, the last ends at the end of the file, and
//   end - begin = product(shape) x the dtype's size. Unknown keys inside a tensor's entry are ignored (as the
//   reference reader does); everything else is checked.
//
// Sharded checkpoints (as transformers writes them): model-00001-of-00003.safetensors, ... and
// model.safetensors.index.json = {"metadata": {"total_size": bytes}, "weight_map": {"<name>": "<file>", ...}}.
//
// Errors: a file whose contents break the format (truncated, bad JSON, offsets outside the buffer or overlapping,
// a size that does not match dtype x shape, an unknown dtype, a duplicate name, an index naming a tensor its shard
// lacks) is a UsageError: one line naming the file and, where there is one, the tensor. The system failing (a file
// that cannot be opened, mapped or written) is an IOError naming the file and the system's reason.
//
// Reading maps the file (mmap, read-only, private): opening parses and validates only the header, and a tensor's
// bytes are touched only when it is read, so a pipeline rank reads only its own tensors. The file must not be
// truncated while mapped (the kernel would raise SIGBUS on access); replacing it by rename, as the writers below
// and transformers do, is safe.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "twobp/runtime/training_state.h"  // NamedTensors

namespace twobp::checkpoint {

/// The safetensors name of a dtype ("F32", "BF16", ...). UsageError for a type the format has no name for.
std::string safetensors_dtype_name(c10::ScalarType type);
/// The dtype of a safetensors name: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL F8_E4M3 F8_E5M2.
/// UsageError listing these for any other name (the format's F8_E8M0, F4, F6_*, C64 have no LibTorch type here).
c10::ScalarType parse_safetensors_dtype(const std::string& name);

/// One tensor of a safetensors header.
struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  ///< byte range within the data buffer
  uint64_t nbytes() const { return end - begin; }
};

/// One safetensors file, mapped. Thread-safe for concurrent reads; cheap to copy (the mapping is shared).
class SafetensorsFile {
 public:
  /// Maps `path` and validates its header (see the top of this file). UsageError / IOError as described there.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const;
  /// Every tensor, in the order of its data in the file.
  const std::vector<SafetensorsEntry>& entries() const;
  bool contains(const std::string& name) const;
  /// UsageError naming the file and the tensor when the file has no tensor of that name.
  const SafetensorsEntry& entry(const std::string& name) const;
  /// The header's "__metadata__" (empty when absent).
  const std::map<std::string, std::string>& metadata() const;

  /// The tensor as a new CPU tensor of its file dtype (a copy: later writes to it do not touch the file).
  at::Tensor read(const std::string& name) const;
  /// Copies the tensor into `dest` (any device; converted to dest's dtype, e.g. a bfloat16 file into float32
  /// masters). UsageError naming the file, the tensor and both shapes when dest's shape differs.
  void read_into(const std::string& name, const at::Tensor& dest) const;
  /// The tensor's bytes in the mapping, valid while any copy of this object lives.
  std::string_view bytes(const std::string& name) const;

  struct Mapped;  ///< the implementation's (src/checkpoint/safetensors.cpp)

 private:
  std::shared_ptr<const Mapped> m_;
};

/// A checkpoint of one safetensors file or of shards named by an index, opened by what `path` names:
///   a directory: DIR/model.safetensors if it exists, else DIR/model.safetensors.index.json (transformers' order);
///   a file ending in ".index.json": that index, its shards beside it;
///   any other file: that single safetensors file.
/// The index is validated when opened (JSON, "weight_map" of names to plain file names in the index's directory);
/// a shard is mapped the first time one of its tensors is asked for, and must hold exactly the tensors the index
/// assigns to it (UsageError naming the shard and a tensor otherwise). Thread-safe.
class SafetensorsCheckpoint {
 public:
  explicit SafetensorsCheckpoint(const std::string& path);

  /// What was opened: the single file or the index.
  const std::string& path() const;
  /// Every tensor name, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  /// The file holding `name` (its path). UsageError naming the checkpoint when there is no such tensor.
  std::string file_of(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;
  at::Tensor read(const std::string& name) const;
  void read_into(const std::string& name, const at::Tensor& dest) const;
  /// The (mapped) file holding `name`.
  const SafetensorsFile& file(const std::string& name) const;
  /// Maps every shard (their headers only), validating the index against them: to find a bad shard before reading.
  void open_all() const;

  struct State;  ///< the implementation's (src/checkpoint/safetensors.cpp)

 private:
  std::shared_ptr<State> s_;
};

// ---- Writing ----

/// The bytes of a safetensors file holding `tensors` (copied to the CPU, contiguous, their own dtypes) and
/// `metadata`, as the reference writer lays them out: data ordered by dtype (8-byte types first, so every tensor is
/// aligned to its element size) then name, header entries in that order after "__metadata__", the header padded
/// with spaces to a multiple of 8 bytes. UsageError for a duplicate name, the name "__metadata__" or a dtype the
/// format has no name for.
std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata = {});

/// Writes safetensors_bytes(...) to `path` whole or not at all (twobp::write_file; fsync'ed when `durable`).
void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata = {}, bool durable = true);

struct SafetensorsSaveOptions {
  std::map<std::string, std::string> metadata;  ///< every file's "__metadata__"
  /// 0: one file, <prefix>.safetensors. Otherwise shards of at most this many bytes of tensor data each (a tensor
  /// larger than the limit gets a shard of its own), filled in the order of `tensors`, plus the index.
  uint64_t max_shard_bytes = 0;
  std::string prefix = "model";
  bool durable = true;  ///< fsync every file and the directory (twobp::write_file)
};

/// Saves `tensors` in DIR (created if needed) as transformers does: <prefix>.safetensors, or shards
/// <prefix>-00001-of-0000K.safetensors and <prefix>.safetensors.index.json. A previous checkpoint of the same
/// prefix is removed first (its single file and index), stale shards after the new index is written: an
/// interrupted save leaves no loadable checkpoint of that prefix rather than a mix of old and new tensors.
/// Returns the file names written, the index last. Memory: one shard's bytes at a time.
std::vector<std::string> save_safetensors(const std::string& dir, const NamedTensors& tensors,
                                          const SafetensorsSaveOptions& options = {});

}  // namespace twobp::checkpoint
