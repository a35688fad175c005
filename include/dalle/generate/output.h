#pragma once
// What dalle-generate reads and writes around the pipeline: a prompts file, read with
// every line bounded, and the output folder, written whole.
#include <string>
#include <vector>

namespace dalle::generate {

// The prompts of a file, one per line; blank lines are skipped, a prompt that is too long
// (max_text_bytes) or not UTF-8 is refused with its file and line, and no line is read
// whole past the limit.
std::vector<std::string> read_prompts_file(const std::string& path);

// The output folder, written whole: the images go to a staging folder beside it, which
// replaces it once all are written (commit). So an earlier output is never mixed with this
// one's (no stale sidecars), and a failed run leaves the folder as it was. Only a new or
// empty folder, or an earlier dalle-generate output, may be replaced; the staging folder is
// made at once, so that a folder that cannot be written is refused before any work.
class OutputFolder {
 public:
  explicit OutputFolder(const std::string& target);
  ~OutputFolder();
  OutputFolder(const OutputFolder&) = delete;
  OutputFolder& operator=(const OutputFolder&) = delete;

  const std::string& staging() const { return staging_; }
  void commit();

 private:
  std::string target_, staging_;
  bool committed_ = false;
};

}  // namespace dalle::generate
