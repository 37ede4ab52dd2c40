#pragma once
// Quantities written for people, one spelling in every program and message.

#include <string>

namespace twobp::metrics {

/// `bytes` in the largest binary unit that leaves at least 1 (B, KiB, MiB, GiB, TiB), two decimals: "1.50 GiB".
std::string human_bytes(double bytes);

}  // namespace twobp::metrics
