#include "runtime/boundary.h"

#include <ATen/ATen.h>

#include <cstring>

#include "util/check.h"

namespace twobp::detail {
namespace {

constexpr std::int64_t kMagic = 0x74627062'6e647279;  // "tbpbndry"
constexpr std::int64_t kPresent = 1, kGradient = 2;

}  // namespace

std::vector<AnnouncedTensor> announce(const NamedTensors& tensors, const std::vector<bool>& carries_gradient) {
  std::vector<AnnouncedTensor> out;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors.entry(i);
    AnnouncedTensor a;
    a.name = name;
    a.present = t.defined();
    a.carries_gradient = carries_gradient.at(i);
    if (t.defined()) {
      a.dtype = t.scalar_type();
      a.shape = t.sizes().vec();
    }
    out.push_back(std::move(a));
  }
  return out;
}

at::Tensor encode_header(const std::vector<AnnouncedTensor>& announced, std::string_view where) {
  std::vector<std::int64_t> slots{kMagic, static_cast<std::int64_t>(announced.size())};
  for (const auto& a : announced) {
    slots.push_back((a.present ? kPresent : 0) | (a.carries_gradient ? kGradient : 0));
    slots.push_back(static_cast<std::int64_t>(a.dtype));
    slots.push_back(static_cast<std::int64_t>(a.shape.size()));
    slots.insert(slots.end(), a.shape.begin(), a.shape.end());
    slots.push_back(static_cast<std::int64_t>(a.name.size()));
    const std::size_t first = slots.size();
    slots.resize(first + (a.name.size() + 7) / 8, 0);
    if (!a.name.empty()) std::memcpy(slots.data() + first, a.name.data(), a.name.size());
  }
  TWOBP_CHECK(static_cast<int>(slots.size()) <= kHeaderSlots, UsageError,
              "{}: announcing {} tensors needs {} header slots, more than the {} there are: send fewer or "
              "lower-dimensional tensors, shorter names, or give activation specs (then nothing is announced)",
              where, announced.size(), slots.size(), kHeaderSlots);
  slots.resize(kHeaderSlots, 0);
  return at::tensor(slots, at::kLong);
}

std::vector<AnnouncedTensor> decode_header(const at::Tensor& header, std::string_view where) {
  const at::Tensor host = header.to(at::kCPU).contiguous();
  TWOBP_CHECK(host.scalar_type() == at::kLong && host.numel() == kHeaderSlots, TransportError,
              "{}: a shape header must be {} int64 values", where, kHeaderSlots);
  const std::int64_t* p = host.data_ptr<std::int64_t>();
  const std::int64_t* const end = p + kHeaderSlots;
  auto next = [&]() {
    TWOBP_CHECK(p < end, TransportError, "{}: malformed shape header (it runs past its {} slots)", where,
                kHeaderSlots);
    return *p++;
  };
  TWOBP_CHECK(next() == kMagic, TransportError,
              "{}: malformed shape header (wrong magic number): the peer sent something else on this channel", where);
  const std::int64_t count = next();
  TWOBP_CHECK(count >= 0 && count <= kHeaderSlots, TransportError, "{}: malformed shape header ({} tensors)", where,
              count);
  std::vector<AnnouncedTensor> out(count);
  for (auto& a : out) {
    const std::int64_t flags = next();
    a.present = flags & kPresent;
    a.carries_gradient = flags & kGradient;
    a.dtype = static_cast<at::ScalarType>(next());
    const std::int64_t ndim = next();
    TWOBP_CHECK(ndim >= 0 && ndim < kHeaderSlots, TransportError, "{}: malformed shape header (ndim {})", where,
                ndim);
    for (std::int64_t d = 0; d < ndim; ++d) a.shape.push_back(next());
    const std::int64_t length = next();
    TWOBP_CHECK(length >= 0 && length <= 8 * (end - p), TransportError,
                "{}: malformed shape header (name of {} bytes)", where, length);
    a.name.assign(reinterpret_cast<const char*>(p), static_cast<std::size_t>(length));
    p += (length + 7) / 8;
  }
  return out;
}

}  // namespace twobp::detail
