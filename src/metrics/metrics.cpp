// Metric formulas (see twobp/metrics/metrics.h).

#include "twobp/metrics/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <thread>

#include "twobp/error.h"
#include "util/check.h"
#include "util/cost_check.h"

namespace twobp::metrics {

double bubble_fraction(const std::vector<double>& busy, double step) {
  if (busy.empty() || step <= 0.0) return 0.0;
  double idle = 0.0;
  for (double b : busy) idle += step - b;
  return idle / (step * static_cast<double>(busy.size()));
}

double bubble_fraction(double total_busy, int ranks, double step) {
  if (ranks <= 0 || step <= 0.0) return 0.0;
  return 1.0 - total_busy / (static_cast<double>(ranks) * step);
}

double per_second(double items, double seconds) { return seconds > 0.0 ? items / seconds : 0.0; }

double per_item(double amount, double items) { return items > 0.0 ? amount / items : 0.0; }

double tokens_per_s(double samples_per_s, int64_t tokens_per_sample) {
  return samples_per_s * static_cast<double>(tokens_per_sample);
}

double memory_per_rank(double process_bytes, int ranks_in_process) {
  return process_bytes / static_cast<double>(std::max(1, ranks_in_process));
}

double ring_all_reduce_seconds(double bytes, int ranks, double link_bytes_per_s, double latency_s) {
  detail::check_cost(bytes, "ring_all_reduce_seconds", "bytes", detail::kNoBound, "size in bytes");
  detail::check_cost(latency_s, "ring_all_reduce_seconds", "latency_s");
  if (ranks <= 1 || bytes == 0.0) return 0.0;
  detail::check_positive(link_bytes_per_s, "ring_all_reduce_seconds", "link_bytes_per_s", "bandwidth in bytes/s");
  const double steps = 2.0 * (ranks - 1);  // reduce-scatter + all-gather, n - 1 steps each
  return steps / ranks * bytes / link_bytes_per_s + steps * latency_s;
}

double exposed_wait(const std::vector<double>& wait_per_rank) {
  double most = 0.0;
  for (double w : wait_per_rank) most = std::max(most, w);
  return most;
}

double quantile(std::vector<double> samples, double q) {
  if (samples.empty()) return std::nan("");
  std::sort(samples.begin(), samples.end());
  const double pos = q * static_cast<double>(samples.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const auto hi = std::min(lo + 1, samples.size() - 1);
  return samples[lo] + (pos - static_cast<double>(lo)) * (samples[hi] - samples[lo]);
}

Summary summarize(const std::vector<double>& samples) {
  Summary s;
  s.count = samples.size();
  s.min = quantile(samples, 0.0);
  s.p25 = quantile(samples, 0.25);
  s.median = quantile(samples, 0.5);
  s.p75 = quantile(samples, 0.75);
  s.max = quantile(samples, 1.0);
  return s;
}

void Series::add(const std::string& name, double value) {
  auto it = std::find_if(series_.begin(), series_.end(), [&](const auto& s) { return s.first == name; });
  if (it == series_.end()) it = series_.emplace(series_.end(), name, std::vector<double>{});
  it->second.push_back(value);
}

const std::vector<double>& Series::get(const std::string& name) const {
  for (const auto& s : series_) {
    if (s.first == name) return s.second;
  }
  detail::raise<UsageError>("Series: no samples named '{}'", name);
}

bool Series::has(const std::string& name) const {
  return std::any_of(series_.begin(), series_.end(), [&](const auto& s) { return s.first == name; });
}

double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  return in >> load ? load : -1.0;
}

std::string load_warning(const std::string& command, const std::string& quieter, double load) {
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores == 0 || load <= cores) return "";
  return fmt::format("{}: warning: load average {:.2f} on {} cores; other processes take cores from the timed "
                     "threads, see the spread (or use {})",
                     command, load, cores, quieter);
}

}  // namespace twobp::metrics
