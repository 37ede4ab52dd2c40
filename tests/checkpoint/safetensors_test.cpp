// safetensors files: the reference writer's bytes, round trips of every dtype, every malformation refused with
// the file and the tensor named, sharded checkpoints with their index.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/temp_files.h"
#include "twobp/checkpoint/safetensors.h"
#include "twobp/error.h"

namespace twobp::testing {
namespace safetensors_cases {

namespace ck = twobp::checkpoint;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file of `header` (as given, unpadded) and `data`.
std::string file_of(const std::string& header, const std::string& data) {
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  return out + header + data;
}

struct TempDir {
  std::string path = make_temp_dir("safetensors");
  ~TempDir() { remove_tree(path); }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// What safetensors 0.8 (Python, save_file) writes for these tensors, byte for byte.
TEST(Safetensors, WritesWhatTheReferenceWriterWrites) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"e":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
      R"("a":{"dtype":"F64","shape":[2],"data_offsets":[8,24]},)"
      R"("b":{"dtype":"F32","shape":[3],"data_offsets":[24,36]},)"
      R"("d":{"dtype":"BF16","shape":[2,1],"data_offsets":[36,40]},)"
      R"("c":{"dtype":"BOOL","shape":[3],"data_offsets":[40,43]}})"
      "     ";
  const std::string hex = "0700000000000000000000000000f83f00000000000000c0000000000000803f00000040003f80bf010001";
  std::string data;
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    data.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  const ck::NamedTensors tensors = {
      {"b", torch::arange(3, torch::kFloat)},
      {"a", torch::tensor({1.5, -2.0}, torch::kDouble)},
      {"c", torch::tensor({true, false, true})},
      {"d", torch::tensor({0.5, -1.0}).to(torch::kBFloat16).view({2, 1})},
      {"e", torch::tensor(7, torch::kLong)},
  };
  const std::string bytes = ck::safetensors_bytes(tensors, {{"format", "pt"}});
  EXPECT_EQ(bytes, file_of(header, data));
  EXPECT_EQ(bytes.size(), 363u);
}

TEST(Safetensors, EveryDtypeRoundTrips) {
  TempDir dir;
  torch::manual_seed(3);
  ck::NamedTensors tensors = {
      {"f64", torch::randn({3, 2}, torch::kDouble)},      {"f32", torch::randn({5}, torch::kFloat)},
      {"f16", torch::randn({2, 2}).to(torch::kHalf)},     {"bf16", torch::randn({4, 1}).to(torch::kBFloat16)},
      {"i64", torch::randint(-9, 9, {3}, torch::kLong)},  {"i32", torch::randint(-9, 9, {3}, torch::kInt)},
      {"i16", torch::randint(-9, 9, {3}, torch::kShort)}, {"i8", torch::randint(-9, 9, {3}, torch::kChar)},
      {"u8", torch::randint(0, 255, {3}, torch::kByte)},  {"bool", torch::tensor({true, false})},
      {"scalar", torch::tensor(2.5)},                     {"empty", torch::zeros({0, 4})},
      {"f8", torch::randn({3}).to(torch::kFloat8_e4m3fn)}, {"f8e5", torch::randn({3}).to(torch::kFloat8_e5m2)},
      {"u16", torch::randint(0, 9, {2}, torch::kInt).to(torch::kUInt16)},
      {"u32", torch::randint(0, 9, {2}, torch::kInt).to(torch::kUInt32)},
      {"u64", torch::randint(0, 9, {2}, torch::kInt).to(torch::kUInt64)},
      {"strided", torch::randn({4, 3}).t()},  // written contiguous
  };
  ck::write_safetensors(dir / "all.safetensors", tensors, {{"k", "v \"quoted\" é"}}, /*durable=*/false);
  const ck::SafetensorsFile f(dir / "all.safetensors");
  EXPECT_EQ(f.metadata().at("k"), "v \"quoted\" é");
  ASSERT_EQ(f.entries().size(), tensors.size());
  uint64_t end = 0;
  for (const ck::SafetensorsEntry& e : f.entries()) {  // data order: tiles the buffer, aligned to the element
    EXPECT_EQ(e.begin, end) << e.name;
    EXPECT_EQ(e.begin % c10::elementSize(e.dtype), 0u) << e.name;
    end = e.end;
  }
  for (const auto& [name, t] : tensors) {
    const at::Tensor got = f.read(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    EXPECT_EQ(std::string(f.bytes(name)),
              std::string(static_cast<const char*>(t.contiguous().data_ptr()), t.numel() * t.element_size()))
        << name;
  }
  // read_into converts: a bfloat16 file into float32 masters, exactly.
  at::Tensor master = torch::empty({4, 1}, torch::kFloat);
  f.read_into("bf16", master);
  EXPECT_TRUE(torch::equal(master, tensors[3].second.to(torch::kFloat)));
  expect_error([&] { f.read_into("bf16", torch::empty({4}, torch::kFloat)); },
               {dir / "all.safetensors", "'bf16'", "[4, 1]", "[4]"});
  expect_error([&] { f.read("nope"); }, {dir / "all.safetensors", "no tensor 'nope'"});
}

// Each malformation: the bytes, and words the UsageError must contain (besides the file's path).
struct Malformed {
  const char* what;
  std::string bytes;
  std::vector<std::string> words;
};

std::vector<Malformed> malformed_files() {
  const std::string ok = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\0');
  std::string huge_length = file_of(ok, eight);
  huge_length[5] = 1;  // header length ~2^40
  std::string past_end = file_of(ok, eight);
  past_end[0] = static_cast<char>(ok.size() + 9);
  const auto entry = [](const std::string& name, const std::string& body) {
    return "{\"" + name + "\":" + body + "}";
  };
  return {
      {"empty file", "", {"truncated", "0 bytes"}},
      {"short length", std::string(5, '\0'), {"truncated"}},
      {"length beyond the file", past_end, {"header length", "exceeds"}},
      {"length beyond the limit", huge_length, {"exceeds the format's limit"}},
      {"not JSON", file_of("{\"t\": [", ""), {"not valid JSON"}},
      {"not an object", file_of("[1, 2]", ""), {"must be a JSON object"}},
      {"entry not an object", file_of(entry("t", "3"), ""), {"'t'", "must be an object"}},
      {"no dtype", file_of(entry("t", R"({"shape":[],"data_offsets":[0,0]})"), ""), {"'t'", "\"dtype\""}},
      {"unknown dtype", file_of(entry("t", R"({"dtype":"F4","shape":[2],"data_offsets":[0,1]})"), "x"),
       {"'t'", "unknown dtype 'F4'", "BF16"}},
      {"negative dimension", file_of(entry("t", R"({"dtype":"F32","shape":[-1],"data_offsets":[0,0]})"), ""),
       {"'t'", "non-negative integer", "-1"}},
      {"fractional dimension", file_of(entry("t", R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})"), "1234"),
       {"'t'", "non-negative integer"}},
      {"offsets reversed", file_of(entry("t", R"({"dtype":"U8","shape":[0],"data_offsets":[4,0]})"), "1234"),
       {"'t'", "end before they begin"}},
      {"size mismatch", file_of(entry("t", R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), eight),
       {"'t'", "needs 12 bytes", "hold 8"}},
      {"overflowing shape",
       file_of(entry("t", R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]})"), eight),
       {"'t'", "more than 2^64"}},
      {"empty but huge",
       file_of(entry("t", R"({"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],)"
                          R"("data_offsets":[0,0]})"), ""),
       {"'t'", "too large for a tensor"}},
      {"past the buffer", file_of(ok, "1234"), {"'t'", "run past the data buffer"}},
      {"overlap", file_of(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", "123456"),
       {"'b'", "overlap"}},
      {"gap", file_of(entry("t", R"({"dtype":"U8","shape":[2],"data_offsets":[2,4]})"), "1234"), {"'t'", "gap"}},
      {"trailing bytes", file_of(ok, eight + "xx"), {"cover 8 bytes of the 10-byte data buffer"}},
      {"duplicate tensor", file_of(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                   R"("t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "12"),
       {"the key 't' twice"}},
      {"duplicate key in an entry",
       file_of(entry("t", R"({"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]})"), "1"),
       {"the key 'dtype' twice"}},
      {"metadata not strings", file_of(R"({"__metadata__":{"x":1}})", ""), {"__metadata__", "'x'", "string"}},
      {"deep nesting", file_of(std::string(100, '[') + std::string(100, ']'), ""), {"nests deeper"}},
  };
}

