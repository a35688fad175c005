// The command-line tools, run as a user runs them: exit statuses, messages, outputs.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/clip.h"
#include "hostile_files.h"
#include "test_support.h"
#include "tool_runner.h"

namespace dalle {
namespace {

using testing::ScratchDir;

using testing::Result;
using testing::run;
using testing::run_command;

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
  for (const char* tool :
       {"dalle-train-vae", "dalle-train", "dalle-encode-images", "dalle-generate", "dalle-export", "dalle-train-sr",
        "dalle-train-clip"}) {
    const auto help = run(tool, "--help");
    EXPECT_EQ(help.status, 0) << tool;
    EXPECT_THAT(help.output, ::testing::HasSubstr("--out")) << tool;
  }
  EXPECT_THAT(run("dalle-data", "--version").output, ::testing::HasSubstr("torch 2.11"));
}

// dalle-plan over the demo's prior recipe on 2 machines x 2 GPUs: a table, the same plan as
// JSON, and a cluster of no machines refused as a bad command line.
TEST(Tools, PlanPrintsATableOrJsonAndRefusesABadCluster) {
  const auto help = run("dalle-plan", "--help");
  EXPECT_EQ(help.status, 0);
  for (const char* option : {"--config", "--set", "--nodes", "--gpus-per-node", "--gpu-memory", "--peak-tflops",
                             "--mfu", "--link-within-gbps", "--link-across-gbps", "--json"}) {
    EXPECT_THAT(help.output, ::testing::HasSubstr(option));
  }
  const std::string recipe = "--log-level off --config " + std::string(DALLE_SOURCE_DIR) +
                             "/configs/prior/fashion-compose-tiny.yaml --gpus-per-node 2 --gpu-memory 1 "
                             "--set distributed.sharding=within_node";
  const std::string plan = recipe + " --nodes 2";
  const auto table = run("dalle-plan", plan);
  ASSERT_EQ(table.status, 0) << table.output;
  EXPECT_THAT(table.output, ::testing::HasSubstr("memory per rank"));
  EXPECT_THAT(table.output, ::testing::HasSubstr("fits in 1 GiB"));
  EXPECT_THAT(table.output, ::testing::HasSubstr("ShardedParameters::bytes_moved"));
  const auto json = run("dalle-plan", plan + " --json");
  ASSERT_EQ(json.status, 0) << json.output;
  const auto parsed = nlohmann::json::parse(json.output);
  EXPECT_EQ(parsed["cluster"]["ranks"].get<int64_t>(), 4);
  EXPECT_TRUE(parsed["memory"]["fits"].get<bool>());
  EXPECT_TRUE(parsed["training"]["sharded"].get<bool>());
  const auto refused = run("dalle-plan", recipe + " --nodes 0");
  EXPECT_EQ(refused.status, 2);
  EXPECT_THAT(refused.output, ::testing::HasSubstr("nodes must be at least 1, not 0"));
  const auto indivisible = run("dalle-plan", plan + " --batch 6");
  EXPECT_EQ(indivisible.status, 1);
  EXPECT_THAT(indivisible.output, ::testing::HasSubstr("data.batch_size 6 does not divide between 4 ranks"));
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
                                      std::pair{"dalle-train-vae", "--print-reference"},
                                      std::pair{"dalle-train-vae", "--set kind=vqgan --print-reference"},
                                      std::pair{"dalle-train", "--print-reference"},
                                      std::pair{"dalle-train-sr", "--print-reference"},
                                      std::pair{"dalle-train-clip", "--print-reference"},
                                      std::pair{"dalle-generate", "--print-reference"},
                                      std::pair{"dalle-serve", "--print-reference"},
                                      std::pair{"dalle-eval", "train-classifier --print-reference"}}) {
    const auto result = run(tool, command);
    ASSERT_EQ(result.status, 0) << result.output;
    EXPECT_THAT(docs, ::testing::HasSubstr(result.output)) << "run scripts/gen-config-docs";
  }
}

