#include "twobp/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include <fmt/ranges.h>

#include "twobp/error.h"
#include "twobp/files.h"
#include "util/check.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian: a big-endian host "
                                                         "would need byte swapping, which is not written");

namespace twobp::checkpoint {

namespace {
// Helpers in a namespace of their own: this file is compiled in one unity group with the kit's other files.
namespace st {

using json = nlohmann::json;

// The dtypes, in the reference writer's data order (its Dtype enum, descending): a file's 8-byte tensors come
// first, then the 4-, 2- and 1-byte ones, so that every tensor starts at a multiple of its element size.
struct DtypeName {
  const char* name;
  c10::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"U64", c10::ScalarType::UInt64},  {"I64", c10::ScalarType::Long},         {"F64", c10::ScalarType::Double},
    {"F32", c10::ScalarType::Float},   {"U32", c10::ScalarType::UInt32},       {"I32", c10::ScalarType::Int},
    {"BF16", c10::ScalarType::BFloat16}, {"F16", c10::ScalarType::Half},       {"U16", c10::ScalarType::UInt16},
    {"I16", c10::ScalarType::Short},   {"F8_E4M3", c10::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", c10::ScalarType::Float8_e5m2}, {"I8", c10::ScalarType::Char}, {"U8", c10::ScalarType::Byte},
    {"BOOL", c10::ScalarType::Bool},
};

int dtype_rank(c10::ScalarType type) {
  for (std::size_t i = 0; i < std::size(kDtypes); ++i) {
    if (kDtypes[i].type == type) return static_cast<int>(i);
  }
  return -1;
}

std::string known_dtypes() {
  std::vector<std::string> names;
  for (const auto& d : kDtypes) names.emplace_back(d.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

// The format's own limit on the header (the reference reader refuses larger ones).
constexpr uint64_t kMaxHeader = 100'000'000;
// Nesting the format never needs (root object, entry, shape array); a bound keeps hostile headers cheap.
constexpr int kMaxDepth = 64;

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string parent(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// JSON with every object's keys unique (nlohmann would keep the last of two silently) and bounded nesting.
// `what` prefixes the UsageError ("safetensors FILE: header").
json parse_strict(std::string_view text, const std::string& what) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  bool too_deep = false;
  json::parser_callback_t callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxDepth) too_deep = true;
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return !too_deep;  // discard what is too deep: parsing goes on, building nothing more
  };
  json parsed;
  try {
    parsed = json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    throw UsageError(fmt::format("{} is not valid JSON: {}", what, e.what()));
  }
  TWOBP_CHECK(!too_deep, UsageError, "{} nests deeper than {} levels (not a safetensors header)", what, kMaxDepth);
  TWOBP_CHECK(duplicate.empty(), UsageError, "{} has the key '{}' twice (a name must be unique)", what, duplicate);
  return parsed;
}

uint64_t read_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string shape_string(c10::IntArrayRef shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace st
}  // namespace

std::string safetensors_dtype_name(c10::ScalarType type) {
  const int rank = st::dtype_rank(type);
  TWOBP_CHECK(rank >= 0, UsageError, "safetensors: dtype {} has no safetensors name (known: {})",
              c10::toString(type), st::known_dtypes());
  return st::kDtypes[rank].name;
}

c10::ScalarType parse_safetensors_dtype(const std::string& name) {
  for (const auto& d : st::kDtypes) {
    if (name == d.name) return d.type;
  }
  twobp::detail::raise<UsageError>("safetensors: unknown dtype '{}' (known: {})", name, st::known_dtypes());
}

// ---- SafetensorsFile ----

struct SafetensorsFile::Mapped {
  std::string path;
  const unsigned char* base = nullptr;  // the whole file, mapped read-only
  std::size_t size = 0;
  uint64_t data_start = 0;  // 8 + header length
  std::vector<SafetensorsEntry> entries;
  std::unordered_map<std::string, std::size_t> by_name;
  std::map<std::string, std::string> metadata;

