#include "dalle/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iomanip>
#include <mutex>
#include <stdexcept>

namespace dalle::log {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  auto logger = std::make_shared<spdlog::logger>(
      "dalle", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
  logger->set_level(spdlog::level::info);
  logger->flush_on(spdlog::level::info);  // a run's log file is complete when it dies
  return logger;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = make_logger();
  return *instance;
}

bool console_shows_info = true;
std::string tag_prefix;  // "[rank 1] " or empty

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

// The progress line on a terminal is redrawn in place; a log line must clear it first.
std::mutex terminal_mutex;
bool progress_line_open = false;

void clear_progress_line() {
  if (progress_line_open) {
    std::fputs("\r\033[K", stderr);
    progress_line_open = false;
  }
}

}  // namespace

void set_level(Level level) { logger().set_level(to_spdlog(level)); }

Level level_from_string(std::string_view name) {
  if (name == "debug") return Level::debug;
  if (name == "info") return Level::info;
  if (name == "warn") return Level::warn;
  if (name == "error") return Level::error;
  if (name == "off") return Level::off;
  throw std::invalid_argument("unknown log level '" + std::string(name) +
                              "' (expected debug, info, warn, error or off)");
}

void add_file_sink(const std::string& path) {
  auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  sink->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  logger().sinks().push_back(std::move(sink));
}

void set_console_level(Level level) {
  logger().sinks().front()->set_level(to_spdlog(level));  // the first sink is the terminal's
  console_shows_info = level <= Level::info;
}

void set_tag(const std::string& tag) { tag_prefix = tag.empty() ? "" : "[" + tag + "] "; }

void write(Level level, const std::string& message) {
  std::lock_guard lock(terminal_mutex);
  clear_progress_line();
  logger().log(to_spdlog(level), tag_prefix + message);
}

Progress::Progress(std::string label, int64_t total, std::chrono::seconds log_interval)
    : label_(std::move(label)),
      total_(total),
      start_(std::chrono::steady_clock::now()),
      last_report_(start_),
      log_interval_(log_interval),
      on_terminal_(isatty(fileno(stderr)) != 0) {}

Progress::~Progress() {
  if (!finished_) finish();
}

void Progress::advance(int64_t n) {
  done_ += n;
  auto now = std::chrono::steady_clock::now();
  auto interval = on_terminal_ && console_shows_info ? std::chrono::milliseconds(200)
                               : std::chrono::duration_cast<std::chrono::milliseconds>(log_interval_);
  if (now - last_report_ >= interval) {
    last_report_ = now;
    report(false);
  }
}

void Progress::set_loss(double loss) { loss_ = loss; }

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  report(true);
}

std::string Progress::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto total = static_cast<int64_t>(std::llround(seconds));
  int64_t hours = total / 3600, minutes = (total % 3600) / 60, secs = total % 60;
  std::ostringstream out;
  out << std::setfill('0');
  if (hours > 0) out << hours << "h" << std::setw(2) << minutes << "m";
  else if (minutes > 0) out << minutes << "m" << std::setw(2) << secs << "s";
  else out << secs << "s";
  return out.str();
}

std::string Progress::status_line() const {
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
  std::ostringstream out;
  out << label_ << ": " << done_;
  if (total_ > 0) {
    out << "/" << total_ << " (" << std::fixed << std::setprecision(1)
        << 100.0 * static_cast<double>(done_) / static_cast<double>(total_) << "%)";
  }
  out << std::fixed << std::setprecision(2) << " " << rate << " it/s";
  if (total_ > 0 && done_ > 0) {
    out << " ETA " << format_duration(static_cast<double>(total_ - done_) / rate);
  }
  out << " elapsed " << format_duration(elapsed);
  if (loss_) out << " loss " << std::setprecision(4) << *loss_;
  return out.str();
}

void Progress::report(bool final_line) {
  if (on_terminal_ && console_shows_info) {
    std::lock_guard lock(terminal_mutex);
    std::fprintf(stderr, "\r\033[K%s", status_line().c_str());
    progress_line_open = !final_line;
    if (final_line) std::fputc('\n', stderr);
    std::fflush(stderr);
  } else {
    info(status_line());
  }
}

}  // namespace dalle::log
