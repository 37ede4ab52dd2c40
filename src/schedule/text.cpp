// The text form of a schedule: one header line, then one "rank <r>: <ACTION> <stage> <mb>[,<mb>...]" per action,
// followed by " overlap" on the F of an overlapped F&B pair (Action::overlapped_with_next).

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "twobp/schedule/pytorch_csv.h"
#include "twobp/schedule/schedule.h"
#include "twobp/schedule/text.h"
#include "twobp/files.h"
#include "util/check.h"
#include "util/format.h"

namespace twobp {
namespace {

constexpr std::string_view kMagic = "twobp-schedule";
constexpr std::string_view kVersion = "v1";
constexpr std::string_view kActionSyntax = "'rank <r>: <ACTION> <stage> <mb>[,<mb>...] [overlap]'";
constexpr std::string_view kOverlap = "overlap";

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t\r");
  return s.substr(first, last - first + 1);
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  std::size_t begin = 0;
  while (true) {
    const auto end = s.find(sep, begin);
    parts.push_back(s.substr(begin, end == std::string_view::npos ? std::string_view::npos : end - begin));
    if (end == std::string_view::npos) break;
    begin = end + 1;
  }
  return parts;
}

std::vector<std::string_view> tokens(std::string_view s) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
    const std::size_t begin = i;
    while (i < s.size() && s[i] != ' ' && s[i] != '\t') ++i;
    if (i > begin) out.push_back(s.substr(begin, i - begin));
  }
  return out;
}

std::optional<int> parse_int(std::string_view s) {
  int value = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty() || value < 0) return std::nullopt;
  return value;
}

std::optional<ActionType> parse_type(std::string_view s) {
  static const ActionType kAll[] = {ActionType::kForward,      ActionType::kBackwardInput, ActionType::kBackwardWeight,
                                    ActionType::kBackward,     ActionType::kSendForward,   ActionType::kRecvForward,
                                    ActionType::kSendBackward, ActionType::kRecvBackward};
  for (ActionType t : kAll) {
    if (s == to_string(t)) return t;
  }
  return std::nullopt;
}

class Parser {
 public:
  Schedule parse(std::string_view text) {
    bool have_header = false;
    int line_no = 0;
    for (std::string_view raw : split(text, '\n')) {
      ++line_no;
      line_no_ = line_no;
      line_ = trim(raw);
      const auto hash = line_.find('#');
      std::string_view content = trim(line_.substr(0, hash));
      if (content.empty()) continue;
      if (!have_header) {
        parse_header(content);
        have_header = true;
      } else {
        parse_action(content);
      }
    }
    if (!have_header) {
      detail::raise<ScheduleError>(
          "load_schedule: no header found; expected a first line like '{} {} name=<name> "
          "ranks=<n> stages=<n> microbatches=<n> backward=<standard|split> placement=<r>,...'",
          kMagic, kVersion);
    }
    return std::move(schedule_);
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> expected, Args&&... args) const {
    detail::raise<ScheduleError>("load_schedule: line {}: '{}': {}", line_no_, line_,
                                 fmt::format(expected, std::forward<Args>(args)...));
  }

  int number(std::string_view token, std::string_view what) const {
    const auto value = parse_int(token);
    if (!value) fail("expected {} to be a non-negative integer, found '{}'", what, token);
    return *value;
  }

  void parse_header(std::string_view content) {
    const auto t = tokens(content);
    if (t.size() < 2 || t[0] != kMagic) {
      fail("expected the header '{} {} name=... ranks=... stages=... microbatches=... backward=... placement=...'",
           kMagic, kVersion);
    }
    if (t[1] != kVersion) fail("unsupported version '{}', expected '{}'", t[1], kVersion);
    std::map<std::string_view, std::string_view> fields;
    for (std::size_t i = 2; i < t.size(); ++i) {
      const auto eq = t[i].find('=');
      if (eq == std::string_view::npos) fail("expected key=value in the header, found '{}'", t[i]);
      const std::string_view k = t[i].substr(0, eq);
      if (!fields.emplace(k, t[i].substr(eq + 1)).second) fail("header key '{}' appears twice", k);
    }
    static const std::string_view kKeys[] = {"name", "ranks", "stages", "microbatches", "backward", "placement"};
    for (std::string_view k : kKeys) {
      if (!fields.count(k))
        fail(
            "the header lacks '{}=', expected all of name, ranks, stages, microbatches, "
            "backward and placement",
            k);
    }
    if (fields.size() != std::size(kKeys)) {
      for (const auto& [k, v] : fields) {
        if (std::find(std::begin(kKeys), std::end(kKeys), k) == std::end(kKeys)) fail("unknown header key '{}'", k);
      }
    }
    schedule_.name = std::string(fields["name"]);
    for (char c : schedule_.name) {
      // dump_schedule() must be able to write the name back: no whitespace, control characters or '#'.
      if (static_cast<unsigned char>(c) < 0x21 || c == 0x7f || c == '#') {
        fail("expected a schedule name without whitespace, control characters or '#'");
      }
    }
    schedule_.num_ranks = number(fields["ranks"], "ranks");
    schedule_.num_stages = number(fields["stages"], "stages");
    schedule_.num_micro_batches = number(fields["microbatches"], "microbatches");
    if (schedule_.num_ranks < 1 || schedule_.num_stages < 1 || schedule_.num_micro_batches < 1) {
      fail("expected ranks, stages and microbatches to be at least 1");
    }
    if (schedule_.num_ranks > schedule_.num_stages) {
      fail("expected at most one rank per stage, found {} ranks for {} stages", schedule_.num_ranks,
           schedule_.num_stages);
    }
    // Any spelling parse_backward_mode() reads: files of before wrote "split" for 2bp.
    const std::string_view mode = fields["backward"];
    try {
      schedule_.backward = parse_backward_mode(mode);
    } catch (const UsageError&) {
      fail("expected backward=standard or backward=2bp (or split), found '{}'", mode);
    }
    for (std::string_view r : split(fields["placement"], ',')) {
      const int rank = number(r, "a placement entry");
      if (rank >= schedule_.num_ranks)
        fail("placement names rank {}, expected ranks in [0, {})", rank, schedule_.num_ranks);
      schedule_.stage_to_rank.push_back(rank);
    }
    if (static_cast<int>(schedule_.stage_to_rank.size()) != schedule_.num_stages) {
      fail("placement has {} entries, expected one rank per stage ({})", schedule_.stage_to_rank.size(),
           schedule_.num_stages);
    }
    schedule_.actions.assign(schedule_.num_ranks, {});
  }