  Mapped() = default;
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
  ~Mapped() {
    if (base != nullptr) ::munmap(const_cast<unsigned char*>(base), size);
  }
  const SafetensorsEntry& entry(const std::string& name) const {
    const auto it = by_name.find(name);
    TWOBP_CHECK(it != by_name.end(), UsageError, "safetensors {}: no tensor '{}' in this file", path, name);
    return entries[it->second];
  }
  const unsigned char* data(const SafetensorsEntry& e) const { return base + data_start + e.begin; }
};

namespace {
namespace st {

void map_file(SafetensorsFile::Mapped& m) {
  const int fd = ::open(m.path.c_str(), O_RDONLY | O_CLOEXEC);
  TWOBP_CHECK(fd >= 0, IOError, "safetensors {}: cannot open: {}", m.path, std::strerror(errno));
  struct stat info;
  if (::fstat(fd, &info) != 0) {
    const int err = errno;
    ::close(fd);
    throw IOError(fmt::format("safetensors {}: cannot stat: {}", m.path, std::strerror(err)));
  }
  if (!S_ISREG(info.st_mode) || info.st_size < 8) {
    ::close(fd);
    TWOBP_CHECK(S_ISREG(info.st_mode), UsageError, "safetensors {}: not a regular file", m.path);
    throw UsageError(fmt::format("safetensors {}: truncated: {} bytes, shorter than the 8-byte header length",
                                 m.path, info.st_size));
  }
  m.size = static_cast<std::size_t>(info.st_size);
  void* p = ::mmap(nullptr, m.size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file
  TWOBP_CHECK(p != MAP_FAILED, IOError, "safetensors {}: cannot map {} bytes: {}", m.path, m.size,
              std::strerror(err));
  m.base = static_cast<const unsigned char*>(p);
}

uint64_t json_offset(const json& v, const std::string& where, const char* what) {
  TWOBP_CHECK(v.is_number_unsigned(), UsageError, "{}: {} must be a non-negative integer, got {}", where, what,
              v.dump());
  return v.get<uint64_t>();
}

// One tensor's entry: dtype, shape and offsets, each checked; the size against dtype x shape.
SafetensorsEntry parse_entry(const std::string& name, const json& v, const std::string& file) {
  const std::string where = fmt::format("safetensors {}: tensor '{}'", file, name);
  TWOBP_CHECK(v.is_object(), UsageError, "{}: the entry must be an object, got {}", where, v.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    TWOBP_CHECK(v.contains(key), UsageError, "{}: the entry has no \"{}\"", where, key);
  }
  TWOBP_CHECK(v["dtype"].is_string(), UsageError, "{}: \"dtype\" must be a string, got {}", where, v["dtype"].dump());
  SafetensorsEntry e;
  e.name = name;
  const std::string dtype = v["dtype"].get<std::string>();
  const auto* known = std::find_if(std::begin(kDtypes), std::end(kDtypes), [&](const DtypeName& d) {
    return dtype == d.name;
  });
  TWOBP_CHECK(known != std::end(kDtypes), UsageError, "{}: unknown dtype '{}' (known: {})", where, dtype,
              known_dtypes());
  e.dtype = known->type;
  const json& shape = v["shape"];
  TWOBP_CHECK(shape.is_array(), UsageError, "{}: \"shape\" must be an array, got {}", where, shape.dump());
  uint64_t elements = 1, extent = 1;  // extent: the product of max(d, 1), which LibTorch's strides reach
  bool overflow = false;
  for (const json& d : shape) {
    const uint64_t n = json_offset(d, where, "every dimension of \"shape\"");
    TWOBP_CHECK(!__builtin_mul_overflow(extent, std::max<uint64_t>(n, 1), &extent) &&
                    extent <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                UsageError, "{}: shape {} is too large for a tensor (its dimensions multiply past 2^63)", where,
                shape.dump());
    e.shape.push_back(static_cast<int64_t>(n));
    overflow = overflow || __builtin_mul_overflow(elements, n, &elements);
  }
  const json& offsets = v["data_offsets"];
  TWOBP_CHECK(offsets.is_array() && offsets.size() == 2, UsageError,
              "{}: \"data_offsets\" must be [begin, end], got {}", where, offsets.dump());
  e.begin = json_offset(offsets[0], where, "data_offsets[0]");
  e.end = json_offset(offsets[1], where, "data_offsets[1]");
  TWOBP_CHECK(e.begin <= e.end, UsageError, "{}: data_offsets [{}, {}] end before they begin", where, e.begin, e.end);
  uint64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(elements, c10::elementSize(e.dtype), &bytes);
  TWOBP_CHECK(!overflow && bytes == e.nbytes(), UsageError,
              "{}: {} x {} needs {} bytes but data_offsets [{}, {}] hold {}", where, dtype, shape_string(e.shape),
              overflow ? std::string("more than 2^64") : std::to_string(bytes), e.begin, e.end, e.nbytes());
  return e;
}

void parse_metadata(SafetensorsFile::Mapped& m, const json& v) {
  TWOBP_CHECK(v.is_object(), UsageError, "safetensors {}: \"__metadata__\" must be an object of strings, got {}",
              m.path, v.type_name());
  for (const auto& [key, value] : v.items()) {
    TWOBP_CHECK(value.is_string(), UsageError,
                "safetensors {}: \"__metadata__\" value of '{}' must be a string, got {}", m.path, key, value.dump());
    m.metadata[key] = value.get<std::string>();
  }
}

// The tensors must tile the data buffer exactly (the reference reader's rule): no gap, no overlap, nothing after.
void check_tiling(SafetensorsFile::Mapped& m) {
  std::sort(m.entries.begin(), m.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const uint64_t buffer = m.size - m.data_start;
  uint64_t expected = 0;
  for (const SafetensorsEntry& e : m.entries) {
    TWOBP_CHECK(e.end <= buffer, UsageError,
                "safetensors {}: tensor '{}': data_offsets [{}, {}] run past the data buffer's {} bytes (truncated "
                "file?)", m.path, e.name, e.begin, e.end, buffer);
    TWOBP_CHECK(e.begin >= expected, UsageError,
                "safetensors {}: tensor '{}': data_offsets [{}, {}] overlap the previous tensor's, which ends at {}",
                m.path, e.name, e.begin, e.end, expected);
    TWOBP_CHECK(e.begin == expected, UsageError,
                "safetensors {}: tensor '{}': data_offsets [{}, {}] leave a gap after byte {} of the data buffer",
                m.path, e.name, e.begin, e.end, expected);
    expected = e.end;
  }
  TWOBP_CHECK(expected == buffer, UsageError,
              "safetensors {}: the tensors cover {} bytes of the {}-byte data buffer (trailing bytes)", m.path,
              expected, buffer);
  for (std::size_t i = 0; i < m.entries.size(); ++i) m.by_name.emplace(m.entries[i].name, i);
}

void parse_header(SafetensorsFile::Mapped& m) {
  const uint64_t n = read_le64(m.base);
  TWOBP_CHECK(n <= kMaxHeader, UsageError, "safetensors {}: header length {} exceeds the format's limit of {} bytes",
              m.path, n, kMaxHeader);
  TWOBP_CHECK(n <= m.size - 8, UsageError,
              "safetensors {}: header length {} exceeds the {} bytes after it (truncated file?)", m.path, n,
              m.size - 8);
  m.data_start = 8 + n;
  const std::string what = fmt::format("safetensors {}: the header", m.path);
  const json header = parse_strict(std::string_view(reinterpret_cast<const char*>(m.base) + 8, n), what);
  TWOBP_CHECK(header.is_object(), UsageError, "{} must be a JSON object, got {}", what, header.type_name());
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      parse_metadata(m, value);
    } else {
      m.entries.push_back(parse_entry(name, value, m.path));
    }
  }
  check_tiling(m);
}

}  // namespace st
}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) {
  auto m = std::make_shared<Mapped>();
  m->path = path;
  st::map_file(*m);
  st::parse_header(*m);
  m_ = std::move(m);
}

const std::string& SafetensorsFile::path() const { return m_->path; }
const std::vector<SafetensorsEntry>& SafetensorsFile::entries() const { return m_->entries; }
bool SafetensorsFile::contains(const std::string& name) const { return m_->by_name.count(name) > 0; }
const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const { return m_->entry(name); }
const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return m_->metadata; }

std::string_view SafetensorsFile::bytes(const std::string& name) const {
  const SafetensorsEntry& e = m_->entry(name);
  return {reinterpret_cast<const char*>(m_->data(e)), static_cast<std::size_t>(e.nbytes())};
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry& e = m_->entry(name);
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  if (e.nbytes() > 0) std::memcpy(t.data_ptr(), m_->data(e), e.nbytes());
  if (e.dtype == c10::ScalarType::Bool) {
    // A bool byte other than 0 or 1 is undefined behaviour in C++: refuse it here, where the file is named.
    const unsigned char* p = m_->data(e);
    for (uint64_t i = 0; i < e.nbytes(); ++i) {
      TWOBP_CHECK(p[i] <= 1, UsageError, "safetensors {}: tensor '{}': BOOL element {} has byte {} (0 or 1 expected)",
                  m_->path, name, i, static_cast<int>(p[i]));
    }
  }
  return t;
}

void SafetensorsFile::read_into(const std::string& name, const at::Tensor& dest) const {
  const SafetensorsEntry& e = m_->entry(name);
  TWOBP_CHECK(dest.sizes() == c10::IntArrayRef(e.shape), UsageError,
              "safetensors {}: tensor '{}' has shape {} but its destination has {}", m_->path, name,
              st::shape_string(e.shape), st::shape_string(dest.sizes()));
  at::NoGradGuard no_grad;  // a parameter is overwritten, not differentiated through
  const void* p = m_->data(e);
  const auto size = static_cast<std::uintptr_t>(c10::elementSize(e.dtype));
  if (e.dtype != c10::ScalarType::Bool && reinterpret_cast<std::uintptr_t>(p) % size == 0) {
    // Aligned: a read-only view of the mapping, copied (and converted) by ATen straight into dest.
    dest.copy_(at::from_blob(const_cast<void*>(p), e.shape, at::TensorOptions().dtype(e.dtype)));
  } else {
    dest.copy_(read(name));
  }
}

// ---- SafetensorsCheckpoint ----

struct SafetensorsCheckpoint::State {
  std::string path;  // the single file or the index
  std::string dir;   // where the shards are
  std::map<std::string, std::string> weight_map;  // tensor -> file name (relative to dir)
  std::map<std::string, std::vector<std::string>> by_file;
  mutable std::mutex mutex;
  mutable std::map<std::string, SafetensorsFile> files;  // mapped so far

