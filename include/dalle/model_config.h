#pragma once
// A model's config as a checkpoint's config.yaml gives it. Defaults keep a recipe short,
// but a model loaded from a checkpoint must take its sizes from the file: the prior's
// defaults are the 12B model, so an empty or cut config.yaml must be refused, not built.
#include <string>

#include "dalle/config.h"

namespace dalle {

// Integer keys of `model` whose defaults are at most this may be left out (channel counts,
// ratios, ids, block counts); larger ones are widths, depths, vocabularies or lengths.
inline constexpr int64_t kLargestOptionalModelSize = 16;

// Throws ConfigError naming the file and the key unless `source` has a `model` section that
// names every integer key of it whose default exceeds kLargestOptionalModelSize. `defaults`
// visits a default-constructed config.
void require_model_sizes(const ConfigSource& source, const ConfigVisit& defaults);

// load_config for a checkpoint's config: the same validation, and the sizes named.
template <class Config>
Config load_model_config(const std::string& yaml, const std::string& where) {
  const auto source = ConfigSource::from_string(yaml, where);
  auto config = load_config<Config>(source);
  Config defaults;
  require_model_sizes(source, visit_of(defaults));
  return config;
}

}  // namespace dalle
