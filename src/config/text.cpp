#include "config/text.h"

#include <algorithm>
#include <charconv>
#include <sstream>

namespace dalle {

std::string join_path(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

std::string format_number(double value) {
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

std::string format_double(double value) {
  std::string text = format_number(value);
  // Keep a float looking like a float in YAML ("1" would read back as an integer).
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}

std::string describe_limits(const Limits& limits) {
  std::ostringstream out;
  if (!limits.choices.empty()) {
    out << "one of";
    for (const auto& choice : limits.choices) out << " '" << choice << "'";
  } else if (limits.min && limits.max) {
    out << "in [" << format_number(*limits.min) << ", " << format_number(*limits.max) << "]";
  } else if (limits.min) {
    out << ">= " << format_number(*limits.min);
  } else if (limits.max) {
    out << "<= " << format_number(*limits.max);
  }
  return out.str();
}

Limits dtype_choices(std::vector<std::string> dtypes) {
  static const std::pair<const char*, const char*> kShortNames[] = {
      {"fp32", "float32"}, {"bf16", "bfloat16"}, {"fp16", "float16"}};
  Limits limits{.choices = std::move(dtypes)};
  for (const auto& [old, now] : kShortNames) {
    if (std::find(limits.choices.begin(), limits.choices.end(), now) != limits.choices.end()) {
      limits.old_spellings.emplace_back(old, now);
    }
  }
  return limits;
}

}  // namespace dalle
