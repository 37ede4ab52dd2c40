#include "twobp/metrics/step_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "twobp/error.h"

namespace twobp::metrics {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

nlohmann::json optional_json(const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(); }

}  // namespace

std::string format_step(const StepRecord& r, int steps, double elapsed_s, double remaining_s,
                        double memory_limit_bytes) {
  return fmt::format(
      "step {:>5}/{} | loss {:.4f} | {}{}grad norm {:.3f} | lr {:.2e} | {:.0f} tok/s | peak {} | {}elapsed {:.1f}s | "
      "remaining {:.1f}s",
      r.step + 1, steps, r.loss, r.skipped ? "update skipped (non-finite) | " : "",
      r.eval_loss ? fmt::format("val loss {:.4f} (ppl {:.2f}) | ", *r.eval_loss, std::exp(*r.eval_loss)) : "",
      r.grad_norm, r.lr, r.tokens_per_s,
      r.peak_memory_bytes < 0
          ? std::string("n/a (rank threads share the GPU)")
          : fmt::format("{:.1f} MiB{}", r.peak_memory_bytes / kMiB,
                        r.memory_limit_held == false
                            ? fmt::format(" (over the {:.3g} MiB limit)", memory_limit_bytes / kMiB)
                            : ""),
      r.j_per_token ? fmt::format("{:.3g} J/tok | ", *r.j_per_token) : "", elapsed_s, remaining_s);
}

std::string format_progress(const std::string& what, int k, int total, double elapsed_s) {
  if (k < 1 || k > total) {
    throw UsageError(fmt::format("format_progress: {} {} of {} (expected 1 <= k <= total)", what, k, total));
  }
  const int done = k - 1;
  const std::string remaining =
      done == 0 ? "?" : fmt::format("~{:.1f}s", elapsed_s / done * static_cast<double>(total - done));
  return fmt::format("{} {}/{} | elapsed {:.1f}s | remaining {}", what, k, total, elapsed_s, remaining);
}

std::vector<std::string> summarize_steps(const std::vector<StepRecord>& records, double wall_s) {
  if (records.empty()) return {};
  double loss_sum = 0;
  std::vector<double> rates;
  for (const StepRecord& r : records) {
    loss_sum += r.loss;
    rates.push_back(r.tokens_per_s);
  }
  std::sort(rates.begin(), rates.end());
  std::vector<std::string> lines{
      fmt::format("done: {} steps (to step {}) in {:.1f} s | final loss {:.4f} | mean loss {:.4f} | median {:.0f} "
                  "tok/s",
                  records.size(), records.back().step + 1, wall_s, records.back().loss, loss_sum / records.size(),
                  rates[rates.size() / 2])};
  const auto limited =
      std::count_if(records.begin(), records.end(), [](const StepRecord& r) { return r.memory_limit_held.has_value(); });
  if (limited > 0) {
    const auto held = std::count_if(records.begin(), records.end(),
                                    [](const StepRecord& r) { return r.memory_limit_held.value_or(false); });
    lines.push_back(fmt::format("memory limit held on {} of {} steps", held, limited));
  }
  return lines;
}

std::string steps_json(const std::vector<StepRecord>& records) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepRecord& r : records) {
    nlohmann::json step{{"step", r.step},
                        {"loss", r.loss},
                        {"tokens_per_s", r.tokens_per_s},
                        {"grad_norm", r.grad_norm},
                        {"lr", r.lr},
                        {"peak_memory_bytes", r.peak_memory_bytes},
                        {"energy_j", optional_json(r.energy_j)},
                        {"j_per_token", optional_json(r.j_per_token)}};
    if (r.skipped) step["skipped"] = true;
    if (r.memory_limit_held) step["memory_limit_held"] = *r.memory_limit_held;
    if (r.eval_loss) {
      step["eval_loss"] = *r.eval_loss;
      step["eval_perplexity"] = std::exp(*r.eval_loss);
    }
    steps.push_back(step);
  }
  return steps.dump();
}

}  // namespace twobp::metrics
