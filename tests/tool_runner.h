#pragma once
// Runs the dalle-* tools as a user runs them, from a shell: their exit status and output.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace dalle::testing {

struct Result {
  int status;
  std::string output;  // stdout and stderr together
};

// `command_line` may be a list of shell commands: the output of all of them is taken.
inline Result run_command(const std::string& command_line) {
  const std::string command = "{ " + command_line + "\n} 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// `tool` ("dalle-train") from the build's tools folder.
// Appended: GCC 12 warns falsely (-Wstringop-overflow) on "literal" + string.
inline std::string tool_path(const std::string& tool) { return std::string(DALLE_TOOLS_DIR).append("/").append(tool); }

inline Result run(const std::string& tool, const std::string& arguments) {
  return run_command(tool_path(tool) + " " + arguments);
}

}  // namespace dalle::testing
