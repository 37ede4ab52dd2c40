#pragma once
// PipelineOptions::tied_parameters (twobp/runtime/pipeline.h, TiedParameter): the copies of each tied weight on
// this rank's stages, the group of the ranks that hold copies, and the per-step sum of the copies' gradients.

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "twobp/runtime/pipeline.h"

namespace twobp::detail {

class TiedParameters {
 public:
  /// A parameter's master (mixed precision) or the parameter itself: what holds the gradient the optimizer steps.
  using MasterOf = std::function<at::Tensor(const at::Tensor&)>;
  /// Runs a blocking collective over a group as a wait on the status board (Pipeline::wait_in).
  using Wait = std::function<void(Transport& group, const std::string& what, const std::function<void()>& run)>;

  /// Resolves `ties` on this rank's `stages`, checks them and sets every copy to the first copy's values.
  /// Collective over `pipeline` (a split per tie that spans ranks, then a check and a broadcast over its group).
  /// UsageError naming the tie, the stage and the copy for a malformed list, a missing parameter, copies that are
  /// one tensor, or copies that differ in shape, dtype or requires_grad.
  TiedParameters(const std::vector<TiedParameter>& ties, const Schedule& schedule, Transport& pipeline,
                 const std::map<int, std::unique_ptr<Stage>>& stages, MasterOf master, const Wait& wait,
                 Duration timeout);
  ~TiedParameters();

  /// After a step's backward: every copy's gradient becomes the sum of all copies' (undefined where all are).
  /// Collective over each tie's group.
  void sum_gradients(const Wait& wait, Duration timeout);
  /// The masters of every copy but each tie's first, which the gradient norm leaves out.
  const std::unordered_set<const c10::TensorImpl*>& duplicates() const { return duplicates_; }

 private:
  struct Tie {
    std::string name;
    int rank = 0;                                   ///< this rank in the pipeline
    std::vector<std::pair<int, at::Tensor>> local;  ///< (stage, parameter) of this rank, in the order listed
    bool first_here = false;                        ///< this rank holds the first copy listed
    int root = 0;                                   ///< the group rank holding the first copy
    std::unique_ptr<Transport> group;               ///< ranks holding copies, when more than one does
  };
  Tie resolve(const TiedParameter& tie, const Schedule& schedule, Transport& pipeline,
              const std::map<int, std::unique_ptr<Stage>>& stages, Duration timeout) const;
  void check_and_sync(Tie& tie, const Wait& wait, Duration timeout) const;
  std::vector<Tie> ties_;
  MasterOf master_;
  std::unordered_set<const c10::TensorImpl*> duplicates_;
};

}  // namespace twobp::detail
