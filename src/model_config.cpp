#include "dalle/model_config.h"

#include <string_view>
#include <vector>

namespace dalle {
namespace {

// The integer keys of the `model` section, with their defaults (the values a fresh config
// struct holds).
class ModelSizes final : public ConfigVisitor {
 public:
  std::vector<std::pair<std::string, int64_t>> sizes;

  void field(std::string_view, bool&, std::string_view) override {}
  void field(std::string_view key, int64_t& value, std::string_view, const Limits&) override {
    if (in_model()) sizes.emplace_back(path_ + "." + std::string(key), value);
  }
  void field(std::string_view, double&, std::string_view, const Limits&) override {}
  void field(std::string_view, std::string&, std::string_view, const Limits&) override {}
  void field(std::string_view, std::vector<int64_t>&, std::string_view, const Limits&) override {}
  void field(std::string_view, std::vector<double>&, std::string_view, const Limits&) override {}
  void field(std::string_view, std::vector<std::string>&, std::string_view, const Limits&) override {}
  void section(std::string_view key, std::string_view, const std::function<void(ConfigVisitor&)>& body) override {
    const std::string outer = path_;
    path_ = outer.empty() ? std::string(key) : outer + "." + std::string(key);
    body(*this);
    path_ = outer;
  }

 private:
  bool in_model() const { return path_ == "model" || path_.rfind("model.", 0) == 0; }
  std::string path_;
};

}  // namespace

void require_model_sizes(const ConfigSource& source, const ConfigVisit& defaults) {
  ModelSizes sizes;
  defaults(sizes);
  for (const auto& [key, fallback] : sizes.sizes) {
    if (fallback > kLargestOptionalModelSize && !names_key(source, key)) {
      throw ConfigError(source.name() + ": " + key + " is missing; a model's config must name its sizes (the default, " +
                        std::to_string(fallback) + ", is no fallback)");
    }
  }
}

}  // namespace dalle
