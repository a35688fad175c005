#pragma once
// Where models run and in which floating-point type, chosen by name in configs: one
// resolution for every trainer and tool.
#include <torch/types.h>

#include <string>

namespace dalle {

// "auto" (a GPU when torch sees one, else the CPU), "cpu" or "cuda". `what` prefixes the
// error raised when "cuda" is asked for on a machine without one.
torch::Device resolve_device(const std::string& name, const std::string& what);

// "float32", "bfloat16" or "float16" (configs offer these choices).
torch::ScalarType float_type_named(const std::string& name);

}  // namespace dalle
