// The command-line tools, run as a user runs them: exit statuses, messages, outputs.
#include <sys/wait.h>

#include <array>
#include <cstdio>

#include "test_support.h"

namespace dalle {
namespace {

using testing::ScratchDir;

struct Result {
  int status;
  std::string output;  // stdout and stderr together
};

Result run(const std::string& tool, const std::string& arguments) {
  const std::string command = std::string(DALLE_TOOLS_DIR) + "/" + tool + " " + arguments + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

TEST(Tools, HelpDescribesEverySubcommand) {
  const auto data = run("dalle-data", "--help");
  EXPECT_EQ(data.status, 0);
  for (const char* command : {"import-fashion-mnist", "compose", "inspect"}) {
    EXPECT_THAT(data.output, ::testing::HasSubstr(command));
  }
  const auto tokenizer = run("dalle-tokenizer", "--help");
  EXPECT_EQ(tokenizer.status, 0);
  for (const char* command : {"train", "encode", "decode"}) {
    EXPECT_THAT(tokenizer.output, ::testing::HasSubstr(command));
  }
  EXPECT_EQ(run("dalle-data", "compose --help").status, 0);
  const auto train_vae = run("dalle-train-vae", "--help");
  EXPECT_EQ(train_vae.status, 0);
  EXPECT_THAT(train_vae.output, ::testing::HasSubstr("--out"));
  EXPECT_THAT(run("dalle-data", "--version").output, ::testing::HasSubstr("torch 2.11"));
}

TEST(Tools, BadCommandLinesExitWithUsageStatus) {
  EXPECT_EQ(run("dalle-data", "").status, 2);
  EXPECT_EQ(run("dalle-data", "frobnicate").status, 2);
  EXPECT_EQ(run("dalle-data", "inspect").status, 2);
  EXPECT_EQ(run("dalle-tokenizer", "encode --model /nonexistent x").status, 2);
}

TEST(Tools, ConfigErrorsNameFileLineAndKey) {
  ScratchDir dir;
  testing::write_text(dir / "bad.yaml", "canvas_size: 64\ntrain_imagez: 10\n");
  auto result = run("dalle-data", "compose --out " + (dir / "out") + " --config " + (dir / "bad.yaml"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("bad.yaml:2:1: unknown key 'train_imagez'"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("did you mean 'train_images'"));
  EXPECT_FALSE(std::filesystem::exists(dir / "out"));
  result = run("dalle-data", "compose --out " + (dir / "out") + " --set seed=-1");
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("--set seed=-1: seed: -1 is out of range"));
}

TEST(Tools, ComposeInspectTokenizeRoundTrip) {
  ScratchDir dir;
  const std::string out = dir / "fc";
  auto result = run("dalle-data", "compose --out " + out +
                                      " --set train_images=60 --set test_images=8 --set heldout_images=8");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_TRUE(std::filesystem::exists(out + "/sample_grid.png"));

  result = run("dalle-data", "inspect " + out + "/train --grid " + (dir / "grid.png") + " --count 4");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("60 images, 60 captions"));
  EXPECT_TRUE(std::filesystem::exists(dir / "grid.png"));

  result = run("dalle-tokenizer", "train --captions " + out + "/train --out " + (dir / "tok.model") +
                                      " --set vocab_size=60 --set text_length=16");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "tok.model.yaml"));
  result = run("dalle-tokenizer", "encode --model " + (dir / "tok.model") + " 'A Red Bag on the left'");
  ASSERT_EQ(result.status, 0) << result.output;
  std::istringstream ids(result.output);
  int64_t id, count = 0;
  while (ids >> id) ++count;
  EXPECT_EQ(count, 16) << "text_length comes from tok.model.yaml";
  result = run("dalle-tokenizer", "decode --model " + (dir / "tok.model") + " '" + result.output + "'");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_EQ(result.output, "a red bag on the left\n");
}

TEST(Tools, InspectReportsCorruptImagesAndKeepsGoing) {
  ScratchDir dir;
  ASSERT_EQ(run("dalle-data", "compose --out " + (dir / "fc") +
                                  " --set train_images=6 --set test_images=0 --set heldout_images=0").status, 0);
  testing::write_text(dir / "fc/train/images/000002.png", "garbage");
  const auto result = run("dalle-data", "inspect " + (dir / "fc/train") + " --verify");
  EXPECT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("1 unreadable images"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("000002.png"));
}

TEST(Tools, ConfigReferenceInDocsIsCurrent) {
  const std::string docs = testing::read_text(std::string(DALLE_SOURCE_DIR) + "/docs/config.md");
  for (const auto& [tool, command] : {std::pair{"dalle-data", "compose --print-reference"},
                                      std::pair{"dalle-tokenizer", "train --print-reference"},
                                      std::pair{"dalle-train-vae", "--print-reference"}}) {
    const auto result = run(tool, command);
    ASSERT_EQ(result.status, 0) << result.output;
    EXPECT_THAT(docs, ::testing::HasSubstr(result.output)) << "run scripts/gen-config-docs";
  }
}

TEST(Tools, FailuresExitNonZeroWithTheReason) {
  ScratchDir dir;
  auto result = run("dalle-data", "inspect " + (dir / "missing"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("no such dataset folder"));
  testing::write_text(dir / "ids.txt", "");
  result = run("dalle-tokenizer", "decode --model " + (dir / "ids.txt") + " '1 2'");
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("not a SentencePiece model"));
}

}  // namespace
}  // namespace dalle