TEST(Safetensors, RefusesEveryMalformationNamingFileAndTensor) {
  TempDir dir;
  for (const Malformed& m : malformed_files()) {
    SCOPED_TRACE(m.what);
    const std::string path = dir / "bad.safetensors";
    spit(path, m.bytes);
    std::vector<std::string> words = m.words;
    words.push_back(path);
    expect_error([&] { ck::SafetensorsFile f(path); }, words);
  }
  // A BOOL byte other than 0/1 is refused when read (the header is fine).
  spit(dir / "bool.safetensors", file_of(R"({"flags":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})",
                                         std::string("\x01\x02", 2)));
  const ck::SafetensorsFile f(dir / "bool.safetensors");
  expect_error([&] { f.read("flags"); }, {"'flags'", "BOOL element 1 has byte 2"});
  expect_error<IOError>([&] { ck::SafetensorsFile g(dir / "missing.safetensors"); },
                        {"missing.safetensors", "cannot open"});
  expect_error([&] { ck::SafetensorsFile g(dir.path); }, {"not a regular file"});
}

TEST(Safetensors, WriterRefusesWhatTheFormatCannotHold) {
  expect_error([] { ck::safetensors_bytes({{"a", torch::zeros({1})}, {"a", torch::zeros({1})}}); },
               {"'a' is given twice"});
  expect_error([] { ck::safetensors_bytes({{"__metadata__", torch::zeros({1})}}); }, {"cannot name a tensor"});
  expect_error([] { ck::safetensors_bytes({{"z", torch::zeros({1}, torch::kComplexFloat)}}); },
               {"'z'", "ComplexFloat", "cannot store"});
  EXPECT_EQ(ck::parse_safetensors_dtype("BF16"), torch::kBFloat16);
  EXPECT_EQ(ck::safetensors_dtype_name(torch::kHalf), "F16");
  expect_error([] { ck::parse_safetensors_dtype("C64"); }, {"unknown dtype 'C64'", "F32"});
}

