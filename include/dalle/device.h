#pragma once
// Where models run, chosen by name in configs: one resolution for every trainer and tool.
#include <torch/types.h>

#include <string>

namespace dalle {

// "auto" (a GPU when torch sees one, else the CPU), "cpu" or "cuda". `what` prefixes the
// error raised when "cuda" is asked for on a machine without one.
torch::Device resolve_device(const std::string& name, const std::string& what);

}  // namespace dalle
