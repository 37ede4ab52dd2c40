#include "twobp/checkpoint.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include <fmt/ranges.h>

#include "twobp/files.h"
#include "util/check.h"

namespace twobp::checkpoint {

namespace {

// File-system helpers on POSIX calls. std::filesystem is avoided on purpose: libtorch.so exports its own copies of
// std::filesystem functions (e.g. remove_all), which can bind in place of libstdc++'s and crash.
std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

constexpr char kMagic[8] = {'T', 'W', 'O', 'B', 'P', 'C', 'K', 'P'};
constexpr uint32_t kShardVersion = 1;
constexpr int kManifestVersion = 1;
constexpr const char* kManifestName = "manifest.json";

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

std::string shard_name(int64_t step, int rank) { return fmt::format("shard-step{}-rank{}.bin", step, rank); }

template <typename T>
void put_le(std::string& out, T value) {
  using U = std::make_unsigned_t<T>;
  const U u = static_cast<U>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  TWOBP_CHECK(in.is_open(), IOError, "checkpoint: cannot open {} {}", what, path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TWOBP_CHECK(!in.bad(), IOError, "checkpoint: reading {} {} failed", what, path);
  return bytes;
}

// Bounds-checked little-endian reader over a shard's bytes.
struct Reader {
  const std::string& bytes;
  const std::string& file;
  std::size_t pos = 0;

  const char* take(std::size_t n, const char* what) {
    TWOBP_CHECK(n <= bytes.size() - pos, IOError, "checkpoint shard {}: truncated {} at offset {} (needs {} bytes, {} left)",
                file, what, pos, n, bytes.size() - pos);
    const char* p = bytes.data() + pos;
    pos += n;
    return p;
  }
  template <typename T>
  T get(const char* what) {
    const auto* p = reinterpret_cast<const unsigned char*>(take(sizeof(T), what));
    std::make_unsigned_t<T> u = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) u |= static_cast<std::make_unsigned_t<T>>(p[i]) << (8 * i);
    return static_cast<T>(u);
  }
};

// "rank 1" without data parallelism, "pipeline rank 1 of replica 0 (dp=2)" with it: who is speaking in an error.
std::string who(int rank, const DataParallelCheckpoint& dp) {
  return dp.dp == 1 && dp.replica == 0 ? fmt::format("rank {}", rank)
                                       : fmt::format("pipeline rank {} of replica {} (dp={})", rank, dp.replica, dp.dp);
}

// Refuses an inconsistent DataParallelCheckpoint before any file or message is touched. `saving`: the group is
// needed (save waits on it); loading only reads dp and replica.
void check_data_parallel(const std::string& dir, int rank, const DataParallelCheckpoint& dp, bool saving) {
  const char* what = saving ? "saving" : "loading";
  TWOBP_CHECK(dp.dp >= 1, UsageError,
              "checkpoint {}: rank {} is {} with dp={} (DataParallelCheckpoint::dp, the number of replicas): it must "
              "be at least 1",
              dir, rank, what, dp.dp);
  TWOBP_CHECK(dp.replica >= 0 && dp.replica < dp.dp, UsageError,
              "checkpoint {}: rank {} is {} as replica {} of dp={}: the replica must be in 0 .. {} (world rank / pp)",
              dir, rank, what, dp.replica, dp.dp, dp.dp - 1);
  if (!saving) return;
  TWOBP_CHECK(dp.dp == 1 || dp.group != nullptr, UsageError,
              "checkpoint {}: {} saves with dp={} but without its data-parallel group (DataParallelCheckpoint::group "
              "is null): pass the transport of the ranks holding pipeline rank {} in every replica "
              "(world.split(color = pipeline rank, key = replica)), so that no rank returns before replica 0 committed",
              dir, who(rank, dp), dp.dp, rank);
  if (dp.group != nullptr) {
    TWOBP_CHECK(dp.group->world_size() == dp.dp && dp.group->rank() == dp.replica, UsageError,
                "checkpoint {}: {} passes a data-parallel group of {} ranks in which it is rank {}, but dp={} and "
                "replica={}: the group must hold one rank per replica, ordered by replica "
                "(world.split(color = pipeline rank, key = replica))",
                dir, who(rank, dp), dp.group->world_size(), dp.group->rank(), dp.dp, dp.replica);
  }
}

}  // namespace

uint32_t crc32(const void* data, std::size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

ShardInfo write_shard(const std::string& dir, int64_t step, int rank, const NamedTensors& tensors) {
  make_directories(dir);
  std::string bytes(kMagic, sizeof(kMagic));
  put_le<uint32_t>(bytes, kShardVersion);
  put_le<uint32_t>(bytes, static_cast<uint32_t>(tensors.size()));
  std::set<std::string> seen;
  for (const auto& [name, tensor] : tensors) {
    TWOBP_CHECK(seen.insert(name).second, UsageError, "checkpoint: tensor name '{}' appears twice in rank {}'s shard",
                name, rank);
    TWOBP_CHECK(tensor.defined(), UsageError, "checkpoint: tensor '{}' of rank {} is undefined", name, rank);
    const at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    put_le<uint32_t>(bytes, static_cast<uint32_t>(name.size()));
    bytes += name;
    bytes.push_back(static_cast<char>(static_cast<uint8_t>(cpu.scalar_type())));
    put_le<uint32_t>(bytes, static_cast<uint32_t>(cpu.dim()));
    for (int64_t d : cpu.sizes()) put_le<int64_t>(bytes, d);
    const uint64_t nbytes = cpu.numel() * cpu.element_size();
    put_le<uint64_t>(bytes, nbytes);
    bytes.append(static_cast<const char*>(cpu.data_ptr()), nbytes);
  }
  ShardInfo info;
  info.rank = rank;
  info.file = shard_name(step, rank);
  info.bytes = bytes.size();
  info.crc32 = crc32(bytes.data(), bytes.size());
  write_file(join(dir, info.file), bytes, "checkpoint", /*durable=*/true);
  return info;
}

void write_manifest(const std::string& dir, const Manifest& manifest) {
  nlohmann::json j;
  j["format"] = "twobp-checkpoint";
  j["version"] = kManifestVersion;
  j["step"] = manifest.step;
  j["world_size"] = manifest.world_size;
  j["pp"] = manifest.world_size;  // the same fact under its data-parallel name; read_manifest checks they agree
  j["dp"] = manifest.dp;
  j["config"] = manifest.config;
  j["shards"] = nlohmann::json::array();
  for (const auto& s : manifest.shards) {
    j["shards"].push_back({{"rank", s.rank}, {"file", s.file}, {"bytes", s.bytes}, {"crc32", s.crc32}});
  }
  write_file(join(dir, kManifestName), j.dump(2) + "\n", "checkpoint", /*durable=*/true);

  // Garbage-collect shards of other steps and leftover temp files (best effort: failures are harmless).
  std::set<std::string> keep;
  for (const auto& s : manifest.shards) keep.insert(s.file);
  for (const std::string& name : list_directory(dir)) {
    if (name.rfind("shard-step", 0) == 0 && !keep.count(name)) ::unlink(join(dir, name).c_str());
  }
}

Manifest read_manifest(const std::string& dir) {
  const std::string path = join(dir, kManifestName);
  TWOBP_CHECK(exists(path), IOError, "checkpoint: no manifest {} (no complete checkpoint in {})", path,
              dir);
  const std::string text = read_file(path, "manifest");
  Manifest m;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    TWOBP_CHECK(j.value("format", "") == "twobp-checkpoint", IOError, "checkpoint: {} is not a twobp manifest",
                path);
    TWOBP_CHECK(j.at("version").get<int>() == kManifestVersion, IOError,
                "checkpoint: {} has version {}, this build reads version {}", path,
                j.at("version").get<int>(), kManifestVersion);
    m.step = j.at("step").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    // Absent in manifests written before data parallelism: one replica, and pp is the world size.
    m.dp = j.value("dp", 1);
    const int pp = j.value("pp", m.world_size);
    TWOBP_CHECK(pp == m.world_size, IOError,
                "checkpoint: manifest {} says pp={} but world_size={} (both are the number of shards)", path, pp,
                m.world_size);
    TWOBP_CHECK(m.dp >= 1, IOError, "checkpoint: manifest {} says dp={} (must be at least 1)", path, m.dp);
    m.config = j.at("config").get<CheckpointConfig>();
    for (const auto& s : j.at("shards")) {
      ShardInfo info;
      info.rank = s.at("rank").get<int>();
      info.file = s.at("file").get<std::string>();
      info.bytes = s.at("bytes").get<uint64_t>();
      info.crc32 = s.at("crc32").get<uint32_t>();
      m.shards.push_back(info);
    }
  } catch (const nlohmann::json::exception& e) {
    throw IOError(fmt::format("checkpoint: malformed manifest {}: {}", path, e.what()));
  }
  TWOBP_CHECK(static_cast<int>(m.shards.size()) == m.world_size, IOError,
              "checkpoint: manifest {} lists {} shards for a world size of {}", path, m.shards.size(),
              m.world_size);
  // The step is written twice, in the manifest and in every shard's name (shard_name): one that disagrees was
  // edited or mixed with another checkpoint's files; resuming from it would start the learning-rate schedule and
  // the step count anywhere.
  TWOBP_CHECK(m.step >= 0, IOError, "checkpoint: manifest {} says step {}; a step is >= 0 (was it edited?)", path,
              m.step);
  for (const ShardInfo& shard : m.shards) {
    TWOBP_CHECK(shard.file == shard_name(m.step, shard.rank), IOError,
                "checkpoint: manifest {} says step {}, but lists shard '{}' of rank {} (step {}'s would be '{}'): "
                "the manifest was edited or mixed with another checkpoint's; restore it or write a new checkpoint",
                path, m.step, shard.file, shard.rank, m.step, shard_name(m.step, shard.rank));
  }
  return m;
}

void check_config(const std::string& dir, const Manifest& manifest, const CheckpointConfig& expected) {
  for (const auto& [key, value] : expected) {
    auto it = manifest.config.find(key);
    TWOBP_CHECK(it != manifest.config.end(), UsageError,
                "checkpoint {} was written without '{}' in its configuration; this run has {}={}", dir, key, key,
                value);
    TWOBP_CHECK(it->second == value, UsageError,
                "checkpoint {} was written for {}={}, but this run has {}={}: it belongs to another configuration",
                dir, key, it->second, key, value);
  }
}

void check_config(const std::string& dir, const Manifest& manifest, const CheckpointConfig& expected, int world_size) {
  check_config(dir, manifest, expected);
  // dp is deliberately not compared: every replica holds the same state, so any number of replicas can resume.
  TWOBP_CHECK(manifest.world_size == world_size, UsageError,
              "checkpoint {} was written by a pipeline of pp={} ranks (one shard per pipeline rank; dp={} replicas), "
              "but this run's pipeline has pp={} ranks: resume with pp={} pipeline ranks per replica (any number of "
              "data-parallel replicas), or start afresh in another directory",
              dir, manifest.world_size, manifest.dp, world_size, manifest.world_size);
}

NamedTensors read_shard(const std::string& dir, const Manifest& manifest, int rank) {
  TWOBP_CHECK(rank >= 0 && rank < static_cast<int>(manifest.shards.size()), UsageError,
              "checkpoint {}: no shard for rank {} (world size {})", dir, rank, manifest.shards.size());
  const ShardInfo& info = manifest.shards[rank];
  TWOBP_CHECK(info.rank == rank, IOError, "checkpoint {}: manifest entry {} is for rank {}", dir, rank, info.rank);
  const std::string path = join(dir, info.file);
  const std::string& file = path;
  const std::string bytes = read_file(path, "shard");
  TWOBP_CHECK(bytes.size() == info.bytes, IOError,
              "checkpoint shard {}: {} bytes on disk, the manifest says {} (truncated or replaced)", file,
              bytes.size(), info.bytes);
  const uint32_t crc = crc32(bytes.data(), bytes.size());
  TWOBP_CHECK(crc == info.crc32, IOError, "checkpoint shard {}: CRC-32 mismatch: file {:08x}, manifest {:08x} (corrupt)",
              file, crc, info.crc32);

  Reader r{bytes, file};
  TWOBP_CHECK(std::memcmp(r.take(sizeof(kMagic), "magic"), kMagic, sizeof(kMagic)) == 0, IOError,
              "checkpoint shard {}: bad magic at offset 0", file);
  const uint32_t version = r.get<uint32_t>("version");
  TWOBP_CHECK(version == kShardVersion, IOError, "checkpoint shard {}: version {} at offset 8, expected {}", file,
              version, kShardVersion);
  const uint32_t count = r.get<uint32_t>("tensor count");
  NamedTensors tensors;
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t name_len = r.get<uint32_t>("name length");
    std::string name(r.take(name_len, "name"), name_len);
    const std::size_t dtype_offset = r.pos;
    const auto dtype = static_cast<at::ScalarType>(r.get<uint8_t>("dtype"));
    TWOBP_CHECK(static_cast<int>(dtype) < static_cast<int>(at::ScalarType::NumOptions), IOError,
                "checkpoint shard {}: tensor '{}' has an invalid dtype at offset {}", file, name, dtype_offset);
    const uint32_t ndim = r.get<uint32_t>("ndim");
    std::vector<int64_t> sizes(ndim);
    for (auto& d : sizes) d = r.get<int64_t>("dims");
    const uint64_t nbytes = r.get<uint64_t>("byte count");
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
    TWOBP_CHECK(nbytes == static_cast<uint64_t>(t.numel() * t.element_size()), IOError,
                "checkpoint shard {}: tensor '{}' declares {} bytes at offset {}, its shape needs {}", file, name,
                nbytes, r.pos - 8, t.numel() * t.element_size());
    std::memcpy(t.data_ptr(), r.take(nbytes, "tensor data"), nbytes);
    tensors.emplace_back(std::move(name), std::move(t));
  }
  TWOBP_CHECK(r.pos == bytes.size(), IOError, "checkpoint shard {}: {} trailing bytes at offset {}", file,
              bytes.size() - r.pos, r.pos);
  return tensors;
}