ck::NamedTensors numbered_tensors(int n, int64_t size) {
  ck::NamedTensors out;
  for (int i = 0; i < n; ++i) out.emplace_back("t" + std::to_string(i), torch::full({size}, static_cast<float>(i)));
  return out;
}

TEST(Safetensors, ShardedCheckpointsFollowTransformersLayout) {
  TempDir dir;
  ck::SafetensorsSaveOptions o;
  o.max_shard_bytes = 100;  // 10 floats = 40 bytes each: 2 per shard
  o.durable = false;
  const ck::NamedTensors tensors = numbered_tensors(5, 10);
  const auto files = ck::save_safetensors(dir.path, tensors, o);
  ASSERT_EQ(files, (std::vector<std::string>{"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                             "model-00003-of-00003.safetensors", "model.safetensors.index.json"}));
  const auto index = nlohmann::json::parse(slurp(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 200);
  EXPECT_EQ(index["weight_map"]["t4"], "model-00003-of-00003.safetensors");
  for (const std::string& path : {dir.path, dir / "model.safetensors.index.json"}) {
    const ck::SafetensorsCheckpoint c(path);
    EXPECT_EQ(c.names().size(), 5u);
    EXPECT_EQ(c.file_of("t2"), dir / "model-00002-of-00003.safetensors");
    EXPECT_TRUE(torch::equal(c.read("t3"), tensors[3].second));
    c.open_all();
  }
  // A new save replaces the old one: 2 shards, the third is stale and removed; then one file, the index removed.
  o.max_shard_bytes = 120;
  ck::save_safetensors(dir.path, tensors, o);
  EXPECT_FALSE(file_exists(dir / "model-00003-of-00003.safetensors"));
  EXPECT_TRUE(file_exists(dir / "model-00002-of-00002.safetensors"));
  o.max_shard_bytes = 0;
  EXPECT_EQ(ck::save_safetensors(dir.path, tensors, o), std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(file_exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(file_exists(dir / "model-00001-of-00002.safetensors"));
  EXPECT_EQ(ck::SafetensorsCheckpoint(dir.path).path(), dir / "model.safetensors");
}

TEST(Safetensors, InconsistentIndexesAreRefused) {
  TempDir dir;
  ck::SafetensorsSaveOptions o;
  o.max_shard_bytes = 100;
  o.durable = false;
  ck::save_safetensors(dir.path, numbered_tensors(4, 10), o);
  const std::string index_path = dir / "model.safetensors.index.json";
  const auto index = nlohmann::json::parse(slurp(index_path));
  auto edited = index;
  edited["weight_map"]["t0"] = "model-00002-of-00002.safetensors";  // t0 is in shard 1
  spit(index_path, edited.dump());
  expect_error([&] { ck::SafetensorsCheckpoint(dir.path).read("t0"); },
               {"model-00002-of-00002.safetensors", "places tensor 't0'", "lacks it"});
  expect_error([&] { ck::SafetensorsCheckpoint(dir.path).open_all(); }, {"model-00001-of-00002.safetensors",
                                                                         "'t0' is not assigned to it"});
  edited = index;
  edited["weight_map"]["t0"] = "../elsewhere.safetensors";
  spit(index_path, edited.dump());
  expect_error([&] { ck::SafetensorsCheckpoint c(dir.path); }, {index_path, "'t0'", "not a file name"});
  spit(index_path, R"({"weight_map": {"t0": "a", "t0": "b"}})");
  expect_error([&] { ck::SafetensorsCheckpoint c(dir.path); }, {index_path, "the key 't0' twice"});
  spit(index_path, R"({"metadata": {}})");
  expect_error([&] { ck::SafetensorsCheckpoint c(dir.path); }, {index_path, "weight_map"});
  std::remove(index_path.c_str());
  expect_error([&] { ck::SafetensorsCheckpoint c(dir.path); },
               {dir.path, "neither model.safetensors nor model.safetensors.index.json"});
  expect_error([&] { ck::SafetensorsCheckpoint(dir / "model-00001-of-00002.safetensors").read("t9"); },
               {"model-00001-of-00002.safetensors", "no tensor 't9'"});
}

}  // namespace safetensors_cases
}  // namespace twobp::testing