TEST(Tools, TrainVaeReadsTheRecipeOfItsKind) {
  ScratchDir dir;
  const std::string configs = std::string(DALLE_SOURCE_DIR) + "/configs/";
  auto result = run("dalle-train-vae", "--config " + configs + "vqgan/fashion-compose-tiny.yaml --print-config");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("kind: \"vqgan\""));
  EXPECT_THAT(result.output, ::testing::HasSubstr("n_embed: 512"));
  result = run("dalle-train-vae", "--config " + configs + "dvae/fashion-compose-tiny.yaml --print-config");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("kind: \"dvae\""));
  EXPECT_THAT(result.output, ::testing::HasSubstr("vocab_size: 512"));

  testing::write_text(dir / "vq.yaml", "kind: vqgan\nmodel:\n  hidden: 8\n");
  result = run("dalle-train-vae", "--config " + (dir / "vq.yaml") + " --out " + (dir / "run"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("vq.yaml:3:3: unknown key 'model.hidden'"));
  result = run("dalle-train-vae", "--config " + (dir / "vq.yaml") + " --set kind=gan --out " + (dir / "run"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("--set kind=gan: kind: 'gan' is not allowed"));
  EXPECT_FALSE(std::filesystem::exists(dir / "run"));
}

TEST(Tools, TrainSrTrainsResumesAndRefusesBadKeys) {
  ScratchDir dir;
  auto result = run("dalle-data", "compose --out " + (dir / "fc") +
                                      " --set train_images=8 --set test_images=4 --set heldout_images=0");
  ASSERT_EQ(result.status, 0) << result.output;
  const std::string recipe = std::string(DALLE_SOURCE_DIR) + "/configs/superres/fashion-compose-x2-tiny.yaml";
  const std::string small = " --set data.train=" + (dir / "fc/train") + " --set data.validation=" + (dir / "fc/test") +
                            " --set model.num_feat=8 --set model.num_block=1 --set model.num_grow_ch=4" +
                            " --set data.batch_size=4 --set run.threads=1 --set run.validate_every=2 --set run.checkpoint_every=2";
  result = run("dalle-train-sr", "--config " + recipe + small + " --set run.steps=2 --out " + (dir / "run"));
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "run/checkpoints/step-000000002/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir / "run/samples/step-000000002.png"));
  EXPECT_THAT(testing::read_text(dir / "run/metrics.jsonl"), ::testing::HasSubstr("bicubic_psnr"));
  result = run("dalle-train-sr", "--config " + recipe + small + " --set run.steps=3 --out " + (dir / "run"));
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("resumed from"));

  result = run("dalle-train-sr", "--config " + recipe + " --set degradation.blur_sigm.max=2 --out " + (dir / "bad"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("unknown key 'degradation.blur_sigm"));
  EXPECT_FALSE(std::filesystem::exists(dir / "bad"));
}

// SIGTERM in the middle of a run, as a batch scheduler sends it: the trainer writes the
// metrics line and a checkpoint of the update it is at (log_every 3, so most stops fall
// between metric lines), the tool exits with 143, and the same command resumes.
TEST(Tools, SigtermStopsTrainingWithACheckpointThatTheRerunResumes) {
  ScratchDir dir;
  auto result = run("dalle-data", "compose --out " + (dir / "fc") +
                                      " --set train_images=8 --set test_images=4 --set heldout_images=0");
  ASSERT_EQ(result.status, 0) << result.output;
  const std::string train_sr = std::string(DALLE_TOOLS_DIR) + "/dalle-train-sr --config " + DALLE_SOURCE_DIR +
                               "/configs/superres/fashion-compose-x2-tiny.yaml --set data.train=" +
                               (dir / "fc/train") + " --set data.validation=" + (dir / "fc/test") +
                               " --set model.num_feat=8 --set model.num_block=1 --set model.num_grow_ch=4" +
                               " --set data.batch_size=4 --set run.threads=1 --set run.log_every=3" +
                               " --set run.validate_every=1000000 --set run.checkpoint_every=1000000 --out " + (dir / "run");
  // The signal goes once the first update is logged; the watchdog ends a run that ignores it.
  result = run_command(train_sr + " --set run.steps=1000000 2>&1 & pid=$!; for i in $(seq 600); do [ -s " +
                       (dir / "run/metrics.jsonl") + " ] && break; sleep 0.1; done; kill -TERM $pid; " +
                       "(for i in $(seq 1200); do kill -0 $pid || exit; sleep 0.1; done; kill -KILL $pid) " +
                       ">/dev/null 2>&1 & wait $pid");
  EXPECT_EQ(result.status, 143) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("stopped by SIGTERM after update"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("rerun the same command to resume"));
  EXPECT_THAT(result.output, ::testing::Not(::testing::HasSubstr("error")));

  const auto latest = testing::read_text(dir / "run/checkpoints/latest");
  const int64_t stopped_at = std::stoll(latest.substr(latest.find('-') + 1));
  ASSERT_GE(stopped_at, 1) << latest;
  std::vector<int64_t> logged;
  std::ifstream metrics(dir / "run/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto entry = nlohmann::json::parse(line);
    if (entry.contains("loss")) logged.push_back(entry["step"].get<int64_t>());
  }
  std::vector<int64_t> expected;
  for (int64_t step = 3; step <= stopped_at; step += 3) expected.push_back(step);
  if (stopped_at % 3 != 0) expected.push_back(stopped_at);
  EXPECT_EQ(logged, expected) << "every third update, and the one the run stopped at";

  result = run_command(train_sr + " --set run.steps=" + std::to_string(stopped_at + 2));
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("resumed from"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("training from update " + std::to_string(stopped_at)));
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

// The whole chain a user runs: images -> tokenizer, dVAE -> token dataset -> prior ->
// generated images, each tool with its own command line.
TEST(Tools, TrainAPriorAndGenerateFromIt) {
  ScratchDir dir;
  auto check = [](const Result& result) { ASSERT_EQ(result.status, 0) << result.output; };
  check(run("dalle-data", "compose --out " + (dir / "fc") +
                              " --set train_images=32 --set test_images=8 --set heldout_images=0"));
  check(run("dalle-tokenizer", "train --captions " + (dir / "fc/train") + " --out " + (dir / "tok.model") +
                                   " --set vocab_size=60 --set text_length=12"));
  check(run("dalle-train-vae", "--out " + (dir / "dvae") + " --set data.train=" + (dir / "fc/train") +
                                   " --set data.validation=" + (dir / "fc/test") +
                                   " --set data.image_size=16 --set data.batch_size=8 --set model.hidden=8"
                                   " --set model.decoder_init=8 --set model.groups=2 --set model.downsamplings=1"
                                   " --set model.blocks_per_group=1 --set model.vocab_size=32 --set run.steps=2"));
  for (const char* split : {"train", "test"}) {
    check(run("dalle-encode-images", "--dataset " + (dir / "fc/" + split) + " --dvae " + (dir / "dvae") +
                                         " --tokenizer " + (dir / "tok.model") + " --out " + (dir / "tokens-" + split)));
  }
  testing::write_text(dir / "prior.yaml",
                      "model: {text_length: 12, text_vocab_size: 60, grid_size: 8, image_vocab_size: 32,\n"
                      "        layers: 2, width: 32, heads: 2, conv_kernel: 3}\n"
                      "data: {train: " + (dir / "tokens-train") + ", validation: " + (dir / "tokens-test") +
                      ", batch_size: 8}\n"
                      "learning_rate: {peak: 1.0e-3, warmup_steps: 2, decay: cosine}\n"
                      "run: {steps: 4, validate_every: 4, checkpoint_every: 4}\n"
                      "tokenizer: " + (dir / "tok.model") + "\nimage_tokenizer: " + (dir / "dvae") + "\n"
                      "sample_captions: [a red bag on the left]\n");
  check(run("dalle-train", "--config " + (dir / "prior.yaml") + " --out " + (dir / "prior")));
  EXPECT_TRUE(std::filesystem::exists(dir / "prior/samples/step-000000004.png"));

  const std::string prompts = " 'a red bag on the left' 'a blue sneaker at the top'";
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "out") + " -n 2 --seed 7" + prompts));
  for (const char* stem : {"0000-00", "0000-01", "0001-00", "0001-01"}) {
    EXPECT_TRUE(std::filesystem::exists(dir / "out/" + stem + ".png")) << stem;
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "out/grid.png"));
  const auto sidecar = nlohmann::json::parse(testing::read_text(dir / "out/0001-01.json"));
  EXPECT_EQ(sidecar["prompt"], "a blue sneaker at the top");
  EXPECT_EQ(sidecar["seed"], 7);
  EXPECT_EQ(sidecar["candidate"], 1);
  EXPECT_EQ(sidecar["image_tokens"].size(), 64u);
  // Batches of 3 run across the two prompts; every image is drawn as in batches of 32.
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "by-three") +
                                  " --set batch_size=3 -n 2 --seed 7" + prompts));
  for (const char* stem : {"0000-00", "0000-01", "0001-00", "0001-01"}) {
    const auto read_tokens = [&](const std::string& folder) {
      return nlohmann::json::parse(testing::read_text(dir / (folder + "/" + stem + ".json")))["image_tokens"];
    };
    EXPECT_EQ(read_tokens("by-three"), read_tokens("out")) << stem;
  }
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "again") + " -n 2 --seed 7 --no-cache" +
                                  prompts));
  EXPECT_EQ(nlohmann::json::parse(testing::read_text(dir / "again/0001-01.json"))["image_tokens"],
            sidecar["image_tokens"])
      << "the same seed gives the same images, with or without the cache";

  // The exported weights are the run's moving average: they draw the same images.
  check(run("dalle-export", (dir / "prior") + " --out " + (dir / "prior-export")));
  check(run("dalle-generate", "--prior " + (dir / "prior-export") + " --out " + (dir / "exported") +
                                  " -n 2 --seed 7" + prompts));
  EXPECT_EQ(nlohmann::json::parse(testing::read_text(dir / "exported/0001-01.json"))["image_tokens"],
            sidecar["image_tokens"]);
  // Adapters trained on the run: drawn from the adapter run itself, or from the base with the
  // exported adapter file (the option before the prompts must not take them), the same images;
  // at weight 0 the file leaves the base as it is.
  testing::write_text(dir / "adapters.yaml", testing::read_text(dir / "prior.yaml") + "init_from: " + (dir / "prior") +
                                                 "\nadapter: {rank: 2, alpha: 8}\n");
  check(run("dalle-train", "--config " + (dir / "adapters.yaml") + " --out " + (dir / "adapted") +
                               " --set learning_rate.peak=0.05"));
  check(run("dalle-export", (dir / "adapted") + " --adapter --out " + (dir / "adapter.safetensors")));
  check(run("dalle-generate", "--prior " + (dir / "adapted") + " --out " + (dir / "adapted-out") + " -n 2 --seed 7" +
                                  prompts));
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "with-file") + " -n 2 --seed 7 " +
                                  "--adapter " + (dir / "adapter.safetensors") + prompts));
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "weight-0") + " -n 2 --seed 7 " +
                                  "--adapter " + (dir / "adapter.safetensors") + ":0" + prompts));
  const auto tokens_of = [&](const std::string& folder) {
    return nlohmann::json::parse(testing::read_text(dir / (folder + "/0001-01.json")))["image_tokens"];
  };
  EXPECT_EQ(tokens_of("with-file"), tokens_of("adapted-out"));
  EXPECT_NE(tokens_of("with-file"), sidecar["image_tokens"]) << "the adapters change what is drawn";
  EXPECT_EQ(tokens_of("weight-0"), sidecar["image_tokens"]);
  // The base the adapter names is where it was trained; moved elsewhere (another machine), the
  // adapter still loads onto a copy, with a warning, and draws the same images.
  std::filesystem::rename(dir / "prior", dir / "prior-moved");
  const auto moved = run("dalle-generate", "--prior " + (dir / "prior-moved") + " --out " + (dir / "moved") +
                                               " -n 2 --seed 7 --adapter " + (dir / "adapter.safetensors") + prompts);
  std::filesystem::rename(dir / "prior-moved", dir / "prior");
  ASSERT_EQ(moved.status, 0) << moved.output;
  EXPECT_THAT(moved.output, ::testing::HasSubstr("was trained on"));
  EXPECT_EQ(tokens_of("moved"), tokens_of("adapted-out"));
  const auto not_adapter = run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "bad") +
                                                     " --adapter " + (dir / "prior/checkpoints/step-000000004/model.safetensors") +
                                                     prompts);
  EXPECT_EQ(not_adapter.status, 1);
  EXPECT_THAT(not_adapter.output, ::testing::HasSubstr("not an adapter file"));
  // Shipped, a prior names its tokenizers where they were shipped beside it.
  std::filesystem::create_directories(dir / "shipped");
  for (const char* file : {"tok.model", "tok.model.yaml"}) {
    std::filesystem::copy_file(dir / file, dir / (std::string("shipped/") + file));
  }
  check(run("dalle-export", (dir / "dvae") + " --out " + (dir / "shipped/dvae")));
  check(run("dalle-export", (dir / "prior") + " --out " + (dir / "shipped/prior") + " --set tokenizer=" +
                                (dir / "shipped/tok.model") + " --set image_tokenizer=" + (dir / "shipped/dvae")));
  EXPECT_THAT(testing::read_text(dir / "shipped/prior/config.yaml"),
              ::testing::HasSubstr("image_tokenizer: " + (dir / "shipped/dvae")));
  std::filesystem::rename(dir / "tok.model", dir / "tok.model.moved");
  check(run("dalle-generate", "--prior " + (dir / "shipped/prior") + " --out " + (dir / "shipped-out") +
                                  " -n 2 --seed 7" + prompts));
  std::filesystem::rename(dir / "tok.model.moved", dir / "tok.model");
  EXPECT_EQ(nlohmann::json::parse(testing::read_text(dir / "shipped-out/0001-01.json"))["image_tokens"],
            sidecar["image_tokens"]);
  const auto unknown_key =
      run("dalle-export", (dir / "prior") + " --out " + (dir / "typo") + " --set image_tokeniser=x");
  EXPECT_EQ(unknown_key.status, 1);
  EXPECT_THAT(unknown_key.output, ::testing::HasSubstr("has no key 'image_tokeniser'"));
  EXPECT_FALSE(std::filesystem::exists(dir / "typo"));
  const auto wrong_type = run("dalle-export", (dir / "prior") + " --out " + (dir / "typo") + " --set run.steps=many");
  EXPECT_EQ(wrong_type.status, 1);
  EXPECT_THAT(wrong_type.output, ::testing::HasSubstr("has 'run.steps' as an integer, and the new value is text"));
  EXPECT_FALSE(std::filesystem::exists(dir / "typo"));

  const auto too_many = run("dalle-export", (dir / "prior") + " --out " + (dir / "typo") + " --average 1000");
  EXPECT_EQ(too_many.status, 1);
  EXPECT_THAT(too_many.output, ::testing::HasSubstr("fewer than the 1000 to average"));
  EXPECT_FALSE(std::filesystem::exists(dir / "typo"));

  const auto onto_a_run = run("dalle-export", (dir / "prior") + " --out " + (dir / "dvae"));
  EXPECT_EQ(onto_a_run.status, 1);
  EXPECT_THAT(onto_a_run.output, ::testing::HasSubstr("is not a checkpoint directory"));
  EXPECT_TRUE(std::filesystem::exists(dir / "dvae/checkpoints"));

  const auto no_prompts = run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "none"));
  EXPECT_EQ(no_prompts.status, 2) << "a bad command line";
  EXPECT_THAT(no_prompts.output, ::testing::HasSubstr("no captions"));

  // dalle-eval reads what dalle-generate wrote.
  check(run("dalle-eval", "train-classifier --out " + (dir / "classifier") +
                              " --set train_limit=300 --set test_limit=100 --set epochs=1"));
  const auto scored = run("dalle-eval", "--log-level off score --generated " + (dir / "out") + " --classifier " +
                                            (dir / "classifier") + " --real " + (dir / "fc/test"));
  ASSERT_EQ(scored.status, 0) << scored.output;
  const auto report = nlohmann::json::parse(testing::read_text(dir / "out/eval.json"));
  EXPECT_EQ(nlohmann::json::parse(scored.output), report) << "the same report on stdout and in the file";
  EXPECT_EQ(report["images"], 4);
  EXPECT_EQ(report["prompts"], 2);
  EXPECT_EQ(report["images_per_prompt"], 2);
  EXPECT_EQ(report["accuracy"]["every_image"]["all"]["images"], 4);
  EXPECT_EQ(report["accuracy"]["best_ranked"]["all"]["images"], 2);
  EXPECT_EQ(report["accuracy"]["every_image"]["seen"]["images"], 4) << "neither prompt names a held-out pair";
  EXPECT_EQ(report["heldout_from"], (dir / "fc/config.yaml"));
  EXPECT_EQ(report["judgement"], "strict");
  EXPECT_EQ(report["threshold"], 0.1);
  EXPECT_EQ(report["bridge_contrast"], 0.3);
  EXPECT_TRUE(report.contains("fid"));
  // The real test images through the dVAE: the ceiling of a prior drawing through it, here
  // judged as before issue 25.
  const auto through = run("dalle-eval", "--log-level off score-real " + (dir / "fc/test") + " --classifier " +
                                             (dir / "classifier") + " --through-tokenizer " + (dir / "dvae") +
                                             " --tokenizer-run " + (dir / "dvae") + " --lenient --threshold 0.2");
  ASSERT_EQ(through.status, 0) << through.output;
  const auto ceiling = nlohmann::json::parse(through.output);
  EXPECT_EQ(ceiling["images"], 8);
  EXPECT_EQ(ceiling["judgement"], "lenient");
  EXPECT_EQ(ceiling["threshold"], 0.1) << "the lenient judgement keeps the threshold it was published with";
  EXPECT_EQ(ceiling["bridge_contrast"], 0);
  EXPECT_EQ(ceiling["through_tokenizer"], (dir / "dvae"));
  EXPECT_TRUE(ceiling["tokenizer"]["validation_psnr"].is_number());
}

