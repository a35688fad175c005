// The config written out: as YAML (a run's config.yaml), as the Markdown key reference
// (docs/config.md) and flattened to key paths with their values.
#include <yaml-cpp/yaml.h>

#include <sstream>
#include <utility>

#include "config/text.h"
#include "dalle/config.h"
#include "dalle/io/atomic_file.h"

namespace dalle {

namespace {

class YamlWriter final : public ConfigVisitor {
 public:
  explicit YamlWriter(YAML::Emitter& out) : out_(out) {}

  void field(std::string_view key, bool& value, std::string_view) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << value;
  }
  void field(std::string_view key, int64_t& value, std::string_view, const Limits&) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << value;
  }
  void field(std::string_view key, double& value, std::string_view, const Limits&) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << format_double(value);
  }
  void field(std::string_view key, std::string& value, std::string_view, const Limits&) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << YAML::DoubleQuoted << value;
  }
  void field(std::string_view key, std::vector<int64_t>& value, std::string_view,
             const Limits&) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << value;
  }
  void field(std::string_view key, std::vector<double>& value, std::string_view, const Limits&) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (double item : value) out_ << format_double(item);
    out_ << YAML::EndSeq;
  }
  void field(std::string_view key, std::vector<std::string>& value, std::string_view,
             const Limits&) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << YAML::BeginSeq;
    for (const auto& item : value) out_ << YAML::DoubleQuoted << item;
    out_ << YAML::EndSeq;
  }
  void section(std::string_view key, std::string_view,
               const std::function<void(ConfigVisitor&)>& body) override {
    out_ << YAML::Key << std::string(key) << YAML::Value << YAML::BeginMap;
    body(*this);
    out_ << YAML::EndMap;
  }

 private:
  YAML::Emitter& out_;
};

class ReferenceWriter final : public ConfigVisitor {
 public:
  void field(std::string_view key, bool& value, std::string_view help) override {
    row(key, "bool", value ? "true" : "false", {}, help);
  }
  void field(std::string_view key, int64_t& value, std::string_view help, const Limits& limits) override {
    row(key, "int", std::to_string(value), limits, help);
  }
  void field(std::string_view key, double& value, std::string_view help, const Limits& limits) override {
    row(key, "float", format_double(value), limits, help);
  }
  void field(std::string_view key, std::string& value, std::string_view help, const Limits& limits) override {
    row(key, "string", "\"" + value + "\"", limits, help);
  }
  void field(std::string_view key, std::vector<int64_t>& value, std::string_view help,
             const Limits& limits) override {
    std::string text = "[";
    for (size_t i = 0; i < value.size(); ++i) text += (i ? ", " : "") + std::to_string(value[i]);
    row(key, "list of int", text + "]", limits, help);
  }
  void field(std::string_view key, std::vector<double>& value, std::string_view help,
             const Limits& limits) override {
    std::string text = "[";
    for (size_t i = 0; i < value.size(); ++i) text += (i ? ", " : "") + format_double(value[i]);
    row(key, "list of float", text + "]", limits, help);
  }
  void field(std::string_view key, std::vector<std::string>& value, std::string_view help,
             const Limits& limits) override {
    std::string text = "[";
    for (size_t i = 0; i < value.size(); ++i) text += (i ? ", " : "") + value[i];
    row(key, "list of string", text + "]", limits, help);
  }
  void section(std::string_view key, std::string_view help,
               const std::function<void(ConfigVisitor&)>& body) override {
    std::string saved = prefix_;
    prefix_ = join_path(prefix_, key);
    out_ << "| `" << prefix_ << "` | section | | | " << help << " |\n";
    body(*this);
    prefix_ = saved;
  }
  std::string text() const {
    return "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n" + out_.str();
  }

 private:
  void row(std::string_view key, const char* type, const std::string& value, const Limits& limits,
           std::string_view help) {
    out_ << "| `" << join_path(prefix_, key) << "` | " << type << " | `" << value << "` | "
         << describe_limits(limits) << " | " << help << " |\n";
  }
  std::string prefix_;
  std::ostringstream out_;
};

class Flattener final : public ConfigVisitor {
 public:
  void field(std::string_view key, bool& value, std::string_view) override { add(key, value ? "true" : "false"); }
  void field(std::string_view key, int64_t& value, std::string_view, const Limits&) override {
    add(key, std::to_string(value));
  }
  void field(std::string_view key, double& value, std::string_view, const Limits&) override {
    add(key, format_double(value));
  }
  void field(std::string_view key, std::string& value, std::string_view, const Limits&) override { add(key, value); }
  void field(std::string_view key, std::vector<int64_t>& value, std::string_view, const Limits&) override {
    std::string text;
    for (auto item : value) text += std::to_string(item) + ",";
    add(key, text);
  }
  void field(std::string_view key, std::vector<double>& value, std::string_view, const Limits&) override {
    std::string text;
    for (double item : value) text += format_double(item) + ",";
    add(key, text);
  }
  void field(std::string_view key, std::vector<std::string>& value, std::string_view, const Limits&) override {
    std::string text;
    for (const auto& item : value) text += item + "\n";
    add(key, text);
  }
  void section(std::string_view key, std::string_view, const std::function<void(ConfigVisitor&)>& body) override {
    const std::string saved = prefix_;
    prefix_ = join_path(prefix_, key);
    body(*this);
    prefix_ = saved;
  }
  std::vector<std::pair<std::string, std::string>> entries;

 private:
  void add(std::string_view key, std::string value) { entries.emplace_back(join_path(prefix_, key), std::move(value)); }
  std::string prefix_;
};

}  // namespace

std::string config_to_yaml(const ConfigVisit& visit) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  YamlWriter writer(out);
  visit(writer);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string config_reference(const ConfigVisit& visit) {
  ReferenceWriter writer;
  visit(writer);
  return writer.text();
}

std::vector<std::pair<std::string, std::string>> flatten_config(const ConfigVisit& visit) {
  Flattener flattener;
  visit(flattener);
  return std::move(flattener.entries);
}

void save_config(const std::string& path, const ConfigVisit& visit) {
  io::write_file_atomic(path, config_to_yaml(visit));
}

}  // namespace dalle
