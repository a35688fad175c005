#include "dalle/generate/output.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>

#include "dalle/error.h"
#include "dalle/input_limits.h"
#include "dalle/io/atomic_file.h"
#include "dalle/io/stale_temporaries.h"

namespace dalle::generate {
namespace fs = std::filesystem;

namespace {

// What dalle-generate writes into its folder, and dalle-eval's report of it.
bool written_by_generate(const fs::path& entry) {
  static const std::regex own(R"(\d{4,}-\d{2,}\.(png|json)|grid\.png|eval\.json)");
  return std::regex_match(entry.filename().string(), own);
}

// "out/" and "out" are one folder, and its temporaries are siblings, never inside it.
std::string without_trailing_slash(const std::string& path) {
  auto normal = fs::path(path).lexically_normal();
  return (normal.has_filename() ? normal : normal.parent_path()).string();
}

}  // namespace

std::vector<std::string> read_prompts_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot read the prompts file");
  const auto limit = static_cast<size_t>(max_text_bytes());
  std::vector<std::string> prompts;
  std::string line;
  for (int64_t number = 1;; ++number) {
    const std::string where = path + ":" + std::to_string(number);
    const auto read = read_bounded_line(in, limit + 1, line);  // + 1: room for a '\r' before the '\n'
    if (read == LineRead::end) break;
    if (read == LineRead::too_long || (line.size() > limit && line.back() != '\r')) {
      throw Error(where + ": the prompt is over the limit of " + std::to_string(limit) +
                  " bytes (DALLE_MAX_TEXT_BYTES); reading stopped there");
    }
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    check_prompt(line, where);
    prompts.push_back(line);
  }
  return prompts;
}

OutputFolder::OutputFolder(const std::string& target) : target_(without_trailing_slash(target)) {
  if (fs::exists(target_)) {
    if (!fs::is_directory(target_)) throw Error(target_ + ": exists and is not a folder");
    for (const auto& entry : fs::directory_iterator(target_)) {
      if (!written_by_generate(entry.path())) {
        throw Error(target_ + ": not empty and not an earlier dalle-generate output (it holds " +
                    excerpt(entry.path().filename().string()) + "); choose another folder");
      }
    }
    if (::access(target_.c_str(), W_OK) != 0) {
      throw Error(target_ + ": cannot be replaced: " + std::strerror(errno));
    }
  }
  io::remove_stale_temporaries(target_);
  // Created now, so that a folder that cannot be written is refused before any work.
  staging_ = io::temporary_sibling(target_);
  try {
    const auto parent = fs::path(staging_).parent_path();
    if (!parent.empty()) fs::create_directories(parent);
    fs::create_directory(staging_);
  } catch (const fs::filesystem_error& error) {
    throw Error(target_ + ": cannot write the output folder: " + error.code().message());
  }
}

OutputFolder::~OutputFolder() {
  std::error_code ignored;
  if (!committed_) fs::remove_all(staging_, ignored);
}

void OutputFolder::commit() {
  std::optional<std::string> previous;
  if (fs::exists(target_)) {
    previous = io::temporary_sibling(target_);
    fs::rename(target_, *previous);
  }
  try {
    fs::rename(staging_, target_);
  } catch (...) {
    if (previous) fs::rename(*previous, target_);
    throw;
  }
  committed_ = true;
  if (previous) fs::remove_all(*previous);
}

}  // namespace dalle::generate