namespace {

// The collective save of one pipeline (replica 0's): shards, gathered checksums, manifest, barrier.
void save_pipeline(const std::string& dir, int64_t step, const CheckpointConfig& config, const NamedTensors& tensors,
                   Transport& transport, Duration timeout, int dp) {
  const int rank = transport.rank(), world = transport.world_size();
  const ShardInfo mine = write_shard(dir, step, rank, tensors);
  // Gather (bytes, crc) of every shard on every rank: each rank fills its own slots, the sum fills all. Doubles
  // represent both exactly (crc < 2^32, sizes < 2^53).
  at::Tensor info = at::zeros({world, 2}, at::kDouble);
  info[rank][0] = static_cast<double>(mine.bytes);
  info[rank][1] = static_cast<double>(mine.crc32);
  transport.all_reduce_sum(info, timeout);
  if (rank == 0) {
    Manifest m;
    m.step = step;
    m.world_size = world;
    m.dp = dp;
    m.config = config;
    auto acc = info.accessor<double, 2>();
    for (int r = 0; r < world; ++r) {
      m.shards.push_back({r, shard_name(step, r), static_cast<uint64_t>(acc[r][0]), static_cast<uint32_t>(acc[r][1])});
    }
    write_manifest(dir, m);
  }
  // Why: rank 0 commits after the others wrote their shards; without this barrier a rank could return (and, say,
  // end the job) before the manifest naming its shard exists.
  transport.barrier(timeout);
}

}  // namespace

