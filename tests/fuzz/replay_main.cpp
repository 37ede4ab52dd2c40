// Replays the committed fuzz corpora (tests/fuzz/corpus/<target>/*) through the fuzz targets, so the ordinary
// build exercises every seed and every past finding without clang or libFuzzer.
//
//   fuzz_replay [CORPUS_ROOT]            replay every target's corpus (default: the source tree's corpus)
//   fuzz_replay --write-seeds CORPUS_ROOT  (re)write the generated seeds: schedules dumped from the built-in
//                                          generators and small token files
//
// Reproducers of unfixed findings (files named crash-*, oom-*, timeout-*, leak-*) are skipped unless
// TWOBP_FUZZ_REPLAY_FINDINGS=1 (careful with oom-*: outside ASan they may really allocate tens of GB); rename one
// to regress-* once its bug is fixed, and it is replayed from then on.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "fuzz_targets.h"
#include "twobp/checkpoint/safetensors.h"
#include "twobp/data.h"
#include "twobp/error.h"
#include "twobp/schedule/registry.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/text.h"

namespace fs = std::filesystem;

namespace {

bool is_unfixed_finding(const std::string& name) {
  for (const char* prefix : {"crash-", "oom-", "timeout-", "leak-", "slow-unit-"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// A valid file of every dtype family with metadata, and near misses of the reader's checks.
void write_safetensors_seeds(const fs::path& dir) {
  namespace ck = twobp::checkpoint;
  fs::create_directories(dir);
  const std::string valid = ck::safetensors_bytes(
      {{"model.embed_tokens.weight", at::arange(6, at::kFloat).view({2, 3})},
       {"bias", at::arange(2, at::kDouble)},
       {"half", at::arange(3, at::kFloat).to(at::kBFloat16)},
       {"ids", at::arange(2, at::kLong)},
       {"flags", at::ones({2}, at::kBool)},
       {"scalar", at::ones({}, at::kFloat)},
       {"empty", at::zeros({0, 2}, at::kFloat)}},
      {{"format", "pt"}});
  write_file(dir / "seed-valid.safetensors", valid);
  write_file(dir / "seed-no-tensors.safetensors", ck::safetensors_bytes({}));
  write_file(dir / "seed-truncated.safetensors", valid.substr(0, valid.size() - 3));  // invalid: data cut
  write_file(dir / "seed-header-cut.safetensors", valid.substr(0, 40));                // invalid: header cut
  std::string shifted = valid;
  const std::string first = "\"data_offsets\":[0,";
  shifted.replace(shifted.find(first), first.size(), "\"data_offsets\":[1,");  // invalid: size, then overlap
  write_file(dir / "seed-bad-offsets.safetensors", shifted);
}

int write_seeds(const fs::path& root) {
  using namespace twobp;
  const fs::path sched = root / "schedule_text";
  fs::create_directories(sched);
  struct Seed {
    const char* name;
    ScheduleOptions options;
  };
  const Seed seeds[] = {
      {"gpipe", {2, 2, 1, BackwardMode::kSplit}},
      {"1f1b", {3, 4, 1, BackwardMode::kStandard}},
      {"1f1b", {2, 3, 1, BackwardMode::kSplit}},
      {"interleaved-1f1b", {2, 2, 2, BackwardMode::kSplit}},
      {"zb-h1", {2, 3, 1, BackwardMode::kSplit}},
      {"zb-h2", {2, 2, 1, BackwardMode::kStandard}},
      {"zb-v", {2, 3, 2, BackwardMode::kSplit}},
  };
  for (const Seed& s : seeds) {
    const Schedule schedule = make_schedule(s.name, s.options);
    const std::string file = std::string("seed-") + s.name + "-p" + std::to_string(s.options.ranks) + "-m" +
                             std::to_string(s.options.micro_batches) + "-v" +
                             std::to_string(s.options.chunks_per_rank) +
                             (s.options.backward == BackwardMode::kSplit ? "-split" : "-standard") + ".txt";
    write_file(sched / file, dump_schedule(schedule));
  }
  // A few hand-written near misses, so the fuzzer starts next to the parser's error paths.
  write_file(sched / "seed-comments.txt",
             "# a comment line\ntwobp-schedule v1 name=c ranks=1 stages=1 microbatches=2 backward=split "
             "placement=0  # trailing\n\nrank 0: F 0 0\nrank 0: F 0 1\nrank 0: I 0 0\nrank 0: I 0 1\n"
             "rank 0: W 0 0,1\n");
  write_file(sched / "seed-invalid-order.txt",
             "twobp-schedule v1 name=bad ranks=1 stages=1 microbatches=1 backward=standard placement=0\n"
             "rank 0: B 0 0\nrank 0: F 0 0\n");
  write_file(sched / "seed-bad-header.txt", "twobp-schedule v2 name=x ranks=1\n");

  const fs::path tok = root / "token_file";
  fs::create_directories(tok);
  const fs::path tmp = tok / "tmp.tok";
  auto written = [&](const std::vector<data::Token>& tokens, std::uint32_t vocab) {
    data::write_token_file(tmp.string(), tokens, vocab);
    std::ifstream in(tmp, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    fs::remove(tmp);
    return bytes;
  };
  const std::string text = "Pipeline stages.";
  const std::string with_header = written(data::ByteTokenizer::encode(text), 256);
  write_file(tok / "seed-header-bytes.tok", with_header);
  write_file(tok / "seed-header-wide.tok", written({0, 1, 255, 256, 4095, 65535}, 65536));
  write_file(tok / "seed-header-empty.tok", written({}, 1));
  write_file(tok / "seed-raw.tok", with_header.substr(24));                 // bare uint16 stream
  write_file(tok / "seed-raw-odd.tok", with_header.substr(24, 7));          // invalid: odd size
  write_file(tok / "seed-truncated.tok", with_header.substr(0, with_header.size() - 2));  // invalid: count
  write_file(tok / "seed-short-header.tok", with_header.substr(0, 20));    // invalid: header cut
  std::string big_vocab = with_header;
  big_vocab[14] = 0x01;  // vocab_size 256 -> 65792 (> 65536, > any model's vocabulary)
  write_file(tok / "seed-bad-vocab.tok", big_vocab);
  // Version 2: 32-bit tokens (a vocabulary beyond 65536), and a width that is neither 16 nor 32.
  const std::string wide = written({0, 65535, 65536, 128255}, 128256);
  write_file(tok / "seed-v2-32bit.tok", wide);
  std::string bad_width = wide;
  bad_width[24] = 24;
  write_file(tok / "seed-v2-bad-width.tok", bad_width);
  write_safetensors_seeds(root / "safetensors_file");
  std::printf("wrote seeds under %s\n", root.string().c_str());
  return 0;
}

int replay(const fs::path& root) {
  const bool with_findings = std::getenv("TWOBP_FUZZ_REPLAY_FINDINGS") != nullptr &&
                             std::string(std::getenv("TWOBP_FUZZ_REPLAY_FINDINGS")) == "1";
  int total = 0;
  for (const auto& target : twobp::fuzz::targets()) {
    const fs::path dir = root / target.name;
    if (!fs::is_directory(dir)) {
      std::fprintf(stderr, "fuzz_replay: no corpus directory %s\n", dir.string().c_str());
      return 1;
    }
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file()) files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    int replayed = 0, skipped = 0;
    for (const fs::path& file : files) {
      if (!with_findings && is_unfixed_finding(file.filename().string())) {
        std::printf("  skipping unfixed finding %s/%s\n", target.name, file.filename().string().c_str());
        ++skipped;
        continue;
      }
      std::ifstream in(file, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      twobp::fuzz::set_current_input(file.string());
      target.run(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
    twobp::fuzz::set_current_input("");
    std::printf("%s: replayed %d inputs (%d skipped)\n", target.name, replayed, skipped);
    if (replayed == 0) {
      std::fprintf(stderr, "fuzz_replay: the corpus of %s is empty\n", target.name);
      return 1;
    }
    total += replayed;
  }
  std::printf("fuzz_replay: %d inputs, no findings\n", total);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 2 && args[0] == "--write-seeds") return write_seeds(args[1]);
  if (args.size() > 1 || (args.size() == 1 && args[0].rfind("-", 0) == 0)) {
    std::fprintf(stderr, "usage: fuzz_replay [CORPUS_ROOT] | fuzz_replay --write-seeds CORPUS_ROOT\n");
    return 2;
  }
  return replay(args.empty() ? fs::path(TWOBP_FUZZ_CORPUS_DIR) : fs::path(args[0]));
}
