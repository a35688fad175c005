#pragma once
// A parsed config document: its YAML tree with the `--set` overrides and `base:` files that
// gave its keys, shared by the source that builds it and the reader that binds it.
#include <yaml-cpp/yaml.h>

#include <map>
#include <string>

#include "dalle/config.h"

namespace dalle {

struct ConfigDocument {
  std::string name;
  YAML::Node root;
  // Key path -> the `--set` text that gave it, to name the override in errors.
  std::map<std::string, std::string> overrides;
  // Key path -> the `base:` file that gave it, to name that file in errors.
  std::map<std::string, std::string> from_base;
};

const ConfigDocument& document_of(const ConfigSource& source);

}  // namespace dalle
