#pragma once
// How config key paths and values are spelled in messages and in the files written.
#include <string>
#include <string_view>

#include "dalle/config.h"

namespace dalle {

// "prefix.key", or "key" at the top.
std::string join_path(const std::string& prefix, std::string_view key);
// The shortest text that reads back as the same double.
std::string format_number(double value);
// format_number, looking like a float in YAML ("1.0", never "1", which reads back as an integer).
std::string format_double(double value);
// "one of 'a' 'b'", "in [0, 1]", ">= 0": what `limits` allow.
std::string describe_limits(const Limits& limits);

}  // namespace dalle
