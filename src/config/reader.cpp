// Binding: a config document read into the fields a visit names, every value checked.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>

#include "config/document.h"
#include "config/text.h"
#include "dalle/config.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"

namespace dalle {

namespace {

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

// Reads a YAML tree into the visited fields; every key the visit does not name is an error.
class YamlReader final : public ConfigVisitor {
 public:
  YamlReader(const ConfigDocument& source, YAML::Node node, std::string prefix)
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
      value = checked_choice(key, n, n.as<std::string>(), limits);
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
        parsed.push_back(checked_choice(key, item, item.as<std::string>(), limits));
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
    // Built by append: GCC 12 warns falsely (-Wstringop-overflow) on "literal" + string&&.
    throw ConfigError(where(node, path).append(": ").append(message));
  }

  // "--set a.b=c", or "file:line:column" (the base file that gave `path`, when one did).
  std::string where(const YAML::Node& node, const std::string& path) const {
    auto override_text = source_.overrides.find(path);
    if (override_text != source_.overrides.end()) return std::string("--set ").append(override_text->second);
    const YAML::Mark mark = node.Mark();
    const auto base = source_.from_base.find(path);
    std::string where = base == source_.from_base.end() ? source_.name : base->second;
    if (!mark.is_null()) {
      // Appended piecewise for the same GCC 12 false warning.
      where.append(":").append(std::to_string(mark.line + 1)).append(":").append(std::to_string(mark.column + 1));
    }
    return where;
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

  // `value` when `limits` allow it; an older spelling of an allowed value becomes that value,
  // with a warning; anything else is refused.
  std::string checked_choice(std::string_view key, const YAML::Node& node, const std::string& value,
                             const Limits& limits) const {
    if (limits.choices.empty()) return value;
    if (std::find(limits.choices.begin(), limits.choices.end(), value) != limits.choices.end()) return value;
    const std::string path = join_path(prefix_, key);
    for (const auto& [old, now] : limits.old_spellings) {
      if (old != value) continue;
      log::warn(where(node, path), ": ", path, ": '", old, "' is now spelled '", now, "' (read as '", now, "')");
      return now;
    }
    fail(node, path, path + ": " + excerpt(value) + " is not allowed, expected " + describe_limits(limits));
  }

  const ConfigDocument& source_;
  YAML::Node node_;
  std::string prefix_;
  std::set<std::string> known_;
};

}  // namespace

void bind_config(const ConfigSource& source, const ConfigVisit& visit) {
  const auto& document = document_of(source);
  YamlReader reader(document, document.root, "");
  visit(reader);
  reader.refuse_unknown_keys();
}

std::string peek_choice(const ConfigSource& source, std::string_view key, const std::string& fallback,
                        const std::vector<std::string>& choices) {
  const auto& document = document_of(source);
  YamlReader reader(document, document.root, "");
  std::string value = fallback;
  reader.field(key, value, "", {.choices = choices});
  return value;
}

void bind_config_parts(const ConfigSource& source, const ConfigVisit& visit, const std::vector<std::string>& required) {
  const auto& document = document_of(source);
  for (const auto& key : required) {
    const bool present = document.root.IsMap() && document.root[key] && !document.root[key].IsNull() &&
                         !(document.root[key].IsMap() && document.root[key].size() == 0);
    if (!present) throw ConfigError(document.name + ": '" + key + "' is missing or empty; a model's config must name its sizes");
  }
  YamlReader reader(document, document.root, "");
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
  const auto end = path_end(document_of(source).root, path);
  if (!end) return fallback;
  YamlReader reader(document_of(source), end->section, end->prefix);
  int64_t value = fallback;
  reader.field(end->key, value, "", limits);
  return value;
}

bool names_key(const ConfigSource& source, std::string_view path) {
  const auto end = path_end(document_of(source).root, path);
  if (!end || !end->section.IsMap()) return false;
  const YAML::Node value = std::as_const(end->section)[end->key];
  return value && !value.IsNull();
}

}  // namespace dalle
