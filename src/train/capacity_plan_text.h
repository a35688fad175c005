#pragma once
// What the capacity planner (train/capacity_plan.cpp) and its report
// (train/capacity_plan_report.cpp) both write. Private to the library.
#include <cstdint>
#include <string>

namespace dalle::train::detail {

inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// 12293849088 as "12,293,849,088".
std::string with_thousands(int64_t value);

}  // namespace dalle::train::detail