  const SafetensorsFile& file(const std::string& name) const;
};

namespace {
namespace st {

void read_index(SafetensorsCheckpoint::State& s) {
  std::ifstream in(s.path, std::ios::binary);
  TWOBP_CHECK(in.is_open(), IOError, "safetensors index {}: cannot open: {}", s.path, std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TWOBP_CHECK(!in.bad(), IOError, "safetensors index {}: reading failed", s.path);
  const json index = parse_strict(text, fmt::format("safetensors index {}", s.path));
  TWOBP_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), UsageError,
              "safetensors index {}: expected {{\"weight_map\": {{tensor: file, ...}}}}", s.path);
  for (const auto& [name, file] : index["weight_map"].items()) {
    TWOBP_CHECK(file.is_string(), UsageError, "safetensors index {}: tensor '{}' maps to {}, not a file name",
                s.path, name, file.dump());
    const std::string f = file.get<std::string>();
    // Shards live beside the index: no absolute paths, no way out of its directory.
    TWOBP_CHECK(!f.empty() && f.front() != '/' && f.find("..") == std::string::npos, UsageError,
                "safetensors index {}: tensor '{}' maps to '{}', not a file name in the index's directory", s.path,
                name, f);
    s.weight_map[name] = f;
    s.by_file[f].push_back(name);
  }
}

// A shard must hold exactly the tensors its index assigns to it.
void check_shard(const SafetensorsCheckpoint::State& s, const std::string& file, const SafetensorsFile& f) {
  const std::vector<std::string>& listed = s.by_file.at(file);
  for (const std::string& name : listed) {
    TWOBP_CHECK(f.contains(name), UsageError, "safetensors {}: the index {} places tensor '{}' in this shard, which "
                "lacks it", f.path(), s.path, name);
  }
  TWOBP_CHECK(f.entries().size() == listed.size(), UsageError,
              "safetensors {}: the shard holds {} tensors, the index {} assigns it {}: '{}' is not assigned to it",
              f.path(), f.entries().size(), s.path, listed.size(), [&] {
                for (const auto& e : f.entries()) {
                  if (s.weight_map.count(e.name) == 0 || s.weight_map.at(e.name) != file) return e.name;
                }
                return std::string();
              }());
}

}  // namespace st
}  // namespace