TEST(Tools, EvalExplainsItselfAndRefusesBadInput) {
  ScratchDir dir;
  for (const char* command : {"train-classifier", "score", "score-real"}) {
    const auto help = run("dalle-eval", std::string(command) + " --help");
    EXPECT_EQ(help.status, 0) << command;
    EXPECT_THAT(help.output, ::testing::HasSubstr(command == std::string("score-real") ? "split" : "--out"));
  }
  EXPECT_THAT(run("dalle-eval", "score-real --help").output, ::testing::HasSubstr("--lenient"));
  EXPECT_THAT(run("dalle-eval", "--help").output, ::testing::HasSubstr("score-real"));
  EXPECT_EQ(run("dalle-eval", "").status, 2);
  EXPECT_EQ(run("dalle-eval", "score --generated " + (dir / "x")).status, 2) << "--classifier is required";

  auto result = run("dalle-eval", "train-classifier");
  EXPECT_EQ(result.status, 2);
  EXPECT_THAT(result.output, ::testing::HasSubstr("--out is required"));
  testing::write_text(dir / "sidecar.json", R"({"prompt": "a red bag on the left"})");
  result = run("dalle-eval", "score --generated " + (dir / "missing") + " --classifier " + dir.path().string());
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("missing: no such folder of generated images"));
  std::filesystem::create_directories(dir / "empty");
  result = run("dalle-eval", "score --generated " + (dir / "empty") + " --classifier " + dir.path().string());
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("no dalle-generate sidecars"));
  result = run("dalle-eval", "score --generated " + dir.path().string() + " --classifier " + (dir / "empty"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("empty: not an item classifier directory"));
  result = run("dalle-eval", "score-real " + (dir / "empty") + " --classifier " + (dir / "empty"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("captions.jsonl: cannot read"));
  EXPECT_FALSE(std::filesystem::exists(dir / "eval.json"));
}

// scripts/judge-agreement compares two classifiers' --details of one dalle-generate folder:
// one prompt, two candidates; the second classifier reads the rank-1 candidate's bag as a
// sneaker.
TEST(Tools, JudgeAgreementComparesTwoClassifiersVerdicts) {
  ScratchDir dir;
  const auto line = [](int rank, const char* item, bool correct) {
    return nlohmann::json{{"image", "0000-0" + std::to_string(rank) + ".png"},
                          {"prompt", "a red bag on the left"},
                          {"rank", rank},
                          {"heldout", false},
                          {"correct", correct},
                          {"measured", {{{"box", {0, 0, 9, 9}}, {"item", item}}}}}
               .dump() +
           "\n";
  };
  testing::write_text(dir / "a.jsonl", line(0, "coat", false) + line(1, "bag", true));
  testing::write_text(dir / "b.jsonl", line(0, "coat", false) + line(1, "sneaker", false));
  const std::string script = std::string(DALLE_SOURCE_DIR) + "/scripts/judge-agreement ";
  auto result = run_command(script + (dir / "a.jsonl") + " " + (dir / "b.jsonl"));
  ASSERT_EQ(result.status, 0) << result.output;
  const auto seen = nlohmann::json::parse(result.output)["seen"];
  EXPECT_EQ(seen["objects"], 2);
  EXPECT_DOUBLE_EQ(seen["item_agreement"].get<double>(), 0.5);
  EXPECT_EQ(seen["prompts"], 1);
  EXPECT_EQ(seen["best_ranked"], (nlohmann::json{{"a", 0.0}, {"b", 0.0}, {"both", 0.0}}));
  EXPECT_EQ(seen["any_image"], (nlohmann::json{{"a", 1.0}, {"b", 0.0}, {"both", 0.0}}));
  EXPECT_DOUBLE_EQ(seen["caption_verdicts"]["a"].get<double>(), 0.5);

  testing::write_text(dir / "c.jsonl", line(0, "coat", false));
  result = run_command(script + (dir / "a.jsonl") + " " + (dir / "c.jsonl"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("describe different images"));
}

// scripts/eval-demo-models' table: each row from its reports, both judges side by side, and
// CLIP's pick pooled over every prompt set drawn (here n16 and tuning, 4 seen prompts).
TEST(Tools, DemoResultsTableReadsBothJudgesAndPoolsThePromptSets) {
  ScratchDir dir;
  const auto report = [](double seen, double heldout) {
    nlohmann::json accuracy;
    for (const char* key : {"best_ranked", "every_image", "any_image"}) {
      for (const auto& [split, caption] : {std::pair{"seen", seen}, std::pair{"heldout", heldout}}) {
        accuracy[key][split] = {{"images", 1},          {"prompts", 1},          {"caption_accuracy", caption},
                                {"colour_accuracy", 1}, {"position_accuracy", 1}, {"item_accuracy", 1}};
      }
    }
    return nlohmann::json{{"accuracy", accuracy}, {"fid", nullptr}}.dump();
  };
  for (const char* name : {"n1", "n16", "n1-unguided", "n16-unguided", "real-test", "real-heldout"}) {
    testing::write_text(dir / (std::string(name) + "-first.json"), report(0.85, 0.68));
    testing::write_text(dir / (std::string(name) + "-second.json"), report(0.83, 0.65));
  }
  for (const char* split : {"test", "heldout"}) {
    testing::write_text(dir / ("through-vqgan-" + std::string(split) + ".json"), report(0.785, 0.795));
  }
  const auto pick = [](int prompt, bool correct) {
    return nlohmann::json{{"image", "000" + std::to_string(prompt) + "-00.png"}, {"prompt", "a red bag on the left"},
                          {"rank", 0}, {"heldout", false},
                          {"correct", correct}, {"measured", {{{"box", {0, 0, 9, 9}}, {"item", "bag"}}}}}
               .dump() +
           "\n";
  };
  for (const char* judge : {"first", "second"}) {
    testing::write_text(dir / ("n16-" + std::string(judge) + ".jsonl"), pick(0, true) + pick(1, false));
    testing::write_text(dir / ("tuning-" + std::string(judge) + ".jsonl"), pick(0, true) + pick(1, true));
  }
  const auto result = run_command(std::string(DALLE_SOURCE_DIR) + "/scripts/demo-results-table " + dir.path().string() +
                                  " first second");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("best of 16 by CLIP, the demo's guidance: caption 85% / 68% "
                                                  "(seen / held-out); second judge 83% / 65%"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("real test images through the VQGAN: caption 78.5% / 79.5%"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("over all 4 prompts, first judge: 75.0% (± 21.7) of 4 seen"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("items both judges name alike, n16: 100.0% seen"));
}

// scripts/compare-candidates pairs two folders' candidates prompt by prompt: two seen
// prompts of two candidates; A's first pick draws a coat for the red bag.
TEST(Tools, CompareCandidatesPairsTwoFoldersPromptByPrompt) {
  ScratchDir dir;
  const auto line = [](int prompt, int rank, const char* caption, bool correct) {
    const std::string image = "000" + std::to_string(prompt) + "-0" + std::to_string(rank) + ".png";
    return nlohmann::json{{"image", image},   {"prompt", caption}, {"rank", rank},
                          {"heldout", false}, {"correct", correct}, {"objects", {{{"item", correct}}}}}
               .dump() +
           "\n";
  };
  const char* bag = "a red bag on the left";
  const char* coat = "a blue coat at the top";
  testing::write_text(dir / "a.jsonl", line(0, 0, bag, false) + line(0, 1, bag, true) + line(1, 0, coat, true) +
                                           line(1, 1, coat, false));
  testing::write_text(dir / "b.jsonl", line(0, 0, bag, true) + line(0, 1, bag, true) + line(1, 0, coat, true) +
                                           line(1, 1, coat, true));
  const std::string script = std::string(DALLE_SOURCE_DIR) + "/scripts/compare-candidates ";
  auto result = run_command(script + (dir / "a.jsonl") + " " + (dir / "b.jsonl"));
  ASSERT_EQ(result.status, 0) << result.output;
  auto seen = nlohmann::json::parse(result.output)["seen"];
  EXPECT_EQ(seen["prompts"], 2);
  EXPECT_DOUBLE_EQ(seen["one_candidate"]["a"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(seen["one_candidate"]["difference"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(seen["one_candidate"]["standard_error"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(seen["pick"]["a"].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(seen["pick"]["b"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(seen["pick"]["standard_error"].get<double>(), 0.5);
  EXPECT_EQ(seen["items"]["red bag"], (nlohmann::json{{"a", 0.5}, {"a_picks", 0.0}, {"b", 1.0}, {"b_picks", 1.0}}));

  // Picks by another CLIP's scores: the highest other_clips[0] of each prompt.
  const auto score = [](const char* image, double clip) {
    return nlohmann::json{{"image", image}, {"other_clips", {clip}}}.dump() + "\n";
  };
  testing::write_text(dir / "scores.jsonl", score("0000-00.png", 1) + score("0000-01.png", 2) +
                                                score("0001-00.png", 3) + score("0001-01.png", 0));
  result = run_command(script + "--scores-a " + (dir / "scores.jsonl") + " " + (dir / "a.jsonl") + " " + (dir / "b.jsonl"));
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(result.output)["seen"]["pick"]["a"].get<double>(), 1.0);

  testing::write_text(dir / "c.jsonl", line(0, 0, bag, false));
  result = run_command(script + (dir / "a.jsonl") + " " + (dir / "c.jsonl"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("different prompts"));

  // A prompt without its pick is named in one line, not a traceback.
  testing::write_text(dir / "unranked.jsonl", line(0, 1, bag, true) + line(1, 0, coat, true));
  result = run_command(script + (dir / "unranked.jsonl") + " " + (dir / "b.jsonl"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("A (pair 1), prompt 0 has no rank-0 candidate"));
  EXPECT_THAT(result.output, ::testing::Not(::testing::HasSubstr("Traceback")));
  testing::write_text(dir / "partial.jsonl", score("0000-01.png", 2));
  result = run_command(script + "--scores-b " + (dir / "partial.jsonl") + " " + (dir / "a.jsonl") + " " +
                       (dir / "b.jsonl"));
  EXPECT_EQ(result.status, 1);
  EXPECT_THAT(result.output, ::testing::HasSubstr("B (pair 1), prompt 1 has no pick in --scores-b"));
}

// The same chain with a VQGAN as the image tokenizer: encode-images, the prior's sample
// grid and dalle-generate find its kind in its checkpoint.
TEST(Tools, GenerateDecodesWithAVqgan) {
  ScratchDir dir;
  auto check = [](const Result& result) { ASSERT_EQ(result.status, 0) << result.output; };
  check(run("dalle-data", "compose --out " + (dir / "fc") +
                              " --set train_images=16 --set test_images=0 --set heldout_images=0"));
  check(run("dalle-tokenizer", "train --captions " + (dir / "fc/train") + " --out " + (dir / "tok.model") +
                                   " --set vocab_size=60 --set text_length=12"));
  testing::write_text(dir / "vqgan.yaml",
                      "kind: vqgan\n"
                      "model: {ch: 8, ch_mult: [1, 2], num_res_blocks: 1, attn_resolutions: [8], z_channels: 8,\n"
                      "        embed_dim: 8, n_embed: 32, resolution: 16, norm_groups: 4}\n"
                      "data: {train: " + (dir / "fc/train") + ", validation: " + (dir / "fc/train") +
                      ", image_size: 16, batch_size: 8}\n"
                      "run: {steps: 1}\n");
  check(run("dalle-train-vae", "--config " + (dir / "vqgan.yaml") + " --out " + (dir / "vqgan")));
  check(run("dalle-encode-images", "--dataset " + (dir / "fc/train") + " --vqgan " + (dir / "vqgan") +
                                       " --tokenizer " + (dir / "tok.model") + " --out " + (dir / "tokens")));
  testing::write_text(dir / "prior.yaml",
                      "model: {text_length: 12, text_vocab_size: 60, grid_size: 8, image_vocab_size: 32,\n"
                      "        layers: 1, width: 16, heads: 2, conv_kernel: 3}\n"
                      "data: {train: " + (dir / "tokens") + ", batch_size: 8}\n"
                      "run: {steps: 1, validate_every: 1, checkpoint_every: 1}\n"
                      "tokenizer: " + (dir / "tok.model") + "\nimage_tokenizer: " + (dir / "vqgan") + "\n"
                      "sample_captions: [a red bag on the left]\n");
  check(run("dalle-train", "--config " + (dir / "prior.yaml") + " --out " + (dir / "prior")));
  EXPECT_TRUE(std::filesystem::exists(dir / "prior/samples/step-000000001.png"));
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "out") + " -n 1 'a red bag'"));
  EXPECT_TRUE(std::filesystem::exists(dir / "out/0000-00.png"));
  // Previews: the same image, and the preview file gone once the images are written.
  check(run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "previewed") +
                                  " -n 2 --preview-every 16 --preview-candidates 1 'a red bag'"));
  const auto tokens_of = [&](const std::string& folder) {
    return nlohmann::json::parse(testing::read_text(dir / (folder + "/0000-00.json")))["image_tokens"];
  };
  EXPECT_EQ(tokens_of("previewed"), tokens_of("out")) << "previews change no draw";
  EXPECT_FALSE(std::filesystem::exists(dir / "previewed.preview.png"));
  const auto refused = run("dalle-generate", "--prior " + (dir / "prior") + " --out " + (dir / "never") +
                                                 " --preview-candidates -1 'a red bag'");
  EXPECT_EQ(refused.status, 2) << refused.output;
  EXPECT_THAT(refused.output, ::testing::HasSubstr("--preview-candidates"));

  // The whole pipeline: CLIP ranks all 4 candidates, then keeps the best 2, which the
  // x2 super-resolution upscales.
  testing::write_text(dir / "clip.yaml",
                      "model: {embed_dim: 16, image_size: 16, patch_size: 8, vision_width: 16, vision_layers: 1,\n"
                      "        vision_heads: 2, context_length: 12, vocab_size: 60, text_width: 16, text_layers: 1,\n"
                      "        text_heads: 2}\n"
                      "data: {train: " + (dir / "fc/train") + ", validation: " + (dir / "fc/train") +
                      ", image_size: 16, batch_size: 8}\n"
                      "tokenizer: " + (dir / "tok.model") + "\nrun: {steps: 2, validate_every: 2, checkpoint_every: 2}\n");
  check(run("dalle-train-clip", "--config " + (dir / "clip.yaml") + " --out " + (dir / "clip")));
  check(run("dalle-train-sr", "--config " + std::string(DALLE_SOURCE_DIR) +
                                  "/configs/superres/fashion-compose-x2-tiny.yaml --set data.train=" + (dir / "fc/train") +
                                  " --set data.validation=" + (dir / "fc/train") + " --set data.image_size=16" +
                                  " --set model.num_feat=8 --set model.num_block=1 --set model.num_grow_ch=4" +
                                  " --set data.batch_size=4 --set run.steps=2 --out " + (dir / "sr")));
  const std::string pipeline = "--prior " + (dir / "prior") + " --clip " + (dir / "clip") + " --candidates 4 --seed 3";
  check(run("dalle-generate", pipeline + " -n 4 --out " + (dir / "ranked") + " 'a red bag'"));
  check(run("dalle-generate", pipeline + " -n 2 --superres " + (dir / "sr") + " --out " + (dir / "best") +
                                  " 'a red bag'"));
  std::vector<double> scores;
  for (const char* stem : {"0000-00", "0000-01", "0000-02", "0000-03"}) {
    const auto ranked = nlohmann::json::parse(testing::read_text(dir / "ranked/" + stem + ".json"));
    scores.push_back(ranked["clip_score"].get<double>());
    if (scores.size() > 1) {
      EXPECT_LE(scores.back(), scores[scores.size() - 2]) << "ranked best first";
    }
    if (scores.size() > 2) continue;
    const auto kept = nlohmann::json::parse(testing::read_text(dir / "best/" + stem + ".json"));
    EXPECT_EQ(kept["candidate"], ranked["candidate"]) << "the best 2 of the same 4 samples";
    EXPECT_EQ(kept["image_tokens"], ranked["image_tokens"]);
    EXPECT_EQ(kept["size"], nlohmann::json({32, 32})) << "upscaled x2";
    EXPECT_EQ(ranked["size"], nlohmann::json({16, 16}));
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "best/0000-02.png"));

  // Imported CLIP weights (scripts/export_open_clip.py's layout: argmax pooling over CLIP's
  // own BPE ids) rerank with clip_tokenizer, and are refused without it.
  const std::string imported_yaml =
      "model: {embed_dim: 16, image_size: 16, patch_size: 8, vision_width: 16, vision_layers: 1, vision_heads: 2,\n"
      "        context_length: 16, vocab_size: 666, text_width: 16, text_layers: 1, text_heads: 2,\n"
      "        text_pooling: argmax}\n";
  std::filesystem::create_directories(dir / "imported");
  torch::manual_seed(0);
  models::Clip imported(models::ClipConfig{.embed_dim = 16, .image_size = 16, .patch_size = 8, .vision_width = 16,
                                           .vision_layers = 1, .vision_heads = 2, .context_length = 16,
                                           .vocab_size = 666, .text_width = 16, .text_layers = 1, .text_heads = 2});
  io::write_safetensors(dir / "imported/model.safetensors", io::state_dict(*imported));
  io::write_safetensors(dir / "imported/state.safetensors", {});
  testing::write_text(dir / "imported/config.yaml", "kind: clip\n" + imported_yaml);
  const std::string merges = testing::fixture_path("clip_bpe_test.txt.gz");
  const std::string imported_pipeline = "--prior " + (dir / "prior") + " --clip " + (dir / "imported") + " --candidates 4 --seed 3";
  check(run("dalle-generate", imported_pipeline + " --set clip_tokenizer=" + merges + " -n 1 --out " +
                                  (dir / "imported-out") + " 'a red bag'"));
  const auto best = nlohmann::json::parse(testing::read_text(dir / "imported-out/0000-00.json"));
  EXPECT_TRUE(best["clip_score"].is_number());
  EXPECT_EQ(best["pipeline"]["clip_tokenizer"], merges);
  EXPECT_GE(std::stoi(best["pipeline"]["threads"].get<std::string>()), 1)
      << "the thread count that drew the image, not the config's 0 (the samples depend on it)";
  const auto without = run("dalle-generate", imported_pipeline + " -n 1 --out " + (dir / "refused") + " 'a red bag'");
  EXPECT_EQ(without.status, 1);
  EXPECT_THAT(without.output, ::testing::HasSubstr("set clip_tokenizer to CLIP's bpe_simple_vocab_16e6.txt.gz"));
  const auto misfit = run("dalle-generate", "--prior " + (dir / "prior") + " --clip " + (dir / "clip") +
                                                " --set clip_tokenizer=" + merges + " -n 2 --out " + (dir / "misfit") + " 'a red bag'");
  EXPECT_EQ(misfit.status, 1);
  EXPECT_THAT(misfit.output, ::testing::HasSubstr("(666 ids, end of text 665) does not fit the CLIP model"));
}


// Hostile and careless input to the built tools (issue 23): each is refused or skipped with a
// message naming the file, key or line, the right exit status, in bounded time, and nothing
// already written is lost.
namespace hostile {

namespace fs = std::filesystem;
const std::string kSource = DALLE_SOURCE_DIR;

// The shipped prior names its tokenizers relative to the checkout: run from there.
Result run_in_checkout(const std::string& tool, const std::string& arguments) {
  return run_command("cd " + kSource + " && " + std::string(DALLE_TOOLS_DIR) + "/" + tool + " " + arguments);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string copy_of_shipped(const std::string& model, const ScratchDir& dir, const std::string& name) {
  fs::copy(kSource + "/models/fashion-compose-f8/" + model, dir / name, fs::copy_options::recursive);
  return dir / name;
}

// `--model` runs a model folder's generate.yaml from any directory: its paths are the folder's.
TEST(ToolsHostile, GenerateRunsAModelFolderFromAnywhere) {
  ScratchDir dir;
  const std::string folder = kSource + "/models/fashion-compose-f8";
  auto result = run("dalle-generate", "--model " + folder + " --candidates 2 -n 1 --threads 1 --out " + (dir / "out") +
                                          " 'a red bag on the left'");
  ASSERT_EQ(result.status, 0) << result.output;
  const auto sidecar = nlohmann::json::parse(testing::read_text(dir / "out/0000-00.json"));
  EXPECT_EQ(sidecar.at("pipeline").at("prior"), folder + "/prior");
  EXPECT_EQ(sidecar.at("pipeline").at("candidates"), "2") << "the command line overrides the folder's 16";
  EXPECT_TRUE(sidecar.at("clip_score").is_number()) << "the folder's CLIP reranked";
  EXPECT_FALSE(fs::exists(dir / "out/0000-01.png"));

  result = run("dalle-generate", "--model " + folder + " --config " + (folder + "/generate.yaml") + " --out " +
                                     (dir / "both") + " 'a red bag'");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("give one"));
  result = run("dalle-generate", "--model " + dir.path().string() + " --out " + (dir / "none") + " 'a red bag'");
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("not a model folder"));
}

// -n is the images written per prompt, as dalle-serve's n: of a folder's 16 candidates (and
// its CLIP) the best one; the --keep of before still works, with a warning.
TEST(ToolsHostile, GenerateNIsTheImagesWrittenAsOverHttp) {
  ScratchDir dir;
  const std::string folder = "--model " + kSource + "/models/fashion-compose-f8 --threads 1 ";
  auto result = run("dalle-generate", folder + "-n 1 --out " + (dir / "one") + " 'a red bag on the left'");
  ASSERT_EQ(result.status, 0) << result.output;
  const auto sidecar = nlohmann::json::parse(testing::read_text(dir / "one/0000-00.json"));
  EXPECT_EQ(sidecar.at("pipeline").at("candidates"), "16") << "the folder's candidates, of which the best is kept";
  EXPECT_EQ(sidecar.at("pipeline").at("keep"), "1");
  EXPECT_FALSE(fs::exists(dir / "one/0000-01.png"));

  result = run("dalle-generate", folder + "--candidates 2 --keep 1 --out " + (dir / "old") + " 'a red bag'");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("--keep is now -n"));
  EXPECT_FALSE(fs::exists(dir / "old/0000-01.png"));
  for (const auto& [arguments, error] : {std::pair{"-n 1 --keep 1", "give -n alone"},
                                          {"--candidates 2 -n 3", "-n 3 exceeds --candidates 2"},
                                          {"--candidates 2 --images-per-prompt 2", "give one"}}) {
    result = run("dalle-generate", folder + arguments + " --out " + (dir / "refused") + " 'a red bag'");
    EXPECT_EQ(result.status, 2) << arguments << ": " << result.output;
    EXPECT_THAT(result.output, ::testing::HasSubstr(error)) << arguments;
  }
  EXPECT_FALSE(fs::exists(dir / "refused"));
}

TEST(ToolsHostile, AModelFolderWithoutSizesOrWithNanWeightsIsRefused) {
  ScratchDir dir;
  const auto empty = copy_of_shipped("prior", dir, "empty");
  testing::write_text(empty + "/config.yaml", "");
  auto start = std::chrono::steady_clock::now();
  auto result = run("dalle-generate", "--prior " + empty + " --out " + (dir / "out") + " 'a red bag'");
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("empty/config.yaml: 'model' is missing or empty"));
  EXPECT_LT(seconds_since(start), 30) << "refused, not built";
  EXPECT_FALSE(fs::exists(dir / "out"));
  result = run("dalle-export", empty + " --out " + (dir / "exported"));
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("must name its sizes"));
  EXPECT_FALSE(fs::exists(dir / "exported"));

  const auto nan = copy_of_shipped("prior", dir, "nan");
  auto weights = io::read_safetensors(nan + "/model.safetensors").tensors;
  const std::string damaged = weights.begin()->first;
  weights.begin()->second.view(-1)[0] = std::numeric_limits<float>::quiet_NaN();
  io::write_safetensors(nan + "/model.safetensors", weights);
  result = run("dalle-generate", "--prior " + nan + " --out " + (dir / "out") + " 'a red bag'");
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("tensor '" + damaged + "' holds NaN or infinite values"));
  EXPECT_FALSE(fs::exists(dir / "out"));
  result = run("dalle-export", nan + " --out " + (dir / "exported"));
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr(damaged));
  EXPECT_FALSE(fs::exists(dir / "exported"));

  const auto misshapen = copy_of_shipped("prior", dir, "misshapen");
  weights = io::read_safetensors(kSource + "/models/fashion-compose-f8/prior/model.safetensors").tensors;
  auto matrix = std::find_if(weights.begin(), weights.end(), [](const auto& item) { return item.second.dim() == 2; });
  ASSERT_NE(matrix, weights.end());
  matrix->second = matrix->second.flatten();
  io::write_safetensors(misshapen + "/model.safetensors", weights);
  result = run("dalle-export", misshapen + " --out " + (dir / "exported"));
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("misshapen: " + matrix->first));
  EXPECT_FALSE(fs::exists(dir / "exported"));
}

TEST(ToolsHostile, DecompressionBombsAndEndlessCaptionsAreSkippedInDatasets) {
  ScratchDir dir;
  ASSERT_EQ(run("dalle-data", "compose --out " + (dir / "fc") +
                                  " --set train_images=6 --set test_images=0 --set heldout_images=0").status, 0);
  testing::write_text(dir / "fc/train/images/000002.png", testing::png_claiming(20000, 20000));
  testing::write_text(dir / "fc/train/images/000003.png", testing::png_claiming(20000, 20000, 16, 6));
  const std::string endless(5 << 20, 'x');
  {
    std::ofstream captions(dir / "fc/train/captions.jsonl", std::ios::app);
    captions << nlohmann::json{{"image", "images/000004.png"}, {"caption", "a red bag " + endless}}.dump() << "\n";
  }
  auto start = std::chrono::steady_clock::now();
  auto result = run("dalle-data", "inspect " + (dir / "fc/train") + " --verify --grid " + (dir / "grid.png") +
                                      " --count 6");
  EXPECT_EQ(result.status, 0) << result.output.substr(0, 2000);
  EXPECT_THAT(result.output, ::testing::HasSubstr("2 unreadable images")) << "each counted once";
  EXPECT_THAT(result.output, ::testing::HasSubstr("000003.png: 20000x20000 pixels, over the limit of 33554432"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("cut to 1024 (DALLE_MAX_TEXT_BYTES)"));
  EXPECT_LT(result.output.size(), 20000u) << "no caption echoed whole";
  EXPECT_LT(fs::file_size(dir / "grid.png"), 1u << 20);
  EXPECT_LT(seconds_since(start), 30);

  const std::string gone = std::to_string(testing::ended_process_id());
  fs::create_directories(dir / ("tokens.tmp-" + gone + "-0/partial"));
  const std::string shipped = kSource + "/models/fashion-compose-f8/";
  start = std::chrono::steady_clock::now();
  result = run("dalle-encode-images", "--dataset " + (dir / "fc/train") + " --vqgan " + shipped + "vqgan --tokenizer " +
                                          shipped + "tokenizer.model --out " + (dir / "tokens"));
  EXPECT_EQ(result.status, 0) << result.output.substr(0, 2000);
  EXPECT_THAT(result.output, ::testing::HasSubstr("2 unreadable images skipped"));
  EXPECT_LT(result.output.size(), 20000u) << "no caption echoed whole";
  EXPECT_LT(seconds_since(start), 60);
  EXPECT_TRUE(fs::exists(dir / "tokens/dataset.json"));
  EXPECT_FALSE(fs::exists(dir / ("tokens.tmp-" + gone + "-0"))) << "a killed encode's leftover is removed";

  // dalle-eval score over a folder with no readable image fails instead of reporting nothing.
  ASSERT_EQ(run("dalle-eval", "train-classifier --out " + (dir / "classifier") +
                                  " --set train_limit=200 --set test_limit=50 --set epochs=1").status, 0);
  fs::create_directories(dir / "generated");
  testing::write_text(dir / "generated/0000-00.json", R"({"prompt": "a red bag on the left"})");
  testing::write_text(dir / "generated/0000-00.png", testing::png_claiming(20000, 20000, 16, 6));
  result = run("dalle-eval", "score --generated " + (dir / "generated") + " --classifier " + (dir / "classifier"));
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("20000x20000 pixels"));
  EXPECT_THAT(result.output, ::testing::HasSubstr("none of its 1 images could be read"));
  EXPECT_FALSE(fs::exists(dir / "generated/eval.json"));
}

TEST(ToolsHostile, GenerateChecksItsCommandLineAndPromptsBeforeAnyWork) {
  ScratchDir dir;
  const std::string prior = "--prior models/fashion-compose-f8/prior --threads 1 ";
  auto result = run_in_checkout("dalle-generate", prior + "'a red bag'");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("--out is required"));
  for (const auto& [bad, key] : {std::pair{"--candidates 0", "candidates: 0 is out of range"},
                                 std::pair{"-n 0", "-n '0': expected the images written per prompt, 1 to 65536"},
                                 std::pair{"-n many", "-n 'many': expected the images"},
                                 std::pair{"--top-p 2", "sampling.top_p"}}) {
    result = run_in_checkout("dalle-generate", prior + bad + " --out " + (dir / "out") + " 'a red bag'");
    EXPECT_EQ(result.status, 2) << bad << ": " << result.output;
    EXPECT_THAT(result.output, ::testing::HasSubstr(key)) << bad;
  }
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " 'a red bag' '  '");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("prompt 2: the prompt is blank"));
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " \"$(printf 'a red caf\\351')\"");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("prompt 1: the prompt is not valid UTF-8"));

  testing::write_text(dir / "long.txt", "a red bag\n" + std::string(2'000'000, 'x') + "\n");
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " --prompts-file " + (dir / "long.txt"));
  EXPECT_EQ(result.status, 1) << result.output.substr(0, 2000);
  EXPECT_THAT(result.output, ::testing::HasSubstr("long.txt:2: the prompt is over the limit of 1024 bytes"));
  EXPECT_LT(result.output.size(), 2000u);
  // A file without line ends is read no further than the limit, not to its end.
  auto zeros = std::chrono::steady_clock::now();
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " --prompts-file /dev/zero");
  EXPECT_EQ(result.status, 1) << result.output.substr(0, 2000);
  EXPECT_THAT(result.output, ::testing::HasSubstr("/dev/zero:1: the prompt is over the limit of 1024 bytes"));
  EXPECT_LT(seconds_since(zeros), 5);
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " \"$(printf 'a red \033[2Jbag')\"");
  EXPECT_EQ(result.status, 2) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("prompt 1: the prompt holds a control character (U+001B at byte 7)"));
  testing::write_text(dir / "nul.txt", std::string("a red bag\na blue\0 bag\n", 22));
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " --prompts-file " + (dir / "nul.txt"));
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output,
              ::testing::HasSubstr("nul.txt:2: the prompt holds a control character (U+0000 at byte 7)"));
  testing::write_text(dir / "latin1.txt", "a red bag\na blue caf\xe9\n");
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "out") + " --prompts-file " + (dir / "latin1.txt"));
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("latin1.txt:2: the prompt is not valid UTF-8"));

  testing::write_text(dir / "file", "");
  auto start = std::chrono::steady_clock::now();
  result = run_in_checkout("dalle-generate", prior + "--out " + (dir / "file/out") + " 'a red bag'");
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("file/out: cannot write the output folder"));
  EXPECT_LT(seconds_since(start), 5) << "refused before the models are loaded";
  EXPECT_FALSE(fs::exists(dir / "out")) << "nothing was generated";
}

