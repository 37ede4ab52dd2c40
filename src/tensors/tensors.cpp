#include "twobp/tensors.h"

#include <fmt/format.h>

#include <algorithm>

#include "util/check.h"
#include "util/format.h"

namespace twobp {

NamedTensors::NamedTensors(at::Tensor tensor) {
  if (tensor.defined()) entries_.push_back({std::string(), std::move(tensor)});
}

NamedTensors::NamedTensors(std::initializer_list<std::pair<std::string, at::Tensor>> entries) {
  for (const auto& [name, tensor] : entries) add(name, tensor);
}

NamedTensors& NamedTensors::add(std::string name, at::Tensor tensor) {
  TWOBP_CHECK(!contains(name), UsageError, "NamedTensors: the name '{}' is already taken in {{{}}}", name,
              describe());
  entries_.push_back({std::move(name), std::move(tensor)});
  return *this;
}

bool NamedTensors::contains(std::string_view name) const {
  return std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == name; });
}

at::Tensor& NamedTensors::operator[](std::string_view name) {
  for (auto& e : entries_) {
    if (e.name == name) return e.tensor;
  }
  detail::raise<UsageError>("NamedTensors: no tensor named '{}'; there are {{{}}}", name, describe());
}

const at::Tensor& NamedTensors::operator[](std::string_view name) const {
  return const_cast<NamedTensors&>(*this)[name];
}

const at::Tensor& NamedTensors::single(std::string_view what) const {
  TWOBP_CHECK(entries_.size() == 1, UsageError,
              "{}: expected exactly one tensor, got {} ({{{}}}); a function over several tensors takes and returns "
              "NamedTensors",
              what, entries_.size(), describe());
  return entries_.front().tensor;
}

std::string NamedTensors::describe() const {
  std::string out;
  for (const auto& e : entries_) {
    if (!out.empty()) out += ", ";
    out += e.name.empty() ? std::string("tensor") : e.name;
    out += ' ';
    out += e.tensor.defined() ? detail::describe_shape(e.tensor.sizes(), e.tensor.scalar_type()) : "undefined";
  }
  return out;
}

bool TensorSpec::carries_gradient() const { return requires_grad && c10::isFloatingType(dtype); }

}  // namespace twobp
