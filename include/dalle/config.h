#pragma once
// YAML configs bound to typed structs. A config struct lists its keys once, in a
// `void visit(ConfigVisitor&)` member; the same list reads and validates a file, writes the
// effective config beside a run's outputs, and prints the config reference.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dalle/error.h"

namespace dalle {

class ConfigError : public Error {
 public:
  using Error::Error;
};

// What a value may be: numbers within [min, max], strings among `choices`.
struct Limits {
  std::optional<double> min = {};
  std::optional<double> max = {};
  std::vector<std::string> choices = {};
  // (older spelling, choice): a value an older recipe spelled otherwise, read as the choice
  // with a warning, so that older configs still load.
  std::vector<std::pair<std::string, std::string>> old_spellings = {};
};

// A floating-point type, as every recipe spells it: torch's names (float32, bfloat16, float16),
// those of `dtypes` allowed (and any other word among them, such as int8). The short names of
// older recipes (fp32, bf16, fp16) still load, with a warning.
Limits dtype_choices(std::vector<std::string> dtypes);

class ConfigVisitor {
 public:
  virtual ~ConfigVisitor() = default;
  virtual void field(std::string_view key, bool& value, std::string_view help) = 0;
  virtual void field(std::string_view key, int64_t& value, std::string_view help,
                     const Limits& limits = {}) = 0;
  virtual void field(std::string_view key, double& value, std::string_view help,
                     const Limits& limits = {}) = 0;
  virtual void field(std::string_view key, std::string& value, std::string_view help,
                     const Limits& limits = {}) = 0;
  virtual void field(std::string_view key, std::vector<int64_t>& value, std::string_view help,
                     const Limits& limits = {}) = 0;
  virtual void field(std::string_view key, std::vector<double>& value, std::string_view help,
                     const Limits& limits = {}) = 0;
  virtual void field(std::string_view key, std::vector<std::string>& value,
                     std::string_view help, const Limits& limits = {}) = 0;
  virtual void section(std::string_view key, std::string_view help,
                       const std::function<void(ConfigVisitor&)>& body) = 0;

  // A key that has moved to `new_path`: a document that still has `key` here is refused
  // with a message naming the new place (nothing else takes notice).
  virtual void moved(std::string_view key, std::string_view new_path) {
    (void)key;
    (void)new_path;
  }
  template <class Section>
  void section(std::string_view key, std::string_view help, Section& value) {
    section(key, help, [&value](ConfigVisitor& inner) { value.visit(inner); });
  }
};

struct ConfigDocument;  // the parsed YAML, private to the config's implementation

// A parsed YAML document plus the `--set key.path=value` overrides applied to it.
class ConfigSource {
 public:
  static ConfigSource from_file(const std::string& path);
  static ConfigSource from_string(const std::string& text, const std::string& name = "<string>");
  static ConfigSource empty();

  // "a.b.c=value"; the value is read as YAML, so "[1, 2]" is a list.
  void set(const std::string& assignment);
  void set_all(const std::vector<std::string>& assignments);
  // Like set, for a document that is already complete, such as a checkpoint's config.yaml:
  // the key must be there, and the value of its kind (a number for a number, true or false
  // for a flag, a list for a list; text may become anything but a section).
  void replace(const std::string& assignment);
  // The document with its overrides, as YAML.
  std::string yaml() const;

  const std::string& name() const;

 private:
  explicit ConfigSource(std::shared_ptr<ConfigDocument> document);
  friend const ConfigDocument& document_of(const ConfigSource& source);
  std::shared_ptr<ConfigDocument> document_;
};

using ConfigVisit = std::function<void(ConfigVisitor&)>;

// Reads `source` into the fields `visit` names. Refuses a value of the wrong type or out of
// range, and any key that `visit` does not name, with the file, line and key path.
void bind_config(const ConfigSource& source, const ConfigVisit& visit);
// Reads one top-level string key ahead of binding, to choose which struct binds the rest
// (dalle-train-vae's `kind`): `fallback` when the key is absent; a value outside `choices`
// is refused with the file, line and key, as bind_config refuses it. Other keys are ignored.
std::string peek_choice(const ConfigSource& source, std::string_view key, const std::string& fallback,
                        const std::vector<std::string>& choices);
// Reads the parts of a larger document that `visit` names, such as a model's sizes from the
// training recipe saved beside its weights: keys and sections `visit` names are read as
// bind_config reads them (a section's unknown keys refused), other top-level keys are left
// alone. Each of `required` must be present: a model's config names its sizes, never
// falling back to defaults that would build another model.
void bind_config_parts(const ConfigSource& source, const ConfigVisit& visit,
                       const std::vector<std::string>& required = {});

// Reads one integer at a dotted `path` ("data.image_size") ahead of binding, with binding's
// checks against `limits`; `fallback` when absent. Other keys are ignored.
int64_t peek_integer(const ConfigSource& source, std::string_view path, int64_t fallback, const Limits& limits = {});

// Whether the document (with its overrides) gives a value at the dotted `path`.
bool names_key(const ConfigSource& source, std::string_view path);

// The config as YAML, every key with its current value.
std::string config_to_yaml(const ConfigVisit& visit);
// Markdown table of every key: path, type, default, limits, help.
std::string config_reference(const ConfigVisit& visit);
// Every key path ("model.hidden") with its value as text, in visiting order.
std::vector<std::pair<std::string, std::string>> flatten_config(const ConfigVisit& visit);
// Writes config_to_yaml atomically to `path`.
void save_config(const std::string& path, const ConfigVisit& visit);

template <class Config>
Config load_config(const ConfigSource& source) {
  Config config;
  bind_config(source, [&config](ConfigVisitor& v) { config.visit(v); });
  return config;
}

template <class Config>
ConfigVisit visit_of(Config& config) {
  return [&config](ConfigVisitor& v) { config.visit(v); };
}

}  // namespace dalle
