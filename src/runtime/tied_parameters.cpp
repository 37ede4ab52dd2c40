#include "runtime/tied_parameters.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <set>

#include "runtime/group_transport.h"
#include "twobp/error.h"
#include "util/check.h"

namespace twobp::detail {
namespace {

constexpr int kMaxDims = 8;

// What the copies of a tie must agree on, as numbers: [ndim, dims (-1 past ndim), dtype, requires_grad].
at::Tensor shape_record(const at::Tensor& p) {
  at::Tensor r = at::full({kMaxDims + 3}, -1.0, at::kDouble);
  double* d = r.data_ptr<double>();
  d[0] = static_cast<double>(p.dim());
  for (int64_t k = 0; k < std::min<int64_t>(p.dim(), kMaxDims); ++k) d[1 + k] = static_cast<double>(p.size(k));
  d[kMaxDims + 1] = static_cast<double>(static_cast<int>(p.scalar_type()));
  d[kMaxDims + 2] = p.requires_grad() ? 1.0 : 0.0;
  return r;
}

std::string describe(const at::Tensor& p) {
  return fmt::format("shape [{}] {}{}", fmt::join(p.sizes(), ", "), c10::toString(p.scalar_type()),
                     p.requires_grad() ? "" : " (frozen)");
}

at::Tensor find_parameter(const Stage& stage, const std::string& name) {
  for (const auto& item : stage.module().named_parameters()) {
    if (item.key() == name) return item.value();
  }
  return {};
}

}  // namespace

TiedParameters::TiedParameters(const std::vector<TiedParameter>& ties, const Schedule& schedule,
                               Transport& pipeline, const std::map<int, std::unique_ptr<Stage>>& stages,
                               MasterOf master, const Wait& wait, Duration timeout)
    : master_(std::move(master)) {
  // Every rank resolves every tie in the same order: the splits are collectives over the pipeline.
  for (const TiedParameter& tie : ties) ties_.push_back(resolve(tie, schedule, pipeline, stages, timeout));
  for (Tie& tie : ties_) {
    if (!tie.local.empty()) check_and_sync(tie, wait, timeout);
    for (std::size_t k = tie.first_here ? 1 : 0; k < tie.local.size(); ++k) {
      duplicates_.insert(master_(tie.local[k].second).unsafeGetTensorImpl());
    }
  }
}

TiedParameters::~TiedParameters() = default;

TiedParameters::Tie TiedParameters::resolve(const TiedParameter& tie, const Schedule& schedule, Transport& pipeline,
                                            const std::map<int, std::unique_ptr<Stage>>& stages,
                                            Duration timeout) const {
  const int rank = pipeline.rank();
  TWOBP_CHECK(tie.copies.size() >= 2, UsageError,
              "rank {}: tied parameter '{}' lists {} copies; a tie needs at least two (stage, parameter) copies", rank,
              tie.name, tie.copies.size());
  Tie out;
  out.name = tie.name;
  out.rank = rank;
  std::set<int> seen, holders;
  for (const auto& [stage, name] : tie.copies) {
    TWOBP_CHECK(stage >= 0 && stage < schedule.num_stages && seen.insert(stage).second, UsageError,
                "rank {}: tied parameter '{}': stage {} is {}; expected distinct stages in [0, {})", rank, tie.name,
                stage, seen.count(stage) != 0 ? "listed twice" : "not a stage of the schedule", schedule.num_stages);
    holders.insert(schedule.stage_to_rank[stage]);
  }
  const int first_holder = schedule.stage_to_rank[tie.copies.front().first];
  for (const auto& [stage, name] : tie.copies) {
    auto it = stages.find(stage);
    if (it == stages.end()) continue;
    at::Tensor p = find_parameter(*it->second, name);
    TWOBP_CHECK(p.defined(), UsageError,
                "rank {}: tied parameter '{}': stage {} has no parameter '{}' (its module's named_parameters() names "
                "them); name each copy as its stage's module does",
                rank, tie.name, stage, name);
    for (const auto& [other, q] : out.local) {
      TWOBP_CHECK(!p.is_same(q), UsageError,
                  "rank {}: tied parameter '{}': the copies of stages {} and {} are one tensor, already tied on this "
                  "rank; list only copies that are distinct tensors",
                  rank, tie.name, other, stage);
    }
    out.local.emplace_back(stage, p);
  }
  out.first_here = first_holder == rank;
  out.root = static_cast<int>(std::distance(holders.begin(), holders.find(first_holder)));
  if (holders.size() > 1) {
    // Collective over the pipeline: every rank splits, the holders form the group (ordered by pipeline rank).
    const bool holds = holders.count(rank) != 0;
    out.group = world_named_group(pipeline.split(holds ? 0 : -1, rank, timeout), pipeline,
                                  std::vector<int>(holders.begin(), holders.end()));
  }
  return out;
}

void TiedParameters::check_and_sync(Tie& tie, const Wait& wait, Duration timeout) const {
  c10::NoGradGuard no_grad;
  const at::Tensor first = tie.first_here ? master_(tie.local.front().second) : at::Tensor();
  // The first copy's record, on every holder; each holder compares its copies, and the verdict is shared.
  at::Tensor record = first.defined() ? shape_record(first) : at::zeros({kMaxDims + 3}, at::kDouble);
  std::string mismatch;
  if (tie.group) {
    wait(*tie.group, fmt::format("the check of tied parameter '{}'", tie.name),
         [&] { tie.group->broadcast(record, tie.root, timeout); });
  }
  for (const auto& [stage, p] : tie.local) {
    const at::Tensor m = master_(p);
    if (mismatch.empty() && !at::equal(shape_record(m), record)) {
      mismatch = fmt::format("the copy of stage {} is {}", stage, describe(m));
    }
  }
  at::Tensor bad = at::full({1}, mismatch.empty() ? 0.0 : 1.0, at::kDouble);
  if (tie.group) {
    wait(*tie.group, fmt::format("the check of tied parameter '{}'", tie.name),
         [&] { tie.group->all_reduce_sum(bad, timeout); });
  }
  TWOBP_CHECK(bad.item<double>() == 0.0, UsageError,
              "rank {}: tied parameter '{}': its copies differ ({}); every copy must have the first copy's shape, "
              "dtype and requires_grad",
              tie.rank, tie.name,
              mismatch.empty() ? "on another rank of the tie" : mismatch);
  // The first copy's values everywhere.
  at::Tensor values = first.defined() ? first.detach().contiguous() : master_(tie.local.front().second).detach().clone();
  if (tie.group) {
    if (tie.first_here) values = values.clone();
    wait(*tie.group, fmt::format("the synchronisation of tied parameter '{}'", tie.name),
         [&] { tie.group->broadcast(values, tie.root, timeout); });
  }
  for (const auto& [stage, p] : tie.local) {
    at::Tensor m = master_(p);
    if (!m.is_same(first)) m.detach().copy_(values);
  }
}

void TiedParameters::sum_gradients(const Wait& wait, Duration timeout) {
  c10::NoGradGuard no_grad;
  for (Tie& tie : ties_) {
    if (tie.local.empty()) continue;
    at::Tensor sum;  // this rank's copies, in the order listed, then over the holders (in rank order)
    for (const auto& [stage, p] : tie.local) {
      const at::Tensor g = master_(p).grad();
      if (!g.defined()) continue;
      const at::Tensor dense = g.is_sparse() ? g.to_dense() : g;
      sum = sum.defined() ? sum + dense : dense.clone();
    }
    if (tie.group) {
      at::Tensor any = at::full({1}, sum.defined() ? 1.0 : 0.0, at::kDouble);
      const std::string what = fmt::format("the gradient sum of tied parameter '{}'", tie.name);
      wait(*tie.group, what, [&] { tie.group->all_reduce_sum(any, timeout); });
      if (any.item<double>() == 0.0) continue;
      if (!sum.defined()) sum = at::zeros_like(master_(tie.local.front().second));
      wait(*tie.group, what, [&] { tie.group->all_reduce_sum(sum, timeout); });
    }
    if (!sum.defined()) continue;
    for (const auto& [stage, p] : tie.local) {
      at::Tensor m = master_(p);
      if (m.grad().defined() && !m.grad().is_sparse()) {
        m.mutable_grad().copy_(sum);
      } else {
        m.mutable_grad() = sum.clone();
      }
    }
  }
}

}  // namespace twobp::detail
