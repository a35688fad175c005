#include "dalle/log.h"

#include "test_support.h"

namespace dalle::log {
namespace {

TEST(Log, FormatsDurations) {
  EXPECT_EQ(Progress::format_duration(0), "0s");
  EXPECT_EQ(Progress::format_duration(59.4), "59s");
  EXPECT_EQ(Progress::format_duration(61), "1m01s");
  EXPECT_EQ(Progress::format_duration(3600 + 120), "1h02m");
  EXPECT_EQ(Progress::format_duration(-1), "?");
}

TEST(Log, StatusLineShowsCountRateEtaAndLoss) {
  Progress progress("training", 100);
  progress.advance(25);
  progress.set_loss(1.2345);
  const std::string line = progress.status_line();
  EXPECT_THAT(line, ::testing::HasSubstr("training: 25/100 (25.0%)"));
  EXPECT_THAT(line, ::testing::HasSubstr("it/s"));
  EXPECT_THAT(line, ::testing::HasSubstr("ETA"));
  EXPECT_THAT(line, ::testing::HasSubstr("loss 1.2345"));
  progress.finish();
}

TEST(Log, UnknownLevelIsRefused) {
  EXPECT_EQ(level_from_string("warn"), Level::warn);
  EXPECT_THROW(level_from_string("loud"), std::invalid_argument);
}

TEST(Log, FileSinkReceivesMessages) {
  testing::ScratchDir dir;
  add_file_sink(dir / "run.log");
  info("hello ", 42, " from the test");
  set_level(Level::info);
  EXPECT_THAT(testing::read_text(dir / "run.log"), ::testing::HasSubstr("hello 42 from the test"));
}

}  // namespace
}  // namespace dalle::log
