// Fuzz target: the safetensors reader of include/twobp/checkpoint/safetensors.h, through a real (mapped) file.

#include <unistd.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <typeinfo>

#include "fuzz_targets.h"
#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"

namespace twobp::fuzz {
namespace {

const std::string& safetensors_scratch() {
  static const struct Path {
    std::string p = (std::filesystem::temp_directory_path() /
                     ("twobp-fuzz-" + std::to_string(::getpid()) + "-in.safetensors")).string();
    ~Path() { std::remove(p.c_str()); }
  } path;
  return path.p;
}

uint64_t le64(const std::uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A file that opened: every tensor's bytes are the input's at the header's offsets, inside the input; what reads
// survives the writer (safetensors_bytes) and reads back the same.
void check_readable(const checkpoint::SafetensorsFile& f, const std::uint8_t* data, std::size_t size) {
  const uint64_t start = 8 + le64(data);
  checkpoint::NamedTensors tensors;
  for (const checkpoint::SafetensorsEntry& e : f.entries()) {
    if (start + e.end > size) finding("tensor '" + e.name + "' ends past the file");
    const std::string_view b = f.bytes(e.name);
    if (b.size() != e.nbytes() || std::memcmp(b.data(), data + start + e.begin, b.size()) != 0) {
      finding("the bytes of tensor '" + e.name + "' are not the file's at its offsets");
    }
    try {
      tensors.emplace_back(e.name, f.read(e.name));
    } catch (const UsageError&) {
      if (e.dtype != at::kBool) finding("read() refused tensor '" + e.name + "', which is not BOOL");
      return;  // a BOOL byte other than 0/1: refused on read, as documented
    }
  }
  const std::string& path = safetensors_scratch();
  try {
    const std::string again = checkpoint::safetensors_bytes(tensors, f.metadata());
    std::FILE* out = std::fopen(path.c_str(), "wb");
    if (out == nullptr || std::fwrite(again.data(), 1, again.size(), out) != again.size()) finding("scratch write");
    std::fclose(out);
    const checkpoint::SafetensorsFile g(path);
    if (g.metadata() != f.metadata() || g.entries().size() != f.entries().size()) finding("round trip changed it");
    for (const auto& [name, t] : tensors) {
      if (g.bytes(name) != f.bytes(name)) finding("round trip changed the bytes of '" + name + "'");
    }
  } catch (const Error& e) {
    finding(std::string("what read does not survive the writer: ") + e.what());
  }
}

}  // namespace

int safetensors_file(const std::uint8_t* data, std::size_t size) {
  const std::string path = safetensors_scratch() + ".in";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size)) finding("cannot write " + path);
  std::fclose(f);
  try {
    const checkpoint::SafetensorsFile file(path);
    check_readable(file, data, size);
  } catch (const UsageError&) {
  } catch (const std::exception& e) {
    finding(std::string("SafetensorsFile threw ") + typeid(e).name() + ": " + e.what());
  } catch (...) {
    finding("SafetensorsFile threw a non-std exception");
  }
  std::remove(path.c_str());
  return 0;
}

}  // namespace twobp::fuzz