TEST(ToolsHostile, GenerateReplacesOnlyItsOwnEarlierOutputAndWhole) {
  ScratchDir dir;
  const std::string prior = "--prior models/fashion-compose-f8/prior --threads 1 -n 1 --out " + (dir / "out");
  testing::write_text(dir / "prompts.txt", "a red bag on the left\n   \n\t\na white trouser on the right\n");
  const std::string gone = std::to_string(testing::ended_process_id());
  fs::create_directories(dir / ("out.tmp-" + gone + "-1"));
  auto result = run_in_checkout("dalle-generate", prior + " --prompts-file " + (dir / "prompts.txt"));
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_TRUE(fs::exists(dir / "out/0001-00.json")) << "two prompts: blank lines are not prompts";
  EXPECT_FALSE(fs::exists(dir / "out/0002-00.json"));
  EXPECT_FALSE(fs::exists(dir / ("out.tmp-" + gone + "-1"))) << "a killed run's staging folder is removed";
  testing::write_text(dir / "out/eval.json", "{}");

  result = run_in_checkout("dalle-generate", prior + " 'a blue bag at the top'");
  ASSERT_EQ(result.status, 0) << result.output;
  EXPECT_EQ(nlohmann::json::parse(testing::read_text(dir / "out/0000-00.json"))["prompt"], "a blue bag at the top");
  EXPECT_FALSE(fs::exists(dir / "out/0001-00.json")) << "no stale sidecar of the earlier output";
  EXPECT_FALSE(fs::exists(dir / "out/eval.json")) << "nor its stale report";

  testing::write_text(dir / "out/notes.txt", "mine");
  result = run_in_checkout("dalle-generate", prior + " 'a green bag at the top'");
  EXPECT_EQ(result.status, 1) << result.output;
  EXPECT_THAT(result.output, ::testing::HasSubstr("not an earlier dalle-generate output (it holds 'notes.txt')"));
  EXPECT_EQ(testing::read_text(dir / "out/notes.txt"), "mine");
  EXPECT_EQ(nlohmann::json::parse(testing::read_text(dir / "out/0000-00.json"))["prompt"], "a blue bag at the top");
}

}  // namespace hostile

}  // namespace
}  // namespace dalle
