#pragma once
// Text inside SVG (and any XML) output: the five characters XML reserves, escaped. Shared by the library's
// timeline pictures and charts (twobp/trace/).

#include <string>

namespace twobp::detail {

inline std::string xml_escaped(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace twobp::detail
