// A config source: the YAML document read from a file or text, checked for keys given twice,
// started from its `base:` files, and changed by `--set` overrides.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "config/document.h"
#include "config/text.h"
#include "dalle/config.h"

namespace dalle {

namespace {

// The most values a document may hold, an alias counted as the values it repeats: a real
// recipe holds hundreds, and nested aliases (the "billion laughs") would hold billions.
constexpr size_t kMaxExpandedValues = 1'000'000;

// Checks a parsed document once per node, however often aliases repeat it. YAML requires a
// mapping's keys to be unique, but yaml-cpp keeps both and lookups find one: a key given
// twice is refused with both lines, never resolved silently.
class DocumentCheck {
 public:
  explicit DocumentCheck(std::string name) : name_(std::move(name)) {}

  void run(const YAML::Node& root) {
    if (values(root, "") > kMaxExpandedValues) {
      throw ConfigError(name_ + ": its aliases expand to over " + std::to_string(kMaxExpandedValues) +
                        " values; a config repeats a section by naming it a few times, not by nesting "
                        "aliases of aliases");
    }
  }

 private:
  // An alias is the very node its anchor names: the same place in the text, the same type.
  using NodeId = std::pair<size_t, int>;

  // The values under `node`, aliases expanded (at most kMaxExpandedValues + 1); the keys of
  // each mapping refused when given twice, the first time the mapping is met.
  size_t values(const YAML::Node& node, const std::string& prefix) {
    if (!node.IsMap() && !node.IsSequence()) return 1;
    const YAML::Mark mark = node.Mark();
    const NodeId id{static_cast<size_t>(mark.pos), static_cast<int>(node.Type())};
    if (!mark.is_null()) {
      if (const auto known = counted_.find(id); known != counted_.end()) return known->second;
      if (!open_.insert(id).second) {
        throw ConfigError(name_ + ":" + std::to_string(mark.line + 1) + ": an alias under '" + prefix +
                          "' names a section that holds it (a cycle)");
      }
    }
    size_t total = 1;
    if (node.IsSequence()) {
      for (const auto& item : node) total = bounded_sum(total, values(item, prefix));
    } else {
      std::map<std::string, int> first_line;
      for (const auto& entry : node) {
        const auto key = key_of(entry.first);
        refuse_twice(first_line, key, entry.first.Mark().line + 1, prefix);
        total = bounded_sum(total, values(entry.second, join_path(prefix, key)));
      }
    }
    if (!mark.is_null()) {
      counted_.emplace(id, total);
      open_.erase(id);
    }
    return total;
  }

  void refuse_twice(std::map<std::string, int>& first_line, const std::string& key, int line,
                    const std::string& prefix) const {
    const auto [seen, inserted] = first_line.emplace(key, line);
    if (inserted) return;
    throw ConfigError(name_ + ":" + std::to_string(line) + ": key '" + join_path(prefix, key) +
                      "' is given twice (lines " + std::to_string(seen->second) + " and " + std::to_string(line) +
                      "); YAML keys must be unique within a mapping");
  }

  static std::string key_of(const YAML::Node& key) { return key.IsScalar() ? key.Scalar() : YAML::Dump(key); }
  static size_t bounded_sum(size_t a, size_t b) { return std::min(a + b, kMaxExpandedValues + 1); }