const SafetensorsFile& SafetensorsCheckpoint::State::file(const std::string& name) const {
  const auto it = weight_map.find(name);
  TWOBP_CHECK(it != weight_map.end(), UsageError, "safetensors {}: no tensor '{}' in this checkpoint", path, name);
  std::lock_guard<std::mutex> lock(mutex);
  auto f = files.find(it->second);
  if (f == files.end()) {
    SafetensorsFile opened(st::join(dir, it->second));
    st::check_shard(*this, it->second, opened);
    f = files.emplace(it->second, std::move(opened)).first;
  }
  return f->second;
}

SafetensorsCheckpoint::SafetensorsCheckpoint(const std::string& path) : s_(std::make_shared<State>()) {
  std::string target = path;
  if (st::is_directory(path)) {
    const std::string single = st::join(path, "model.safetensors"), index = single + ".index.json";
    TWOBP_CHECK(st::exists(single) || st::exists(index), UsageError,
                "safetensors: {} holds neither model.safetensors nor model.safetensors.index.json", path);
    target = st::exists(single) ? single : index;
  }
  s_->path = target;
  s_->dir = st::parent(target);
  if (st::ends_with(target, ".index.json")) {
    st::read_index(*s_);
    return;
  }
  SafetensorsFile f(target);
  const std::string name = target.substr(target.find_last_of('/') + 1);
  for (const auto& e : f.entries()) {
    s_->weight_map[e.name] = name;
    s_->by_file[name].push_back(e.name);
  }
  s_->files.emplace(name, std::move(f));
}

