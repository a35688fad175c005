// Every recipe under configs/ loads with the tool that reads it: no unknown keys, values in
// range, sizes consistent.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <vector>

#include "dalle/config.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/generate/pipeline.h"
#include "dalle/text/tokenizer.h"
#include "dalle/train/trainers/clip_trainer.h"
#include "dalle/train/trainers/dvae_trainer.h"
#include "dalle/train/trainers/bart_prior_trainer.h"
#include "dalle/train/trainers/prior_trainer.h"
#include "dalle/train/trainers/superres_trainer.h"
#include "dalle/train/trainers/vqgan_trainer.h"
#include "test_support.h"

namespace dalle {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> configs_in(const std::string& folder) {
  std::vector<std::string> paths;
  for (const auto& entry : fs::directory_iterator(std::string(DALLE_SOURCE_DIR) + "/configs/" + folder)) {
    if (entry.path().extension() == ".yaml") paths.push_back(entry.path().string());
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

// One shipped recipe, by its path under configs/.
template <class Config>
Config shipped(const std::string& path) {
  return load_config<Config>(ConfigSource::from_file(std::string(DALLE_SOURCE_DIR) + "/configs/" + path));
}

// A recipe that fine-tunes (init_from) a model folder of the source tree must have its model
// section, but for the keys `may_differ` names.
template <class ModelConfig>
void expect_model_of(ModelConfig model, const std::string& init_from,
                     const std::function<bool(const std::string&)>& may_differ = nullptr) {
  SCOPED_TRACE(init_from);
  ModelConfig from;
  bind_config_parts(ConfigSource::from_file(std::string(DALLE_SOURCE_DIR) + "/" + init_from + "/config.yaml"),
                    [&from](ConfigVisitor& v) { v.section("model", "", from); }, {"model"});
  const auto compared = [&](auto config) {
    auto keys = flatten_config(visit_of(config));
    if (may_differ) std::erase_if(keys, [&](const auto& key) { return may_differ(key.first); });
    return keys;
  };
  EXPECT_EQ(compared(model), compared(from));
}

TEST(ShippedConfigs, EveryTrainerReadsTheSharedSectionsAndNamesWhereOldKeysWent) {
  const auto source = [](const std::string& yaml) { return ConfigSource::from_string(yaml, "old.yaml"); };
  EXPECT_THROW_WITH(load_config<train::PriorTrainConfig>(source("model: {layers: 2}\nsteps: 5\n")), ConfigError,
                    "old.yaml:2:", "'steps' has moved to 'run.steps'");
  EXPECT_THROW_WITH(load_config<train::VqganTrainConfig>(source("beta1: 0.5\n")), ConfigError,
                    "'beta1' has moved to 'optimizer.beta1'");
  const std::string shared = "optimizer: {beta1: 0.8, grad_clip: 2}\nrun: {steps: 7, device: cpu}\n";
  EXPECT_EQ(load_config<train::DvaeTrainConfig>(source(shared)).run.steps, 7);
  EXPECT_EQ(load_config<train::VqganTrainConfig>(source(shared)).optimizer.beta1, 0.8);
  EXPECT_EQ(load_config<train::PriorTrainConfig>(source(shared)).optimizer.grad_clip, 2.0);
  EXPECT_EQ(load_config<train::ClipTrainConfig>(source(shared)).run.device, "cpu");
  EXPECT_EQ(load_config<train::SuperResTrainConfig>(source(shared)).run.steps, 7);
  EXPECT_EQ(load_config<train::BartPriorTrainConfig>(source(shared)).optimizer.beta1, 0.8);
}

TEST(ShippedConfigs, ImageTokenizerRecipesLoadAsTheirKind) {
  int vqgans = 0, dvaes = 0;
  for (const auto& folder : {"dvae", "vqgan"}) {
    for (const auto& path : configs_in(folder)) {
      SCOPED_TRACE(path);
      const auto source = ConfigSource::from_file(path);
      const auto kind = peek_choice(source, "kind", "dvae", {"dvae", "vqgan"});
      EXPECT_EQ(kind, folder);
      if (kind == "vqgan") {
        auto config = load_config<train::VqganTrainConfig>(source);
        EXPECT_NO_THROW(config.model.validate());
        EXPECT_EQ(config.data.image_size % config.model.downsampling_factor(), 0);
        if (!config.init_from.empty()) expect_model_of(config.model, config.init_from);
        ++vqgans;
      } else {
        const auto config = load_config<train::DvaeTrainConfig>(source);
        EXPECT_NO_THROW(config.model.validate());
        ++dvaes;
      }
    }
  }
  EXPECT_EQ(vqgans, 6);
  EXPECT_EQ(dvaes, 2);
}

TEST(ShippedConfigs, RuDalleRecipeHasRuDallesSizes) {
  const auto config = shipped<train::VqganTrainConfig>("vqgan/rudalle-gumbel-f8.yaml");
  const auto& m = config.model;
  EXPECT_EQ(m.ch, 128);
  EXPECT_EQ(m.ch_mult, (std::vector<int64_t>{1, 1, 2, 4}));
  EXPECT_EQ(m.num_res_blocks, 2);
  EXPECT_EQ(m.attn_resolutions, (std::vector<int64_t>{32}));
  EXPECT_EQ(m.z_channels, 256);
  EXPECT_EQ(m.embed_dim, 256);
  EXPECT_EQ(m.n_embed, 8192);
  EXPECT_EQ(m.resolution, 256);
  EXPECT_EQ(m.quantizer, "gumbel");
  EXPECT_EQ(config.data.image_size / m.downsampling_factor(), 32) << "32x32 tokens";
}

TEST(ShippedConfigs, SuperResolutionRecipesLoadAndValidate) {
  int count = 0;
  for (const auto& path : configs_in("superres")) {
    SCOPED_TRACE(path);
    const auto config = load_config<train::SuperResTrainConfig>(ConfigSource::from_file(path));
    EXPECT_NO_THROW(config.validate());
    ++count;
  }
  EXPECT_EQ(count, 2);
  const auto x4 = shipped<train::SuperResTrainConfig>("superres/realesrnet-x4plus.yaml");
  EXPECT_EQ(x4.model.scale, 4);
  EXPECT_EQ(x4.model.num_feat, 64);
  EXPECT_EQ(x4.model.num_block, 23);
  EXPECT_EQ(x4.model.num_grow_ch, 32);
}

TEST(ShippedConfigs, DataAndTextRecipesLoad) {
  for (const auto& path : configs_in("data")) {
    SCOPED_TRACE(path);
    EXPECT_NO_THROW(load_config<data::FashionComposeConfig>(ConfigSource::from_file(path)));
  }
  for (const auto& path : configs_in("text")) {
    SCOPED_TRACE(path);
    EXPECT_NO_THROW(load_config<text::TokenizerConfig>(ConfigSource::from_file(path)));
  }
}

TEST(ShippedConfigs, GenerationPipelinesLoad) {
  const auto paths = configs_in("generate");
  ASSERT_FALSE(paths.empty());
  for (const auto& path : paths) {
    SCOPED_TRACE(path);
    const auto config = load_config<generate::PipelineConfig>(ConfigSource::from_file(path));
    EXPECT_FALSE(config.prior.empty());
    EXPECT_LE(config.kept(), config.candidates);
  }
}

TEST(ShippedConfigs, PriorRecipesLoadAndTheDemoOnesFitItsTokenizers) {
  const auto tokenizer = shipped<text::TokenizerConfig>("text/fashion-compose-tokenizer.yaml");
  const std::vector vqgans = {shipped<train::VqganTrainConfig>("vqgan/fashion-compose-tiny.yaml"),
                               shipped<train::VqganTrainConfig>("vqgan/fashion-compose-f4.yaml")};
  const auto reads_tokens_of = [](const train::PriorTrainConfig& prior, const train::VqganTrainConfig& vqgan) {
    return prior.model.image_vocab_size == vqgan.model.n_embed &&
           prior.model.grid_size * vqgan.model.downsampling_factor() == vqgan.data.image_size;
  };
  int demo_recipes = 0;
  int bart_recipes = 0;
  for (const auto& path : configs_in("prior")) {
    SCOPED_TRACE(path);
    if (peek_choice(ConfigSource::from_file(path), "kind", "prior", {"prior", "bart_prior"}) == "bart_prior") {
      EXPECT_NO_THROW(load_config<train::BartPriorTrainConfig>(ConfigSource::from_file(path)).model.validate());
      ++bart_recipes;
      continue;
    }
    auto config = load_config<train::PriorTrainConfig>(ConfigSource::from_file(path));
    EXPECT_NO_THROW(config.model.validate());
    if (config.init_from == "runs/demo/prior") {
      // scripts/train-demo-models trains the f4 prior into runs/demo/prior first.
      auto base = shipped<train::PriorTrainConfig>("prior/fashion-compose-f4-long.yaml");
      EXPECT_EQ(flatten_config(visit_of(config.model)), flatten_config(visit_of(base.model)));
    } else if (config.init_from == "models/rudalle-malevich/prior") {
      // scripts/import-model rudalle makes it, with ruDALL-E XL's sizes.
      auto xl = shipped<train::PriorTrainConfig>("prior/rudalle-xl.yaml");
      EXPECT_EQ(flatten_config(visit_of(config.model)), flatten_config(visit_of(xl.model)));
    } else if (!config.init_from.empty()) {
      expect_model_of(config.model, config.init_from, train::only_training_reads);
    }
    if (path.find("fashion-compose") == std::string::npos) continue;
    EXPECT_EQ(config.model.text_length, tokenizer.text_length);
    EXPECT_EQ(config.model.text_vocab_size, tokenizer.vocab_size);
    EXPECT_EQ(std::ranges::count_if(vqgans, [&](const auto& vqgan) { return reads_tokens_of(config, vqgan); }), 1)
        << "a fashion-compose prior reads the tokens of exactly one fashion-compose VQGAN recipe";
    ++demo_recipes;
  }
  EXPECT_EQ(demo_recipes, 7);
  EXPECT_EQ(bart_recipes, 1);
}

TEST(ShippedConfigs, ClipRecipesFitTheDemoTokenizer) {
  const auto tokenizer = shipped<text::TokenizerConfig>("text/fashion-compose-tokenizer.yaml");
  int recipes = 0;
  for (const auto& path : configs_in("clip")) {
    SCOPED_TRACE(path);
    const auto config = load_config<train::ClipTrainConfig>(ConfigSource::from_file(path));
    EXPECT_NO_THROW(config.model.validate());
    EXPECT_EQ(config.model.text_pooling, "eos") << "our tokenizer's end of text is not its largest id";
    EXPECT_EQ(config.model.eos_id, text::Tokenizer::kEndId);
    EXPECT_EQ(config.data.image_size, config.model.image_size);
    EXPECT_GE(config.model.vocab_size, tokenizer.vocab_size);
    EXPECT_GE(config.model.context_length, tokenizer.text_length);
    ++recipes;
  }
  EXPECT_EQ(recipes, 3);
}

TEST(ShippedConfigs, TheShippedClipIsTheModelOfItsRecipe) {
  // scripts/train-demo-models exports configs/clip/fashion-compose-f4-60k.yaml's run there.
  expect_model_of(shipped<train::ClipTrainConfig>("clip/fashion-compose-f4-60k.yaml").model,
                  "models/fashion-compose/clip");
}

TEST(ShippedConfigs, KindIsCheckedLikeAnyKey) {
  const auto source = ConfigSource::from_string("model: {}\nkind: vqgn\n", "recipe.yaml");
  EXPECT_THROW_WITH(peek_choice(source, "kind", "dvae", {"dvae", "vqgan"}), ConfigError,
                    "recipe.yaml:2:7: kind: 'vqgn' is not allowed, expected one of 'dvae' 'vqgan'");
  EXPECT_EQ(peek_choice(ConfigSource::from_string("model: {}\n"), "kind", "dvae", {"dvae", "vqgan"}), "dvae");
  // Once the kind is chosen, binding stays strict: a dVAE key in a VQGAN recipe is refused.
  EXPECT_THROW_WITH(
      load_config<train::VqganTrainConfig>(ConfigSource::from_string("kind: vqgan\nmodel: {hidden: 8}\n", "r.yaml")),
      ConfigError, "r.yaml:2:9: unknown key 'model.hidden'");
}

}  // namespace
}  // namespace dalle