  std::string name_;
  std::map<NodeId, size_t> counted_;
  std::set<NodeId> open_;  // the sections being counted, to refuse one that holds itself
};

YAML::Node parse_yaml(const std::string& text, const std::string& name, bool is_file) {
  try {
    auto root = is_file ? YAML::LoadFile(name) : YAML::Load(text);
    DocumentCheck(name).run(root);
    return root;
  } catch (const YAML::BadFile&) {
    throw ConfigError(name + ": cannot read the config file");
  } catch (const YAML::ParserException& error) {
    throw ConfigError(name + ":" + std::to_string(error.mark.line + 1) + ":" +
                      std::to_string(error.mark.column + 1) + ": YAML syntax error: " + error.msg);
  }
}

void require_mapping(const ConfigDocument& document) {
  if (document.root && !document.root.IsNull() && !document.root.IsMap()) {
    throw ConfigError(document.name + ": the config must be a mapping of keys to values");
  }
}

}  // namespace

ConfigSource::ConfigSource(std::shared_ptr<ConfigDocument> document) : document_(std::move(document)) {}

const ConfigDocument& document_of(const ConfigSource& source) { return *source.document_; }

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
std::shared_ptr<ConfigDocument> load_file(const std::string& path, std::vector<std::filesystem::path>& chain) {
  auto document = std::make_shared<ConfigDocument>();
  document->name = path;
  document->root = parse_yaml({}, path, /*is_file=*/true);
  require_mapping(*document);
  const YAML::Node& root = document->root;  // const: looking up a key must not add it
  if (!root.IsMap() || !root["base"]) return document;
  const auto base_path = push_base_file(path, root["base"], chain);
  const auto base = load_file(base_path.string(), chain);
  chain.pop_back();

  // Handles moved with reset, never assigned: assigning a YAML::Node rewrites the node it
  // refers to, and cloning drops the line numbers that errors cite.
  YAML::Node own;
  own.reset(document->root);
  own.remove("base");
  document->root.reset(base->root);
  note_origins(document->root, "", base->name, base->from_base, document->from_base);
  merge_over(document->root, own, "", document->from_base);
  return document;
}

}  // namespace

ConfigSource ConfigSource::from_file(const std::string& path) {
  std::vector<std::filesystem::path> chain{canonical_of(path)};
  return ConfigSource(load_file(path, chain));
}

ConfigSource ConfigSource::from_string(const std::string& text, const std::string& name) {
  auto document = std::make_shared<ConfigDocument>();
  document->name = name;
  document->root = parse_yaml(text, name, /*is_file=*/false);
  require_mapping(*document);
  return ConfigSource(document);
}

ConfigSource ConfigSource::empty() { return from_string("{}", "<defaults>"); }

const std::string& ConfigSource::name() const { return document_->name; }

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
  if (!document_->root || document_->root.IsNull()) document_->root = YAML::Node(YAML::NodeType::Map);
  YAML::Node node = document_->root;
  std::string walked;
  for (size_t i = 0; i + 1 < parsed.parts.size(); ++i) {
    walked = join_path(walked, parsed.parts[i]);
    YAML::Node child = node[parsed.parts[i]];
    if (!child || child.IsNull()) child = YAML::Node(YAML::NodeType::Map);
    if (!child.IsMap()) throw ConfigError("--set " + assignment + ": '" + walked + "' is not a section");
    document_->overrides.emplace(walked, assignment);
    node.reset(child);
  }
  node[parsed.parts.back()] = parsed.value;
  document_->overrides[parsed.path] = assignment;
}

void ConfigSource::replace(const std::string& assignment) {
  const auto parsed = parse_assignment(assignment);
  YAML::Node node = document_->root;
  for (const auto& part : parsed.parts) {
    if (!node || !node.IsMap() || !node[part]) {
      throw ConfigError("--set " + assignment + ": " + document_->name + " has no key '" + parsed.path + "'");
    }
    node.reset(node[part]);
  }
  const auto existing = kind_of(node), value = kind_of(parsed.value);
  if (!fits(existing, value)) {
    throw ConfigError("--set " + assignment + ": " + document_->name + " has '" + parsed.path + "' as " +
                      describe(existing) + ", and the new value is " + describe(value));
  }
  node = normalized(parsed.value, existing, value);
  document_->overrides[parsed.path] = assignment;
}

std::string ConfigSource::yaml() const {
  YAML::Emitter out;
  out << document_->root;
  return std::string(out.c_str()) + "\n";
}

void ConfigSource::set_all(const std::vector<std::string>& assignments) {
  for (const auto& assignment : assignments) set(assignment);
}

}  // namespace dalle
