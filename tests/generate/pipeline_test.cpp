#include "dalle/generate/pipeline.h"

#include "test_support.h"

namespace dalle::generate {
namespace {

TEST(PipelineConfig, KeepingFewerThanSampledNeedsClip) {
  PipelineConfig config;
  config.prior = "runs/none";
  config.candidates = 8;
  config.keep = 2;
  EXPECT_THROW_WITH(Pipeline{config}, Error, "keeping 2 of 8 candidates needs a CLIP model");
  config.keep = 9;
  EXPECT_THROW_WITH(Pipeline{config}, Error, "keep (9) exceeds candidates (8)");
  config.keep = 0;
  EXPECT_EQ(config.kept(), 8);
}

TEST(PipelineConfig, MissingPriorIsNamed) {
  EXPECT_THROW_WITH(Pipeline{PipelineConfig{}}, Error, "`prior` is required");
  testing::ScratchDir dir;
  PipelineConfig config;
  config.prior = dir / "absent";
  EXPECT_THROW_WITH(Pipeline{config}, Error, "absent");
}

TEST(PipelineConfig, UnknownKeysAndBadValuesAreRefused) {
  EXPECT_THROW_WITH(load_config<PipelineConfig>(ConfigSource::from_string("prior: p\ncandidate: 4\n", "g.yaml")),
                    ConfigError, "g.yaml:2:1: unknown key 'candidate'");
  EXPECT_THROW_WITH(load_config<PipelineConfig>(ConfigSource::from_string("device: tpu\n", "g.yaml")), ConfigError,
                    "device");
}

}  // namespace
}  // namespace dalle::generate