  void parse_action(std::string_view content) {
    const auto t = tokens(content);
    if ((t.size() != 5 && !(t.size() == 6 && t[5] == kOverlap)) || t[0] != "rank" || t[1].size() < 2 ||
        t[1].back() != ':') {
      fail("expected an action line {}", kActionSyntax);
    }
    const int rank = number(t[1].substr(0, t[1].size() - 1), "the rank");
    if (rank >= schedule_.num_ranks) fail("rank {} out of range, expected [0, {})", rank, schedule_.num_ranks);
    const auto type = parse_type(t[2]);
    if (!type) fail("unknown action '{}', expected one of F, I, W, B, SEND_F, RECV_F, SEND_B, RECV_B", t[2]);
    Action a;
    a.type = *type;
    a.stage = number(t[3], "the stage");
    if (a.stage >= schedule_.num_stages) fail("stage {} out of range, expected [0, {})", a.stage, schedule_.num_stages);
    for (std::string_view mb : split(t[4], ',')) {
      const int value = number(mb, "a micro-batch");
      if (value >= schedule_.num_micro_batches) {
        fail("micro-batch {} out of range, expected [0, {})", value, schedule_.num_micro_batches);
      }
      a.micro_batches.push_back(value);
    }
    if (a.type != ActionType::kBackwardWeight && a.micro_batches.size() != 1) {
      fail("{} takes exactly one micro-batch; only W may list several", t[2]);
    }
    a.overlapped_with_next = t.size() == 6;
    if (a.overlapped_with_next && a.type != ActionType::kForward) {
      fail("only an F opens an overlapped pair ('{}' marks the F whose next action is the B or I it overlaps)",
           kOverlap);
    }
    schedule_.actions[rank].push_back(std::move(a));
  }

  Schedule schedule_;
  int line_no_ = 0;
  std::string_view line_;
};

}  // namespace

std::string dump_schedule(const Schedule& schedule) {
  // The name is one whitespace-free token of the header; anything else could not be read back.
  for (char c : schedule.name) {
    TWOBP_CHECK(c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '#', ScheduleError,
                "dump_schedule: the schedule name '{}' contains whitespace or '#', which the text form cannot hold",
                schedule.name);
  }
  std::string out = fmt::format(
      "{} {} name={} ranks={} stages={} microbatches={} backward={} placement={}\n", kMagic, kVersion, schedule.name,
      schedule.num_ranks, schedule.num_stages, schedule.num_micro_batches,
      to_string(schedule.backward), fmt::join(schedule.stage_to_rank, ","));
  for (std::size_t r = 0; r < schedule.actions.size(); ++r) {
    for (const Action& a : schedule.actions[r]) {
      out += fmt::format("rank {}: {} {} {}{}\n", r, to_string(a.type), a.stage, fmt::join(a.micro_batches, ","),
                         a.overlapped_with_next ? " overlap" : "");
    }
  }
  return out;
}

Schedule load_schedule(std::string_view text) { return Parser().parse(detail::without_utf8_bom(text)); }

namespace {
// The one rule for a schedule file's form: PyTorch's CSV by the name's ending, else twobp's text form.
bool names_csv(const std::string& path) { return path.size() >= 4 && path.compare(path.size() - 4, 4, ".csv") == 0; }
}  // namespace

void save_schedule_file(const std::string& path, const Schedule& schedule) {
  write_file(path, names_csv(path) ? to_pytorch_csv(schedule) : dump_schedule(schedule), "schedule file");
}

Schedule load_schedule_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TWOBP_CHECK(in.good(), IOError, "cannot read schedule file '{}'", path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  try {
    if (names_csv(path)) return from_pytorch_csv(text);
    return load_schedule(text);
  } catch (const ScheduleError& e) {
    detail::raise<ScheduleError>("schedule file '{}': {}", path, e.what());
  }
}

}  // namespace twobp