const std::string& SafetensorsCheckpoint::path() const { return s_->path; }

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> names;
  for (const auto& entry : s_->weight_map) names.push_back(entry.first);
  return names;
}

bool SafetensorsCheckpoint::contains(const std::string& name) const { return s_->weight_map.count(name) > 0; }
std::string SafetensorsCheckpoint::file_of(const std::string& name) const { return file(name).path(); }
const SafetensorsFile& SafetensorsCheckpoint::file(const std::string& name) const { return s_->file(name); }
const SafetensorsEntry& SafetensorsCheckpoint::entry(const std::string& name) const {
  return file(name).entry(name);
}
at::Tensor SafetensorsCheckpoint::read(const std::string& name) const { return file(name).read(name); }
void SafetensorsCheckpoint::read_into(const std::string& name, const at::Tensor& dest) const {
  file(name).read_into(name, dest);
}

void SafetensorsCheckpoint::open_all() const {
  for (const auto& entry : s_->by_file) s_->file(entry.second.front());
}

// ---- Writing ----

namespace {
namespace st {

struct Prepared {
  std::string name;
  at::Tensor tensor;  // CPU, contiguous
  int rank = 0;
};

// Names unique and usable, every tensor defined and of a dtype the format has.
void check_writable(const NamedTensors& tensors) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    TWOBP_CHECK(name != "__metadata__", UsageError,
                "safetensors: '__metadata__' cannot name a tensor (the header's metadata key)");
    TWOBP_CHECK(seen.insert(name).second, UsageError, "safetensors: tensor '{}' is given twice", name);
    TWOBP_CHECK(t.defined(), UsageError, "safetensors: tensor '{}' is undefined", name);
    TWOBP_CHECK(dtype_rank(t.scalar_type()) >= 0, UsageError,
                "safetensors: tensor '{}' has dtype {}, which safetensors cannot store (known: {})", name,
                c10::toString(t.scalar_type()), known_dtypes());
  }
}

std::vector<Prepared> prepare(const NamedTensors& tensors) {
  check_writable(tensors);
  std::vector<Prepared> out;
  for (const auto& [name, t] : tensors) {
    out.push_back({name, t.detach().to(at::kCPU).contiguous(), dtype_rank(t.scalar_type())});
  }
  std::stable_sort(out.begin(), out.end(), [](const Prepared& a, const Prepared& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.name < b.name;
  });
  return out;
}

void put_le64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace st
}  // namespace

