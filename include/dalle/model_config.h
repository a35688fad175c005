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

// Throws ConfigError naming the file and the key unless `source` names every integer key of
// `model` whose default exceeds kLargestOptionalModelSize. `defaults` visits a
// default-constructed config. (bind_config_parts refuses a missing or empty section first.)
void require_model_sizes(const ConfigSource& source, const ConfigVisit& defaults);

// The same for a `model` section of type ModelConfig.
template <class ModelConfig>
void require_model_sizes(const ConfigSource& source) {
  ModelConfig defaults;
  require_model_sizes(source, [&defaults](ConfigVisitor& v) { v.section("model", "", defaults); });
}

}  // namespace dalle
