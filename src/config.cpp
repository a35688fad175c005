#include "dalle/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"

namespace dalle {

struct ConfigSource::Impl {
  std::string name;
  YAML::Node root;
  // Key path -> the `--set` text that gave it, to name the override in errors.
  std::map<std::string, std::string> overrides;
  // Key path -> the `base:` file that gave it, to name that file in errors.
  std::map<std::string, std::string> from_base;
};

namespace {

std::string join_path(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The shortest text that reads back as the same double.
std::string format_number(double value) {
  char buffer[64];
  auto result = std::to_chars(buffer, buffer + sizeof buffer, value);
  return std::string(buffer, result.ptr);
}

std::string format_double(double value) {
  std::string text = format_number(value);
  // Keep a float looking like a float in YAML ("1" would read back as an integer).
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  return text;
}

std::string describe_limits(const Limits& limits) {
  std::ostringstream out;
  if (!limits.choices.empty()) {
    out << "one of";
    for (const auto& choice : limits.choices) out << " '" << choice << "'";
  } else if (limits.min && limits.max) {
    out << "in [" << format_number(*limits.min) << ", " << format_number(*limits.max) << "]";
  } else if (limits.min) {
    out << ">= " << format_number(*limits.min);
  } else if (limits.max) {
    out << "<= " << format_number(*limits.max);
  }
  return out.str();
}

// Reads a YAML tree into the visited fields; every key the visit does not name is an error.
class YamlReader final : public ConfigVisitor {
 public:
  YamlReader(const ConfigSource::Impl& source, YAML::Node node, std::string prefix)
      : source_(source), node_(std::move(node)), prefix_(std::move(prefix)) {}

  void field(std::string_view key, bool& value, std::string_view) override {
    read_scalar(key, "a boolean (true or false)", [&](const YAML::Node& n) { value = n.as<bool>(); });
  }
  void field(std::string_view key, int64_t& value, std::string_view, const Limits& limits) override {
    read_scalar(key, "an integer", [&](const YAML::Node& n) {
      int64_t parsed = n.as<int64_t>();
      check_number(key, n, static_cast<double>(parsed), limits);
      value = parsed;
    });
  }
  void field(std::string_view key, double& value, std::string_view, const Limits& limits) override {
    read_scalar(key, "a number", [&](const YAML::Node& n) {
      double parsed = n.as<double>();
      check_number(key, n, parsed, limits);
      value = parsed;
    });
  }
  void field(std::string_view key, std::string& value, std::string_view, const Limits& limits) override {
    read_scalar(key, "a string", [&](const YAML::Node& n) {
      std::string parsed = n.as<std::string>();
      check_choice(key, n, parsed, limits);
      value = parsed;
    });
  }
  void field(std::string_view key, std::vector<int64_t>& value, std::string_view,
             const Limits& limits) override {
    read_sequence(key, "a list of integers", [&](const YAML::Node& n) {
      std::vector<int64_t> parsed;
      for (const auto& item : n) {
        int64_t number = item.as<int64_t>();
        check_number(key, item, static_cast<double>(number), limits);
        parsed.push_back(number);
      }
      value = std::move(parsed);
    });
  }
  void field(std::string_view key, std::vector<double>& value, std::string_view, const Limits& limits) override {
    read_sequence(key, "a list of numbers", [&](const YAML::Node& n) {
      std::vector<double> parsed;
      for (const auto& item : n) {
        parsed.push_back(item.as<double>());
        check_number(key, item, parsed.back(), limits);
      }
      value = std::move(parsed);
    });
  }
  void field(std::string_view key, std::vector<std::string>& value, std::string_view,
             const Limits& limits) override {
    read_sequence(key, "a list of strings", [&](const YAML::Node& n) {
      std::vector<std::string> parsed;
      for (const auto& item : n) {
        if (!item.IsScalar()) throw YAML::BadConversion(item.Mark());
        parsed.push_back(item.as<std::string>());
        check_choice(key, item, parsed.back(), limits);
      }
      value = std::move(parsed);
    });
  }
  void section(std::string_view key, std::string_view,
               const std::function<void(ConfigVisitor&)>& body) override {
    known_.insert(std::string(key));
    const auto child = lookup(key);
    const std::string path = join_path(prefix_, key);
    if (child && !child->IsNull() && !child->IsMap()) {
      fail(*child, path, path + ": expected a section (a mapping of keys to values)");
    }
    YamlReader inner(source_, child ? *child : YAML::Node(), path);
    body(inner);
    inner.refuse_unknown_keys();
  }

  void moved(std::string_view key, std::string_view new_path) override {
    const auto child = lookup(key);
    if (!child) return;
    const std::string path = join_path(prefix_, key);
    fail(*child, path, "'" + path + "' has moved to '" + std::string(new_path) + "'");
  }

  void refuse_unknown_keys() const {
    if (!node_.IsMap()) return;
    for (const auto& entry : node_) {
      std::string key = entry.first.as<std::string>();
      if (known_.count(key)) continue;
      std::string message = "unknown key '" + join_path(prefix_, key) + "'";
      std::string best;
      size_t best_distance = 3;
      for (const auto& candidate : known_) {
        size_t distance = edit_distance(key, candidate);
        if (distance < best_distance) best_distance = distance, best = candidate;
      }
      if (!best.empty()) message += " (did you mean '" + join_path(prefix_, best) + "'?)";
      else message += describe_known();
      fail(entry.first, join_path(prefix_, key), message);
    }
  }

  [[noreturn]] void fail(const YAML::Node& node, const std::string& path,
                         const std::string& message) const {
    auto override_text = source_.overrides.find(path);
    if (override_text != source_.overrides.end()) {
      // Built by append: GCC 12 warns falsely (-Wstringop-overflow) on "literal" + string&&.
      throw ConfigError(std::string("--set ").append(override_text->second).append(": ").append(message));
    }
    const YAML::Mark mark = node.Mark();
    const auto base = source_.from_base.find(path);
    std::string where = base == source_.from_base.end() ? source_.name : base->second;
    if (!mark.is_null()) {
      // Appended piecewise for the same GCC 12 false warning.
      where.append(":").append(std::to_string(mark.line + 1)).append(":").append(std::to_string(mark.column + 1));
    }
    throw ConfigError(where.append(": ").append(message));
  }

 private:
  std::optional<YAML::Node> lookup(std::string_view key) const {
    if (!node_.IsMap()) return std::nullopt;
    for (const auto& entry : node_) {
      if (entry.first.as<std::string>() == key) return entry.second;
    }
    return std::nullopt;
  }

  std::string describe_known() const {
    std::string known = " (known keys here:";
    for (const auto& candidate : known_) known += " " + candidate;
    return known + ")";
  }

  template <class Parse>
  void read_scalar(std::string_view key, const std::string& expected, Parse parse) {
    read_node(key, expected, YAML::NodeType::Scalar, parse);
  }

  template <class Parse>
  void read_sequence(std::string_view key, const std::string& expected, Parse parse) {
    read_node(key, expected, YAML::NodeType::Sequence, parse);
  }

  // Reads `key` when present: a node of another type than `type`, or one `parse` cannot
  // convert, is refused as not what was `expected` (a scalar is quoted in the message).
  template <class Parse>
  void read_node(std::string_view key, const std::string& expected, YAML::NodeType::value type, Parse parse) {
    known_.insert(std::string(key));
    const auto child = lookup(key);
    if (!child) return;
    const std::string path = join_path(prefix_, key);
    if (child->Type() != type) fail(*child, path, path + ": expected " + expected);
    try {
      parse(*child);
    } catch (const YAML::BadConversion&) {
      const std::string got = child->IsScalar() ? ", got " + excerpt(child->Scalar()) : "";
      fail(*child, path, path + ": expected " + expected + got);
    }
  }

  void check_number(std::string_view key, const YAML::Node& node, double value,
                    const Limits& limits) const {
    if (!std::isfinite(value)) {
      const std::string path = join_path(prefix_, key);
      fail(node, path, path + ": expected a finite number, got " + excerpt(node.Scalar()));
    }
    if ((limits.min && value < *limits.min) || (limits.max && value > *limits.max)) {
      const std::string path = join_path(prefix_, key);
      fail(node, path, path + ": " + node.Scalar() + " is out of range, expected a value " +
                           describe_limits(limits));
    }
  }

  void check_choice(std::string_view key, const YAML::Node& node, const std::string& value,
                    const Limits& limits) const {
    if (limits.choices.empty()) return;
    if (std::find(limits.choices.begin(), limits.choices.end(), value) != limits.choices.end()) return;
    const std::string path = join_path(prefix_, key);
    fail(node, path, path + ": " + excerpt(value) + " is not allowed, expected " + describe_limits(limits));
  }

  const ConfigSource::Impl& source_;
  YAML::Node node_;
  std::string prefix_;
  std::set<std::string> known_;
};

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

// YAML requires a mapping's keys to be unique, but yaml-cpp keeps both and lookups find one:
// a key given twice is refused with both lines, never resolved silently.
void refuse_duplicate_keys(const YAML::Node& node, const std::string& prefix, const std::string& name) {
  if (node.IsSequence()) {
    for (const auto& item : node) refuse_duplicate_keys(item, prefix, name);
  }
  if (!node.IsMap()) return;
  std::map<std::string, int> first_line;
  for (const auto& entry : node) {
    const auto key = entry.first.IsScalar() ? entry.first.Scalar() : YAML::Dump(entry.first);
    const int line = entry.first.Mark().line + 1;
    const auto [seen, inserted] = first_line.emplace(key, line);
    if (!inserted) {
      throw ConfigError(name + ":" + std::to_string(line) + ": key '" + join_path(prefix, key) +
                        "' is given twice (lines " + std::to_string(seen->second) + " and " + std::to_string(line) +
                        "); YAML keys must be unique within a mapping");
    }
    refuse_duplicate_keys(entry.second, join_path(prefix, key), name);
  }
}

YAML::Node parse_yaml(const std::string& text, const std::string& name, bool is_file) {
  try {
    auto root = is_file ? YAML::LoadFile(name) : YAML::Load(text);
    refuse_duplicate_keys(root, "", name);
    return root;
  } catch (const YAML::BadFile&) {
    throw ConfigError(name + ": cannot read the config file");
  } catch (const YAML::ParserException& error) {
    throw ConfigError(name + ":" + std::to_string(error.mark.line + 1) + ":" +
                      std::to_string(error.mark.column + 1) + ": YAML syntax error: " + error.msg);
  }
}

void require_mapping(const ConfigSource::Impl& impl) {
  if (impl.root && !impl.root.IsNull() && !impl.root.IsMap()) {
    throw ConfigError(impl.name + ": the config must be a mapping of keys to values");
  }
}

}  // namespace

ConfigSource::ConfigSource(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {

constexpr size_t kMaxBaseDepth = 8;

// Every key path under `node` (sections too) -> `file`, unless `inherited` names an older one.
void note_origins(const YAML::Node& node, const std::string& prefix, const std::string& file,
                  const std::map<std::string, std::string>& inherited, std::map<std::string, std::string>& origins) {
  if (!node.IsMap()) return;
  for (const auto& entry : node) {
    const auto path = join_path(prefix, entry.first.as<std::string>());
    const auto older = inherited.find(path);
    origins[path] = older == inherited.end() ? file : older->second;
    note_origins(entry.second, path, file, inherited, origins);
  }
}

void forget_origins(const std::string& path, std::map<std::string, std::string>& origins) {
  for (auto it = origins.lower_bound(path); it != origins.end();) {
    const bool under = it->first == path || it->first.rfind(path + ".", 0) == 0;
    if (!under) break;
    it = origins.erase(it);
  }
}

// `into` (the base's document) takes each key of `over`: sections merge key by key, anything
// else (values, lists) replaces the base's whole.
void merge_over(YAML::Node into, const YAML::Node& over, const std::string& prefix,
                std::map<std::string, std::string>& origins) {
  for (const auto& entry : over) {
    const auto key = entry.first.as<std::string>();
    const auto path = join_path(prefix, key);
    YAML::Node existing = into[key];
    if (existing.IsMap() && entry.second.IsMap()) {
      origins.erase(path);
      merge_over(existing, entry.second, path, origins);
    } else {
      forget_origins(path, origins);
      into[key] = entry.second;
    }
  }
}

std::filesystem::path canonical_of(const std::filesystem::path& path) {
  std::error_code ignored;  // a file that cannot be resolved is reported when it is read
  return std::filesystem::weakly_canonical(path, ignored);
}

// The file that `base_node` (a `base:` value in `path`) names, relative to `path`, refused
// when it is no path, would start a cycle or goes too deep; pushed onto `chain`.
std::filesystem::path push_base_file(const std::string& path, const YAML::Node& base_node,
                                     std::vector<std::filesystem::path>& chain) {
  if (!base_node.IsScalar() || base_node.Scalar().empty()) {
    throw ConfigError(path + ":" + std::to_string(base_node.Mark().line + 1) +
                      ": base: expected the path of a config file to start from");
  }
  const auto base = (std::filesystem::path(path).parent_path() / base_node.Scalar()).lexically_normal();
  const auto canonical = canonical_of(base);
  if (std::find(chain.begin(), chain.end(), canonical) != chain.end()) {
    throw ConfigError(path + ": base: " + base.string() + " starts from this file again (a cycle)");
  }
  if (chain.size() >= kMaxBaseDepth) {
    throw ConfigError(path + ": base: more than " + std::to_string(kMaxBaseDepth) + " files deep");
  }
  chain.push_back(canonical);
  return base;
}

// `chain`: the files being read, outermost first, to refuse cycles.
std::shared_ptr<ConfigSource::Impl> load_file(const std::string& path, std::vector<std::filesystem::path>& chain) {
  auto impl = std::make_shared<ConfigSource::Impl>();
  impl->name = path;
  impl->root = parse_yaml({}, path, /*is_file=*/true);
  require_mapping(*impl);
  const YAML::Node& root = impl->root;  // const: looking up a key must not add it
  if (!root.IsMap() || !root["base"]) return impl;
  const auto base_path = push_base_file(path, root["base"], chain);
  const auto base = load_file(base_path.string(), chain);
  chain.pop_back();

  // Handles moved with reset, never assigned: assigning a YAML::Node rewrites the node it
  // refers to, and cloning drops the line numbers that errors cite.
  YAML::Node own;
  own.reset(impl->root);
  own.remove("base");
  impl->root.reset(base->root);
  note_origins(impl->root, "", base->name, base->from_base, impl->from_base);
  merge_over(impl->root, own, "", impl->from_base);
  return impl;
}

}  // namespace

ConfigSource ConfigSource::from_file(const std::string& path) {
  std::vector<std::filesystem::path> chain{canonical_of(path)};
  return ConfigSource(load_file(path, chain));
}

ConfigSource ConfigSource::from_string(const std::string& text, const std::string& name) {
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  impl->root = parse_yaml(text, name, /*is_file=*/false);
  require_mapping(*impl);
  return ConfigSource(impl);
}

ConfigSource ConfigSource::empty() { return from_string("{}", "<defaults>"); }

const std::string& ConfigSource::name() const { return impl_->name; }

namespace {

struct Assignment {
  std::string path;  // "a.b.c"
  std::vector<std::string> parts;
  YAML::Node value;
};

Assignment parse_assignment(const std::string& assignment) {
  const auto equals = assignment.find('=');
  if (equals == std::string::npos || equals == 0) {
    throw ConfigError("--set " + assignment + ": expected key.path=value");
  }
  Assignment parsed{assignment.substr(0, equals), {}, {}};
  try {
    parsed.value = YAML::Load(assignment.substr(equals + 1));
  } catch (const YAML::ParserException& error) {
    throw ConfigError("--set " + assignment + ": the value is not valid YAML: " + error.msg);
  }
  std::stringstream stream(parsed.path);
  for (std::string part; std::getline(stream, part, '.');) {
    if (part.empty()) throw ConfigError("--set " + assignment + ": empty key in '" + parsed.path + "'");
    parsed.parts.push_back(part);
  }
  return parsed;
}

// What a YAML value holds, as far as a config key's type goes.
enum class ValueKind { absent, section, list, flag, integer, number, text };

ValueKind kind_of(const YAML::Node& node) {
  if (!node || node.IsNull()) return ValueKind::absent;
  if (node.IsMap()) return ValueKind::section;
  if (node.IsSequence()) return ValueKind::list;
  const auto& text = node.Scalar();
  if (node.Tag() == "!") return ValueKind::text;  // quoted
  // Every spelling the config reader takes as a boolean (True, yes, on, ...), not only true/false.
  if (bool flag = false; YAML::convert<bool>::decode(node, flag)) return ValueKind::flag;
  int64_t integer = 0;
  const auto end = text.data() + text.size();
  if (auto [ptr, error] = std::from_chars(text.data(), end, integer); error == std::errc() && ptr == end) {
    return ValueKind::integer;
  }
  double number = 0;
  if (auto [ptr, error] = std::from_chars(text.data(), end, number); error == std::errc() && ptr == end) {
    return ValueKind::number;
  }
  return ValueKind::text;
}

bool fits(ValueKind existing, ValueKind value) {
  if (existing == ValueKind::absent || existing == ValueKind::text) return value != ValueKind::section;
  if (existing == ValueKind::number) return value == ValueKind::number || value == ValueKind::integer;
  return existing == value;
}

std::string describe(ValueKind kind) {
  switch (kind) {
    case ValueKind::absent: return "empty";
    case ValueKind::section: return "a section";
    case ValueKind::list: return "a list";
    case ValueKind::flag: return "true or false";
    case ValueKind::integer: return "an integer";
    case ValueKind::number: return "a number";
    case ValueKind::text: return "text";
  }
  return "";
}

// The value as the key's kind is written: an integer given for a number stays a number, and
// a flag is true or false, for the next reader and the next override.
YAML::Node normalized(const YAML::Node& value, ValueKind existing, ValueKind kind) {
  if (existing == ValueKind::number && kind == ValueKind::integer) return YAML::Node(value.Scalar() + ".0");
  if (existing == ValueKind::flag) return YAML::Node(value.as<bool>());
  return value;
}

}  // namespace

void ConfigSource::set(const std::string& assignment) {
  const auto parsed = parse_assignment(assignment);
  if (!impl_->root || impl_->root.IsNull()) impl_->root = YAML::Node(YAML::NodeType::Map);
  YAML::Node node = impl_->root;
  std::string walked;
  for (size_t i = 0; i + 1 < parsed.parts.size(); ++i) {
    walked = join_path(walked, parsed.parts[i]);
    YAML::Node child = node[parsed.parts[i]];
    if (!child || child.IsNull()) child = YAML::Node(YAML::NodeType::Map);
    if (!child.IsMap()) throw ConfigError("--set " + assignment + ": '" + walked + "' is not a section");
    impl_->overrides.emplace(walked, assignment);
    node.reset(child);
  }
  node[parsed.parts.back()] = parsed.value;
  impl_->overrides[parsed.path] = assignment;
}

void ConfigSource::replace(const std::string& assignment) {
  const auto parsed = parse_assignment(assignment);
  YAML::Node node = impl_->root;
  for (const auto& part : parsed.parts) {
    if (!node || !node.IsMap() || !node[part]) {
      throw ConfigError("--set " + assignment + ": " + impl_->name + " has no key '" + parsed.path + "'");
    }
    node.reset(node[part]);
  }
  const auto existing = kind_of(node), value = kind_of(parsed.value);
  if (!fits(existing, value)) {
    throw ConfigError("--set " + assignment + ": " + impl_->name + " has '" + parsed.path + "' as " +
                      describe(existing) + ", and the new value is " + describe(value));
  }
  node = normalized(parsed.value, existing, value);
  impl_->overrides[parsed.path] = assignment;
}

std::string ConfigSource::yaml() const {
  YAML::Emitter out;
  out << impl_->root;
  return std::string(out.c_str()) + "\n";
}

void ConfigSource::set_all(const std::vector<std::string>& assignments) {
  for (const auto& assignment : assignments) set(assignment);
}

void bind_config(const ConfigSource& source, const ConfigVisit& visit) {
  const auto& impl = source.impl();
  YamlReader reader(impl, impl.root, "");
  visit(reader);
  reader.refuse_unknown_keys();
}

std::string peek_choice(const ConfigSource& source, std::string_view key, const std::string& fallback,
                        const std::vector<std::string>& choices) {
  const auto& impl = source.impl();
  YamlReader reader(impl, impl.root, "");
  std::string value = fallback;
  reader.field(key, value, "", {.choices = choices});
  return value;
}

void bind_config_parts(const ConfigSource& source, const ConfigVisit& visit, const std::vector<std::string>& required) {
  const auto& impl = source.impl();
  for (const auto& key : required) {
    const bool present = impl.root.IsMap() && impl.root[key] && !impl.root[key].IsNull() &&
                         !(impl.root[key].IsMap() && impl.root[key].size() == 0);
    if (!present) throw ConfigError(impl.name + ": '" + key + "' is missing or empty; a model's config must name its sizes");
  }
  YamlReader reader(impl, impl.root, "");
  visit(reader);
}

namespace {

// The section that holds the last key of a dotted path, with the section's own path and
// that key; nothing when a section on the way is missing or not a mapping.
struct PathEnd {
  YAML::Node section;
  std::string prefix;
  std::string key;
};
std::optional<PathEnd> path_end(const YAML::Node& root, std::string_view path) {
  PathEnd end;
  // reset(), not assignment: assigning a yaml-cpp node writes into the document.
  end.section.reset(root);
  for (auto dot = path.find('.'); dot != std::string_view::npos; dot = path.find('.')) {
    const std::string key(path.substr(0, dot));
    if (!end.section.IsMap()) return std::nullopt;
    const YAML::Node child = std::as_const(end.section)[key];
    if (!child || !child.IsMap()) return std::nullopt;
    end.section.reset(child);
    end.prefix = join_path(end.prefix, key);
    path.remove_prefix(dot + 1);
  }
  end.key = std::string(path);
  return end;
}

}  // namespace

int64_t peek_integer(const ConfigSource& source, std::string_view path, int64_t fallback, const Limits& limits) {
  const auto end = path_end(source.impl().root, path);
  if (!end) return fallback;
  YamlReader reader(source.impl(), end->section, end->prefix);
  int64_t value = fallback;
  reader.field(end->key, value, "", limits);
  return value;
}

bool names_key(const ConfigSource& source, std::string_view path) {
  const auto end = path_end(source.impl().root, path);
  if (!end || !end->section.IsMap()) return false;
  const YAML::Node value = std::as_const(end->section)[end->key];
  return value && !value.IsNull();
}

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