std::string safetensors_bytes(const NamedTensors& tensors, const std::map<std::string, std::string>& metadata) {
  const std::vector<st::Prepared> items = st::prepare(tensors);
  std::string header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + st::json(metadata).dump() + ",";
  uint64_t offset = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const at::Tensor& t = items[i].tensor;
    const uint64_t n = t.numel() * t.element_size();
    header += fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", i ? "," : "",
                          st::json(items[i].name).dump(), st::kDtypes[items[i].rank].name,
                          fmt::join(t.sizes(), ","), offset, offset + n);
    offset += n;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned in the file
  std::string out;
  out.reserve(8 + header.size() + offset);
  st::put_le64(out, header.size());
  out += header;
  for (const auto& item : items) {
    out.append(static_cast<const char*>(item.tensor.data_ptr()), item.tensor.numel() * item.tensor.element_size());
  }
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& tensors,
                       const std::map<std::string, std::string>& metadata, bool durable) {
  write_file(path, safetensors_bytes(tensors, metadata), "safetensors " + path, durable);
}

namespace {
namespace st {

void remove_if_present(const std::string& path) {
  TWOBP_CHECK(::unlink(path.c_str()) == 0 || errno == ENOENT, IOError, "safetensors: cannot remove {}: {}", path,
              std::strerror(errno));
}

// transformers' shard names: <prefix>-00001-of-00003.safetensors.
std::string shard_name(const std::string& prefix, std::size_t i, std::size_t n) {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", prefix, i + 1, n);
}

bool is_shard_name(const std::string& name, const std::string& prefix) {
  // <prefix>-NNNNN-of-NNNNN.safetensors
  const std::string rest = name.substr(std::min(name.size(), prefix.size()));
  if (name.compare(0, prefix.size(), prefix) != 0 || rest.size() != 1 + 5 + 4 + 5 + 12) return false;
  const auto digits = [&](std::size_t at) {
    return std::all_of(rest.begin() + at, rest.begin() + at + 5, [](char c) { return c >= '0' && c <= '9'; });
  };
  return rest[0] == '-' && digits(1) && rest.compare(6, 4, "-of-") == 0 && digits(10) &&
         rest.compare(15, 12, ".safetensors") == 0;
}

std::vector<NamedTensors> plan_shards(const NamedTensors& tensors, uint64_t limit) {
  std::vector<NamedTensors> shards(1);
  uint64_t bytes = 0;
  for (const auto& item : tensors) {
    const uint64_t n = item.second.defined() ? item.second.numel() * item.second.element_size() : 0;
    if (limit > 0 && !shards.back().empty() && bytes + n > limit) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(item);
    bytes += n;
  }
  return shards;
}

}  // namespace st
}  // namespace

std::vector<std::string> save_safetensors(const std::string& dir, const NamedTensors& tensors,
                                          const SafetensorsSaveOptions& o) {
  st::check_writable(tensors);  // before anything on disk changes
  make_directories(dir);
  const std::string single = o.prefix + ".safetensors", index = single + ".index.json";
  st::remove_if_present(st::join(dir, single));
  st::remove_if_present(st::join(dir, index));
  const std::vector<NamedTensors> shards = st::plan_shards(tensors, o.max_shard_bytes);
  if (shards.size() == 1) {  // as transformers: one shard is a plain file, without an index
    write_safetensors(st::join(dir, single), tensors, o.metadata, o.durable);
  }
  std::vector<std::string> written;
  st::json weight_map = st::json::object();
  uint64_t total = 0;
  for (std::size_t i = 0; shards.size() > 1 && i < shards.size(); ++i) {
    written.push_back(st::shard_name(o.prefix, i, shards.size()));
    write_safetensors(st::join(dir, written.back()), shards[i], o.metadata, o.durable);
    for (const auto& [name, t] : shards[i]) {
      weight_map[name] = written.back();
      total += t.numel() * t.element_size();
    }
  }
  if (shards.size() > 1) {
    const st::json doc = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file(st::join(dir, index), doc.dump(2) + "\n", "safetensors index " + st::join(dir, index), o.durable);
  }
  const std::set<std::string> keep(written.begin(), written.end());
  if (DIR* d = ::opendir(dir.c_str())) {
    std::vector<std::string> stale;
    while (const dirent* e = ::readdir(d)) {
      if (st::is_shard_name(e->d_name, o.prefix) && keep.count(e->d_name) == 0) stale.emplace_back(e->d_name);
    }
    ::closedir(d);
    for (const auto& name : stale) st::remove_if_present(st::join(dir, name));
  }
  written.push_back(shards.size() > 1 ? index : single);
  return written;
}

}  // namespace twobp::checkpoint
