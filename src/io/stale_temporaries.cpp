#include "dalle/io/stale_temporaries.h"

#include <signal.h>

#include <cerrno>
#include <filesystem>
#include <optional>

#include "dalle/log.h"

namespace dalle::io {
namespace fs = std::filesystem;

namespace {

struct TemporaryName {
  std::string stem;  // the name the temporary stood in for
  long long pid = 0;
};

bool all_digits(const std::string& text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string::npos && text.size() < 12;
}

// "<stem>.tmp-<pid>-<n>", as temporary_sibling names it.
std::optional<TemporaryName> parse_temporary(const std::string& name) {
  const auto marker = name.rfind(".tmp-");
  if (marker == std::string::npos || marker == 0) return std::nullopt;
  const std::string suffix = name.substr(marker + 5);
  const auto dash = suffix.find('-');
  if (dash == std::string::npos || !all_digits(suffix.substr(0, dash)) || !all_digits(suffix.substr(dash + 1))) {
    return std::nullopt;
  }
  return TemporaryName{name.substr(0, marker), std::stoll(suffix.substr(0, dash))};
}

bool process_is_gone(long long pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

void remove_if_stale(const fs::path& entry, const std::optional<std::string>& stem) {
  const auto temporary = parse_temporary(entry.filename().string());
  if (!temporary || (stem && temporary->stem != *stem) || !process_is_gone(temporary->pid)) return;
  std::error_code error;
  fs::remove_all(entry, error);
  if (error) log::warn(entry.string(), ": cannot remove this leftover of a killed run: ", error.message());
  else log::info("removed ", entry.string(), ", left by a run that was killed while writing it");
}

void remove_stale(const fs::path& directory, const std::optional<std::string>& stem) {
  std::error_code error;
  fs::directory_iterator entries(directory, error);
  if (error) return;  // nothing there yet
  for (const auto& entry : entries) remove_if_stale(entry.path(), stem);
}

}  // namespace

void remove_stale_temporaries(const std::string& path) {
  const fs::path target = fs::path(path).lexically_normal();
  const fs::path named = target.has_filename() ? target : target.parent_path();
  const fs::path parent = named.parent_path().empty() ? fs::path(".") : named.parent_path();
  remove_stale(parent, named.filename().string());
}

void remove_stale_temporaries_in(const std::string& directory) { remove_stale(directory, std::nullopt); }

}  // namespace dalle::io