void save_checkpoint(const std::string& dir, int64_t step, const CheckpointConfig& config,
                     const NamedTensors& tensors, Transport& pipeline, Duration timeout,
                     const DataParallelCheckpoint& data_parallel) {
  check_data_parallel(dir, pipeline.rank(), data_parallel, /*saving=*/true);
  // One copy per stage: replicas hold identical state, so replica 0 alone writes; the others would only race it
  // for the same file names.
  if (data_parallel.replica == 0) save_pipeline(dir, step, config, tensors, pipeline, timeout, data_parallel.dp);
  // Why: a rank of replica r > 0 wrote nothing, so nothing above held it back. The replica-0 rank of its group
  // reaches this barrier only after its pipeline barrier, i.e. after the manifest was committed; so no rank of any
  // replica returns before the checkpoint is complete.
  if (data_parallel.group != nullptr) data_parallel.group->barrier(timeout);
}

bool checkpoint_exists(const std::string& dir) { return exists(join(dir, kManifestName)); }

LoadedCheckpoint load_checkpoint(const std::string& dir, const CheckpointConfig& expected, int rank, int world_size,
                                 const DataParallelCheckpoint& data_parallel) {
  check_data_parallel(dir, rank, data_parallel, /*saving=*/false);
  const Manifest m = read_manifest(dir);
  try {
    check_config(dir, m, expected, world_size);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", who(rank, data_parallel), e.what()));
  }
  // Any replica reads the shard of its pipeline rank: the shards do not depend on the replica.
  return {m.step, read_shard(dir, m, rank)};
}

