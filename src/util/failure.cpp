#include "util/failure.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <fmt/format.h>

#include <regex>
#include <typeinfo>

#include "twobp/error.h"

namespace twobp::detail {
namespace {

// The most derived twobp type first (ScheduleError is a UsageError).
std::string type_name(const std::exception& e) {
  if (dynamic_cast<const ScheduleError*>(&e) != nullptr) return "ScheduleError";
  if (dynamic_cast<const UsageError*>(&e) != nullptr) return "UsageError";
  if (dynamic_cast<const NumericalError*>(&e) != nullptr) return "NumericalError";
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr) return "TimeoutError";
  if (dynamic_cast<const TransportError*>(&e) != nullptr) return "TransportError";
  if (dynamic_cast<const IOError*>(&e) != nullptr) return "IOError";
  if (dynamic_cast<const Error*>(&e) != nullptr) return "Error";
  // LibTorch's types: named for the reader; as_root_type's pattern (\w+) skips them, so peers raise TransportError.
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return "c10::OutOfMemoryError";
  if (dynamic_cast<const c10::Error*>(&e) != nullptr) return "c10::Error";
  // Anything else (the user's own types, the standard library's): its C++ name, e.g. "std::runtime_error".
  return c10::demangle(typeid(e).name());
}

// LibTorch's what() carries a C++ backtrace of dozens of lines; the peers get the message and its context.
const char* message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

template <class E>
std::exception_ptr peer(const std::string& what, int rank) {
  return std::make_exception_ptr(PeerError<E>(what, rank));
}

}  // namespace

std::string failure_reason(int rank, const std::exception& e, const std::string& where) {
  // A re-raised peer error already quotes its root's reason: passing it on unchanged keeps that rank as the root.
  if (dynamic_cast<const RaisedOnAnotherRank*>(&e) != nullptr) return e.what();
  return placed(fmt::format("rank {} failed ({}): {}", rank, type_name(e), message(e)), where);
}

std::string placed(std::string text, const std::string& where) {
  if (!where.empty()) text += fmt::format(" (in {})", where);
  return text;
}

std::exception_ptr as_root_type(const std::exception& e) {
  if (dynamic_cast<const TransportError*>(&e) == nullptr || dynamic_cast<const RaisedOnAnotherRank*>(&e) != nullptr) {
    return nullptr;
  }
  // A rank that failed only because of another one quotes that one's reason after its own (as TransportError):
  // the first reason of a type other than TransportError is the root's.
  static const std::regex reason(R"(rank (\d+) failed \((\w+)\): )");
  const std::string what = e.what();
  for (auto it = std::sregex_iterator(what.begin(), what.end(), reason); it != std::sregex_iterator(); ++it) {
    const int rank = std::stoi((*it)[1].str());
    const std::string type = (*it)[2].str();
    if (type == "ScheduleError") return peer<ScheduleError>(what, rank);
    if (type == "UsageError") return peer<UsageError>(what, rank);
    if (type == "NumericalError") return peer<NumericalError>(what, rank);
    if (type == "TimeoutError") return peer<TimeoutError>(what, rank);
    if (type == "IOError") return peer<IOError>(what, rank);
  }
  return nullptr;  // a transport failure, or not one of ours: TransportError says it already
}

}  // namespace twobp::detail
