#pragma once
// Helpers shared by the tests: a scratch directory per test, file I/O, a matcher for
// error messages.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"

namespace dalle::testing {

// A fresh directory under the system temp dir, removed when it goes out of scope.
class ScratchDir {
 public:
  // Outside a test (in a suite's set-up) the directory is named after the running suite.
  ScratchDir() {
    const auto* unit = ::testing::UnitTest::GetInstance();
    const auto* test = unit->current_test_info();
    const std::string name = test ? std::string(test->test_suite_name()) + "-" + test->name()
                                  : std::string(unit->current_test_suite()->name()) + "-suite";
    // Numbered too: a helper's scratch directory must not wipe out its caller's.
    static int made = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("dalle-test-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(made++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Max |a - b| relative to max |b|: robust to entries near zero.
inline double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

// A parity fixture's weights: each stored as int8 `name` times the scalar `name:scale` (see
// the generators in tests/parity/); those under `prefix` only, the prefix removed.
inline io::TensorMap dequantized_weights(const io::TensorMap& fixture, const std::string& prefix = "") {
  io::TensorMap out;
  for (const auto& [name, scale] : fixture) {
    const auto colon = name.find(':');
    if (colon == std::string::npos || name.rfind(prefix, 0) != 0) continue;
    const std::string weight = name.substr(0, colon);
    out.emplace(weight.substr(prefix.size()), fixture.at(weight).to(torch::kFloat32) * scale);
  }
  return out;
}

inline std::string fixture_path(const std::string& name) {
  return std::string(DALLE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// This process's resident pages mapped from files (RssFile of /proc/self/status), in kB.
inline int64_t resident_file_kb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("RssFile:")) return std::stoll(line.substr(8));
  }
  return -1;
}

// Asserts that `statement` throws `Exception` whose message contains every `parts`.
#define EXPECT_THROW_WITH(statement, Exception, ...)                                   \
  do {                                                                                 \
    try {                                                                              \
      statement;                                                                       \
      ADD_FAILURE() << "expected " #Exception " from " #statement;                     \
    } catch (const Exception& error) {                                                 \
      for (const std::string& part : {__VA_ARGS__}) {                                  \
        EXPECT_THAT(std::string(error.what()), ::testing::HasSubstr(part));            \
      }                                                                                \
    }                                                                                  \
  } while (0)

}  // namespace dalle::testing