namespace {

// The tensor names of a shard, in file order, read by seeking past the data (no CRC: read_shard verifies the
// shards actually loaded). IOError for a file too short for what it declares.
std::vector<std::string> shard_tensor_names(const std::string& dir, const ShardInfo& info) {
  const std::string path = join(dir, info.file);
  std::ifstream in(path, std::ios::binary);
  TWOBP_CHECK(in.is_open(), IOError, "checkpoint: cannot open shard {}", path);
  const uint64_t size = info.bytes;
  uint64_t pos = 0;
  auto bytes = [&](std::size_t n, const char* what) {
    TWOBP_CHECK(n <= size - pos, IOError, "checkpoint shard {}: truncated {} at offset {}", path, what, pos);
    std::string out(n, '\0');
    in.read(out.data(), static_cast<std::streamsize>(n));
    TWOBP_CHECK(in.good(), IOError, "checkpoint shard {}: reading {} at offset {} failed", path, what, pos);
    pos += n;
    return out;
  };
  auto le = [&](std::size_t n, const char* what) {
    const std::string b = bytes(n, what);
    uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(b[i])) << (8 * i);
    return v;
  };
  TWOBP_CHECK(bytes(sizeof(kMagic), "magic") == std::string(kMagic, sizeof(kMagic)), IOError,
              "checkpoint shard {}: bad magic at offset 0", path);
  TWOBP_CHECK(le(4, "version") == kShardVersion, IOError, "checkpoint shard {}: unknown version at offset 8", path);
  const uint64_t count = le(4, "tensor count");
  std::vector<std::string> names;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t name_len = le(4, "name length");
    names.push_back(bytes(name_len, "name"));
    le(1, "dtype");
    const uint64_t ndim = le(4, "ndim");
    TWOBP_CHECK(ndim <= (size - pos) / 8, IOError, "checkpoint shard {}: truncated dims at offset {}", path, pos);
    for (uint64_t d = 0; d < ndim; ++d) le(8, "dims");
    const uint64_t nbytes = le(8, "byte count");
    TWOBP_CHECK(nbytes <= size - pos, IOError, "checkpoint shard {}: tensor '{}' declares {} bytes at offset {}, "
                "{} left", path, names.back(), nbytes, pos, size - pos);
    in.seekg(static_cast<std::streamoff>(nbytes), std::ios::cur);
    pos += nbytes;
  }
  return names;
}

}  // namespace

LoadedCheckpoint load_checkpoint_by_name(const std::string& dir, const CheckpointConfig& expected,
                                         const std::function<bool(const std::string&)>& wanted,
                                         const std::string& who) {
  const Manifest m = read_manifest(dir);
  try {
    check_config(dir, m, expected);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("{}: {}", who, e.what()));
  }
  LoadedCheckpoint out;
  out.step = m.step;
  std::map<std::string, int> found;  // name -> the shard it came from
  for (const auto& info : m.shards) {
    const std::vector<std::string> names = shard_tensor_names(dir, info);
    if (std::none_of(names.begin(), names.end(), wanted)) continue;
    for (auto& [name, t] : read_shard(dir, m, info.rank)) {
      if (!wanted(name)) continue;
      const auto [it, fresh] = found.emplace(name, info.rank);
      TWOBP_CHECK(fresh, IOError, "{}: checkpoint {} holds tensor '{}' in the shards of ranks {} and {}; a checkpoint "
                  "loaded by name needs each name once (global names, as module_tensors of chunks named by global "
                  "layer give them)", who, dir, name, it->second, info.rank);
      out.tensors.emplace_back(name, std::move(t));
    }
  }
  return out;
}

}  // namespace twobp::checkpoint
