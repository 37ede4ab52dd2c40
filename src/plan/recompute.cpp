// Rank sets for recomputation (twobp/plan/recompute.h).

#include "twobp/plan/recompute.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <numeric>

#include "util/check.h"

namespace twobp {

std::vector<int> recomputing_ranks(bool recompute, int first, std::string_view on, int num_ranks) {
  if (!recompute) return {};
  if (!on.empty()) {
    TWOBP_CHECK(first <= 0, UsageError,
                "recomputation on the first {} ranks and on ranks '{}': give one of them (--recompute-ranks or "
                "--recompute-on)",
                first, on);
    try {
      return parse_ranks(on, num_ranks);
    } catch (const UsageError& e) {
      throw UsageError(fmt::format("--recompute-on: {}", e.what()));  // the flag the command lines spell it with
    }
  }
  const int count = first > 0 ? std::min(first, num_ranks) : num_ranks;
  std::vector<int> ranks(static_cast<std::size_t>(std::max(count, 0)));
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

bool has_rank(const std::vector<int>& ranks, int rank) { return std::binary_search(ranks.begin(), ranks.end(), rank); }

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? std::to_string(ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> parse_ranks(std::string_view text, int num_ranks) {
  auto fail = [&](const std::string& why) {
    return UsageError(fmt::format("ranks '{}': {} (ranks and ranges of ranks 0 .. {}, e.g. \"0-1,3\")", text, why,
                                  num_ranks - 1));
  };
  auto number = [&](std::string_view digits) {
    int value = 0;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) {
      throw fail(fmt::format("'{}' is not a rank", digits));
    }
    if (value < 0 || value >= num_ranks) throw fail(fmt::format("no rank {} in a pipeline of {}", value, num_ranks));
    return value;
  };
  if (text.empty()) throw fail("no rank given");
  std::vector<int> ranks;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view item = text.substr(at, comma - at);
    const std::size_t dash = item.find('-');
    const int from = number(item.substr(0, dash));
    const int to = dash == std::string_view::npos ? from : number(item.substr(dash + 1));
    if (to < from) throw fail(fmt::format("the range '{}' runs backwards", item));
    for (int r = from; r <= to; ++r) ranks.push_back(r);
    at = comma + 1;
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

std::vector<int> recompute_order(const std::vector<double>& peaks, int num_ranks) {
  TWOBP_CHECK(peaks.empty() || static_cast<int>(peaks.size()) == num_ranks, UsageError,
              "recompute_order: {} peaks for {} ranks (one per rank, or none)", peaks.size(), num_ranks);
  std::vector<int> order(static_cast<std::size_t>(num_ranks));
  std::iota(order.begin(), order.end(), 0);
  if (!peaks.empty()) {
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return peaks[a] > peaks[b]; });
  }
  return order;
}

std::vector<int> first_ranks_of(const std::vector<int>& order, int count) {
  std::vector<int> ranks(order.begin(), order.begin() + std::clamp<std::ptrdiff_t>(count, 0, order.size()));
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

}  // namespace twobp
