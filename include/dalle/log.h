#pragma once
// Logging and progress. This is the only header that speaks for spdlog: spdlog is included
// by src/log.cpp alone, which keeps Debian's fmt away from the fmt headers bundled in the
// torch wheel.
#include <chrono>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace dalle::log {

enum class Level { debug, info, warn, error, off };

void set_level(Level level);
Level level_from_string(std::string_view name);  // "debug", "info", "warn", "error", "off"
// Also write every line to `path` (appended), e.g. a run's log beside its outputs.
void add_file_sink(const std::string& path);
// The lowest level the terminal shows (files keep every level set_level lets through), and
// whether progress lines are drawn there: the ranks after the first of a job show warnings
// and errors only, while each keeps a whole log file.
void set_console_level(Level level);
// A tag written before every line ("rank 1"), to tell the ranks of a job apart.
void set_tag(const std::string& tag);

void write(Level level, const std::string& message);

template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <class... Args>
void debug(const Args&... args) { write(Level::debug, concat(args...)); }
template <class... Args>
void info(const Args&... args) { write(Level::info, concat(args...)); }
template <class... Args>
void warn(const Args&... args) { write(Level::warn, concat(args...)); }
template <class... Args>
void error(const Args&... args) { write(Level::error, concat(args...)); }

// Progress of a long loop. On a terminal it redraws one status line (count, rate, ETA,
// the latest loss); otherwise it logs a plain line every `log_interval`.
class Progress {
 public:
  Progress(std::string label, int64_t total,
           std::chrono::seconds log_interval = std::chrono::seconds(30));
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void advance(int64_t n = 1);
  void set_loss(double loss);
  void finish();

  // "12.3 it/s" style rate and "1h02m" style ETA, exposed for tests and tools.
  static std::string format_duration(double seconds);
  std::string status_line() const;

 private:
  void report(bool final_line);

  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  std::optional<double> loss_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_report_;
  std::chrono::seconds log_interval_;
  bool on_terminal_;
  bool finished_ = false;
};

}  // namespace dalle::log
