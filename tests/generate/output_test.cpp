#include "dalle/generate/output.h"

#include <filesystem>

#include "test_support.h"

namespace dalle::generate {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

TEST(OutputFolder, ReplacesAnEarlierOutputWholeOnlyWhenCommitted) {
  ScratchDir dir;
  fs::create_directories(dir / "out");
  testing::write_text(dir / "out/0000-00.png", "earlier");
  testing::write_text(dir / "out/0003-01.json", "a stale sidecar");
  {
    OutputFolder output(dir / "out");
    testing::write_text(output.staging() + "/0000-00.png", "new");
    // Not committed: the earlier output stays as it was, and the staging folder goes.
  }
  EXPECT_EQ(testing::read_text(dir / "out/0000-00.png"), "earlier");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  OutputFolder output(dir / "out/");
  testing::write_text(output.staging() + "/0000-00.png", "new");
  output.commit();
  EXPECT_EQ(testing::read_text(dir / "out/0000-00.png"), "new");
  EXPECT_FALSE(fs::exists(dir / "out/0003-01.json")) << "nothing of the earlier output survives";
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
}

TEST(OutputFolder, RefusesAFolderThatIsNotItsOwn) {
  ScratchDir dir;
  fs::create_directories(dir / "notes");
  testing::write_text(dir / "notes/todo.txt", "a user's file");
  EXPECT_THROW_WITH(OutputFolder(dir / "notes"), Error, "notes: not empty and not an earlier dalle-generate output",
                    "'todo.txt'");
  testing::write_text(dir / "file", "x");
  EXPECT_THROW_WITH(OutputFolder(dir / "file"), Error, "exists and is not a folder");
  EXPECT_THROW_WITH(OutputFolder(dir / "file/out"), Error, "cannot write the output folder");
  EXPECT_EQ(testing::read_text(dir / "notes/todo.txt"), "a user's file");
}

TEST(PromptsFile, SkipsBlankLinesAndNamesTheLineOfABadPrompt) {
  ScratchDir dir;
  testing::write_text(dir / "prompts.txt", "a red bag\r\n\n   \na blue sneaker\n");
  EXPECT_EQ(read_prompts_file(dir / "prompts.txt"), (std::vector<std::string>{"a red bag", "a blue sneaker"}));
  testing::write_text(dir / "bad.txt", "a red bag\ncaf\xE9\n");
  EXPECT_THROW_WITH(read_prompts_file(dir / "bad.txt"), Error, "bad.txt:2", "not valid UTF-8");
  EXPECT_THROW_WITH(read_prompts_file(dir / "missing.txt"), Error, "missing.txt: cannot read the prompts file");
}

}  // namespace
}  // namespace dalle::generate
