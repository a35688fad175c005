#include "dalle/model_config.h"

#include <yaml-cpp/yaml.h>

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

// Whether the dotted `path` is a non-null key under `node`. Recursion with fresh nodes:
// assigning to a YAML::Node would overwrite the node it refers to.
bool names(const YAML::Node& node, std::string_view path) {
  const auto dot = path.find('.');
  if (!node.IsMap()) return false;
  const YAML::Node child = node[std::string(path.substr(0, dot))];
  if (!child) return false;
  return dot == std::string_view::npos ? !child.IsNull() : names(child, path.substr(dot + 1));
}

}  // namespace

void require_model_sizes(const ConfigSource& source, const ConfigVisit& defaults) {
  ModelSizes sizes;
  defaults(sizes);
  YAML::Node root;
  try {
    root = YAML::Load(source.yaml());
  } catch (const YAML::Exception& error) {  // bind_config has read it already; kept as a message
    throw ConfigError(source.name() + ": " + error.what());
  }
  if (!root.IsMap() || !root["model"] || !root["model"].IsMap() || root["model"].size() == 0) {
    throw ConfigError(source.name() + ": no `model` section; a model's config must name its sizes");
  }
  for (const auto& [key, fallback] : sizes.sizes) {
    if (fallback > kLargestOptionalModelSize && !names(root, key)) {
      throw ConfigError(source.name() + ": " + key + " is missing; a model's config must name its sizes (the default, " +
                        std::to_string(fallback) + ", is no fallback)");
    }
  }
}

}  // namespace dalle
