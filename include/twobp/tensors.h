#pragma once
// What crosses a stage boundary: an ordered set of named tensors (a hidden state plus an attention mask and
// position ids, an encoder output beside a decoder state, ...), and the specs that describe it.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace twobp {

/// An ordered set of uniquely named tensors: a stage's inputs or outputs for one micro-batch, the data of a
/// batch, or the gradients flowing back through a boundary.
///
/// Which tensors carry a gradient follows autograd: a floating-point output that requires grad when the stage
/// returns it is differentiable (its gradient comes back in I and is sent upstream); anything else -- masks, ids,
/// a detach()ed tensor -- is sent forward only, and no gradient message is sent for it.
///
/// A one-tensor set converts implicitly from at::Tensor (named ""), so single-tensor code reads as before; an
/// undefined at::Tensor converts to the empty set ("none given"). An undefined tensor *named* in a set means
/// "no gradient" where the set holds gradients.
class NamedTensors {
 public:
  struct Entry {
    std::string name;
    at::Tensor tensor;
  };

  NamedTensors() = default;
  NamedTensors(at::Tensor tensor);  // NOLINT(google-explicit-constructor): single-tensor code stays unchanged
  NamedTensors(std::initializer_list<std::pair<std::string, at::Tensor>> entries);

  /// Appends `tensor` under `name`; throws UsageError when the name is taken.
  NamedTensors& add(std::string name, at::Tensor tensor);
  /// The tensor named `name`; throws UsageError listing the names there are.
  const at::Tensor& operator[](std::string_view name) const;
  at::Tensor& operator[](std::string_view name);
  bool contains(std::string_view name) const;

  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const Entry& entry(std::size_t i) const { return entries_.at(i); }
  Entry& entry(std::size_t i) { return entries_.at(i); }
  std::vector<Entry>::const_iterator begin() const { return entries_.begin(); }
  std::vector<Entry>::const_iterator end() const { return entries_.end(); }
  std::vector<Entry>::iterator begin() { return entries_.begin(); }
  std::vector<Entry>::iterator end() { return entries_.end(); }
  /// The only tensor of a one-tensor set; throws UsageError naming `what` (e.g. "rank 1 stage 2") otherwise.
  const at::Tensor& single(std::string_view what) const;
  /// "hidden float[2, 8, 16], mask bool[2, 8]" ("" names print as "tensor"), for error messages.
  std::string describe() const;

 private:
  std::vector<Entry> entries_;
};

/// Shape and dtype of one tensor that crosses a stage boundary for one micro-batch.
struct TensorSpec {
  TensorSpec() = default;
  /// TensorSpec{{batch, seq, dim}, at::kBFloat16} for a one-tensor boundary; name and gradient for several.
  TensorSpec(std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat, std::string name = {},
             bool requires_grad = true)
      : shape(std::move(shape)), dtype(dtype), name(std::move(name)), requires_grad(requires_grad) {}

  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  /// Its name in the boundary's NamedTensors ("" for a one-tensor boundary).
  std::string name;
  /// Whether a gradient flows back through it. Only floating-point tensors can carry one; the sender's tensor
  /// must agree (requires grad exactly when this is set and the dtype is floating).
  bool requires_grad = true;

  /// Whether this spec's tensor carries a gradient: requires_grad and a floating-point dtype.
  bool carries_gradient() const;
};

/// Every tensor of one boundary, in the order the sending stage returns them.
using BoundarySpec = std::vector<TensorSpec>;

}  // namespace twobp
