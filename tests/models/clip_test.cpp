#include "dalle/models/clip.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/clip_rerank.h"
#include "dalle/models/trained.h"
#include "dalle/text/clip_tokenizer.h"
#include "dalle/text/yttm_tokenizer.h"
#include "test_support.h"

namespace dalle::models {
namespace {

using testing::relative_error;

// The sizes make_clip_fixture.py builds open_clip's CLIP with.
ClipConfig fixture_config(const std::string& activation = "gelu", const std::string& pooling = "argmax") {
  return {.embed_dim = 16, .image_size = 32, .patch_size = 8, .vision_width = 48, .vision_layers = 2, .vision_heads = 6,
          .context_length = 12, .vocab_size = 64, .text_width = 32, .text_layers = 3, .text_heads = 4, .mlp_ratio = 4.0,
          .activation = activation, .text_pooling = pooling, .eos_id = 3};
}

// A checkpoint's config.yaml: the config's YAML (lists included) under `model`.
std::string yaml_of(ClipConfig config) {
  std::string text = "kind: clip\nmodel:\n", line;
  std::istringstream lines(config_to_yaml(visit_of(config)));
  while (std::getline(lines, line)) text += "  " + line + "\n";
  return text;
}

class ClipParity : public ::testing::Test {
 protected:
  void SetUp() override {
    weights_ = testing::dequantized_weights(fixture_.tensors);
  }
  Clip model(const std::string& activation = "gelu", const std::string& pooling = "argmax") const {
    Clip clip(fixture_config(activation, pooling));
    io::load_state_dict(*clip, weights_, "clip_parity.safetensors");
    clip->eval();
    return clip;
  }
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("clip_parity.safetensors"));
  io::TensorMap weights_;
};

TEST_F(ClipParity, ParameterNamesAndShapesAreOpenClips) {
  const auto ours = io::state_dict(*model());
  ASSERT_EQ(ours.size(), weights_.size());
  for (const auto& [name, tensor] : weights_) {
    ASSERT_TRUE(ours.count(name)) << name;
    EXPECT_EQ(ours.at(name).sizes(), tensor.sizes()) << name;
  }
  for (const char* name :
       {"visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre.weight",
        "visual.transformer.resblocks.1.attn.in_proj_weight", "visual.transformer.resblocks.1.attn.in_proj_bias",
        "visual.transformer.resblocks.0.attn.out_proj.bias", "visual.transformer.resblocks.0.mlp.c_fc.weight",
        "visual.transformer.resblocks.0.mlp.c_proj.bias", "visual.ln_post.bias", "visual.proj",
        "token_embedding.weight", "positional_embedding", "transformer.resblocks.2.ln_2.weight", "ln_final.weight",
        "text_projection", "logit_scale"}) {
    EXPECT_TRUE(ours.count(name)) << name;
  }
  EXPECT_FALSE(ours.count("visual.conv1.bias")) << "the patch embedding has no bias";
  EXPECT_EQ(ours.at("logit_scale").dim(), 0);
}

TEST_F(ClipParity, ImageFeaturesMatchOpenClip) {
  torch::NoGradGuard no_grad;
  for (const char* activation : {"gelu", "quick_gelu"}) {
    const auto features = model(activation)->encode_image(at("pixels"));
    const auto& expected = at(std::string(activation) + ".image_features");
    ASSERT_EQ(features.sizes(), expected.sizes()) << activation;
    EXPECT_LT(relative_error(features, expected), 1e-4) << activation;
  }
  // The two activations give different features: the test would notice a swapped activation.
  EXPECT_GT(relative_error(at("gelu.image_features"), at("quick_gelu.image_features")), 1e-3);
}

TEST_F(ClipParity, TextFeaturesMatchOpenClip) {
  torch::NoGradGuard no_grad;
  for (const char* activation : {"gelu", "quick_gelu"}) {
    const auto features = model(activation)->encode_text(at("tokens"));
    const auto& expected = at(std::string(activation) + ".text_features");
    ASSERT_EQ(features.sizes(), expected.sizes()) << activation;
    EXPECT_LT(relative_error(features, expected), 1e-4) << activation;
  }
  EXPECT_GT(relative_error(at("gelu.text_features"), at("quick_gelu.text_features")), 1e-3);
}

TEST_F(ClipParity, LogitsMatchOpenClip) {
  torch::NoGradGuard no_grad;
  for (const char* activation : {"gelu", "quick_gelu"}) {
    const auto logits = model(activation)->logits(at("pixels"), at("tokens"));
    const std::string prefix = activation;
    ASSERT_EQ(logits.per_image.sizes(), (std::vector<int64_t>{6, 4}));
    EXPECT_LT(relative_error(logits.per_image, at(prefix + ".logits_per_image")), 1e-4) << activation;
    EXPECT_LT(relative_error(logits.per_text, at(prefix + ".logits_per_text")), 1e-4) << activation;
  }
}

TEST_F(ClipParity, EosPoolingMatchesOpenClip) {
  torch::NoGradGuard no_grad;
  auto eos = model("gelu", "eos");
  const auto& tokens = at("tokens_eos");
  const auto features = eos->encode_text(tokens);
  EXPECT_LT(relative_error(features, at("eos.text_features")), 1e-4);
  // Here the end of text is not the largest id: argmax pooling reads another position.
  EXPECT_TRUE(torch::equal(eos->pooling_positions(tokens), torch::tensor({2, 6, 8, 11})));
  auto argmax = model("gelu", "argmax");
  EXPECT_FALSE(torch::equal(argmax->pooling_positions(tokens), eos->pooling_positions(tokens)));
  EXPECT_GT(relative_error(argmax->encode_text(tokens), at("eos.text_features")), 1e-2);
  // Where the end of text is the largest id, the two poolings agree.
  EXPECT_TRUE(torch::allclose(eos->pooling_positions(at("tokens").clone().masked_fill_(at("tokens") == 63, 3)),
                              argmax->pooling_positions(at("tokens"))));
}

TEST_F(ClipParity, PreprocessingMatchesOpenClipsEvalTransform) {
  // 40x36 images: resized to 35x32, then cropped from row round(1.5) = 2.
  const auto pixels = clip_preprocess(at("images"), 32);
  ASSERT_EQ(pixels.sizes(), at("pixels").sizes());
  EXPECT_LT(relative_error(pixels, at("pixels")), 1e-5);
  // One image without a batch dimension gives the same.
  EXPECT_LT(relative_error(clip_preprocess(at("images")[3], 32), at("pixels")[3]), 1e-5);
}

TEST_F(ClipParity, ShorterCaptionsGiveTheSameFeatures) {
  // The causal mask keeps the padding after the end of text from reaching it.
  torch::NoGradGuard no_grad;
  auto clip = model();
  const auto full = clip->encode_text(at("tokens"));
  const auto prefix = clip->encode_text(at("tokens").slice(0, 1, 2).slice(1, 0, 3));  // row 1 ends at 2
  EXPECT_LT(relative_error(prefix[0], full[1]), 1e-5);
}

TEST_F(ClipParity, NormalizedFeaturesAreUnitVectors) {
  torch::NoGradGuard no_grad;
  auto clip = model();
  const auto images = clip->encode_image(at("pixels"), /*normalize=*/true);
  const auto texts = clip->encode_text(at("tokens"), /*normalize=*/true);
  EXPECT_LT((images.norm(2, 1) - 1).abs().max().item<double>(), 1e-5);
  EXPECT_LT((texts.norm(2, 1) - 1).abs().max().item<double>(), 1e-5);
  const auto& raw = at("gelu.image_features");
  EXPECT_LT(relative_error(images, raw / raw.norm(2, 1, true)), 1e-4);
}

TEST_F(ClipParity, RerankEqualsTheArgsortOfOpenClipsLogits) {
  auto clip = model();
  const auto& logits = at("gelu.logits_per_text");  // [4 captions, 6 images]
  for (int64_t caption = 0; caption < 4; ++caption) {
    // Raw 40x36 images, preprocessed inside, in batches of 4 and 2.
    const auto result = clip_rerank(clip, at("images"), at("tokens")[caption], /*top_k=*/3, /*batch_size=*/4);
    const auto expected = std::get<1>(logits[caption].sort(/*stable=*/true, 0, /*descending=*/true));
    ASSERT_EQ(result.indices.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(result.indices[i], expected[static_cast<int64_t>(i)].item<int64_t>()) << caption << " " << i;
      EXPECT_NEAR(result.scores[i], logits[caption][result.indices[i]].item<double>(), 1e-4) << caption;
    }
    EXPECT_GE(result.scores[0], result.scores[1]);
    EXPECT_GE(result.scores[1], result.scores[2]);
  }
  // The batch size does not change the scores.
  const auto one = clip_scores(clip, at("images"), at("tokens")[0], 1);
  const auto all = clip_scores(clip, at("images"), at("tokens").slice(0, 0, 1), 64);
  EXPECT_LT(relative_error(one, all), 1e-5);
  EXPECT_LT(relative_error(all, logits[0]), 1e-4);
}

TEST_F(ClipParity, MissingExtraOrMisshapenTensorsAreRefusedByName) {
  auto clip = model();
  auto missing = weights_;
  missing.erase("visual.transformer.resblocks.1.attn.in_proj_bias");
  EXPECT_THROW_WITH(io::load_state_dict(*clip, missing, "open_clip.safetensors"), Error, "open_clip.safetensors",
                    "missing: visual.transformer.resblocks.1.attn.in_proj_bias");
  auto extra = weights_;
  extra.emplace("visual.conv1.bias", torch::zeros({48}));
  EXPECT_THROW_WITH(io::load_state_dict(*clip, extra), Error, "unexpected: visual.conv1.bias");
  auto config = fixture_config();
  config.context_length = 16;
  Clip longer(config);
  EXPECT_THROW_WITH(io::load_state_dict(*longer, weights_), Error,
                    "misshapen: positional_embedding [12, 32] where the model has [16, 32]");
  config = fixture_config();
  config.text_layers = 2;
  Clip shallower(config);
  EXPECT_THROW_WITH(io::load_state_dict(*shallower, weights_), Error, "unexpected: transformer.resblocks.2.");
  // Nothing was copied by the refused loads.
  EXPECT_TRUE(torch::equal(clip->logit_scale, weights_.at("logit_scale")));
}

TEST_F(ClipParity, CheckpointDirectoryLoadsByName) {
  testing::ScratchDir scratch;
  io::save_checkpoint(scratch / "clip", {yaml_of(fixture_config("quick_gelu")), weights_, {}, {}});
  auto loaded = models::load_trained_clip(scratch / "clip");
  EXPECT_EQ(loaded->config().activation, "quick_gelu");
  EXPECT_FALSE(loaded->is_training());
  torch::NoGradGuard no_grad;
  EXPECT_LT(relative_error(loaded->encode_image(at("pixels")), at("quick_gelu.image_features")), 1e-4);
  // A config whose sizes do not fit the weights is refused with the tensor's name.
  auto config = fixture_config();
  config.vocab_size = 65;
  io::save_checkpoint(scratch / "wrong", {yaml_of(config), weights_, {}, {}});
  EXPECT_THROW_WITH(models::load_trained_clip(scratch / "wrong"), Error, "wrong/model.safetensors",
                    "misshapen: token_embedding.weight [64, 32] where the model has [65, 32]");
  io::save_checkpoint(scratch / "typo", {"kind: clip\nmodel:\n  embed_dims: 16\n", weights_, {}, {}});
  EXPECT_THROW_WITH(models::load_trained_clip(scratch / "typo"), ConfigError, "unknown key 'model.embed_dims'");
}

// The sizes make_ruclip_fixture.py builds ruclip's CLIP with (OpenAI CLIP's layout; its
// vision heads are vision_width / 64, one here), and what ruclip reads: QuickGELU, the
// feature at the end of text (id 3), its processor's crop-then-resize.
ClipConfig ruclip_config() {
  return {.embed_dim = 16, .image_size = 32, .patch_size = 8, .vision_width = 64, .vision_layers = 2, .vision_heads = 1,
          .context_length = 16, .vocab_size = 600, .text_width = 32, .text_layers = 2, .text_heads = 4,
          .mlp_ratio = 4.0, .activation = "quick_gelu", .text_pooling = "eos", .eos_id = 3, .preprocess = "ruclip"};
}

class RuclipParity : public ::testing::Test {
 protected:
  void SetUp() override { weights_ = testing::dequantized_weights(fixture_.tensors); }
  Clip model(ClipConfig config = ruclip_config()) const {
    Clip clip(config);
    io::load_state_dict(*clip, weights_, "ruclip_parity.safetensors");
    clip->eval();
    return clip;
  }
  const torch::Tensor& at(const std::string& name) const { return fixture_.tensors.at(name); }
  // The fixture's 8-bit images ("square" 24x24, "tall" 43x36) in [0, 1].
  torch::Tensor images(const std::string& kind) const { return at("images_" + kind).to(torch::kFloat32) / 255.0; }
  std::vector<std::string> strings(const std::string& key) const {
    return nlohmann::json::parse(fixture_.metadata.at(key)).get<std::vector<std::string>>();
  }
  static std::vector<int64_t> row(const torch::Tensor& tokens, int64_t i) {
    const auto r = tokens[i].contiguous();
    return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
  }

  io::Safetensors fixture_ = io::read_safetensors(testing::fixture_path("ruclip_parity.safetensors"));
  io::TensorMap weights_;
  text::YttmTokenizer tokenizer_ = text::YttmTokenizer::load(testing::fixture_path("yttm_bpe.model"));
};

TEST_F(RuclipParity, StateDictLoadsByNameAtTheFixturesSizes) {
  const auto ours = io::state_dict(*model());
  ASSERT_EQ(ours.size(), weights_.size());
  for (const auto& [name, tensor] : weights_) {
    ASSERT_TRUE(ours.count(name)) << name;
    EXPECT_EQ(ours.at(name).sizes(), tensor.sizes()) << name;
  }
  const auto& meta = fixture_.metadata;
  const auto config = ruclip_config();
  EXPECT_EQ(meta.at("vision_heads"), std::to_string(config.vision_heads));
  EXPECT_EQ(meta.at("transformer_heads"), std::to_string(config.text_heads));
  EXPECT_EQ(meta.at("image_resolution"), std::to_string(config.image_size));
  EXPECT_EQ(meta.at("context_length"), std::to_string(config.context_length));
  EXPECT_EQ(meta.at("eos_id"), std::to_string(config.eos_id));
}

TEST_F(RuclipParity, ImageFeaturesMatchRuclip) {
  torch::NoGradGuard no_grad;
  auto clip = model();
  for (const std::string kind : {"square", "tall"}) {
    // The processor's pixels of PIL images, and of float tensors.
    EXPECT_LT(relative_error(clip->encode_image(at("pixels_" + kind)), at(kind + ".image_features")), 1e-4) << kind;
    EXPECT_LT(relative_error(clip->encode_image(at("tensor_pixels_" + kind)), at(kind + ".tensor_image_features")),
              1e-4)
        << kind;
  }
}

TEST_F(RuclipParity, TextFeaturesPoolAtTheEndOfTextAsRuclip) {
  torch::NoGradGuard no_grad;
  auto clip = model();
  const auto& tokens = at("tokens");
  EXPECT_LT(relative_error(clip->encode_text(tokens), at("text_features")), 1e-4);
  // BOS, the ids, EOS: the last caption fills the context, cut to leave its EOS last.
  EXPECT_TRUE(torch::equal(clip->pooling_positions(tokens), torch::tensor({4, 4, 7, 15})));
  // Its EOS (3) is not the largest id: CLIP's argmax pooling would read other positions.
  auto config = ruclip_config();
  config.text_pooling = "argmax";
  EXPECT_GT(relative_error(model(config)->encode_text(tokens), at("text_features")), 1e-2);
}

TEST_F(RuclipParity, LogitsMatchRuclip) {
  torch::NoGradGuard no_grad;
  auto clip = model();
  for (const std::string kind : {"square", "tall"}) {
    const auto logits = clip->logits(at("pixels_" + kind), at("tokens"));
    ASSERT_EQ(logits.per_image.sizes(), (std::vector<int64_t>{3, 4}));
    EXPECT_LT(relative_error(logits.per_image, at(kind + ".logits_per_image")), 1e-4) << kind;
    EXPECT_LT(relative_error(logits.per_text, at(kind + ".logits_per_text")), 1e-4) << kind;
  }
}

TEST_F(RuclipParity, PreprocessingIsRuclipsProcessor) {
  const auto config = ruclip_config();
  const auto stds = torch::tensor(config.image_std).to(torch::kFloat32).view({1, 3, 1, 1});
  for (const std::string kind : {"square", "tall"}) {
    const auto pixels = clip_preprocess(images(kind), config);
    ASSERT_EQ(pixels.sizes(), (std::vector<int64_t>{3, 3, 32, 32})) << kind;
    // torchvision's tensor path exactly; within one 8-bit level of the PIL path, which
    // rounds its resized pixels to 8 bits.
    EXPECT_LT(relative_error(pixels, at("tensor_pixels_" + kind)), 1e-5) << kind;
    EXPECT_LE(((pixels - at("pixels_" + kind)) * stds).abs().max().item<double>(), 1.0 / 255 + 1e-5) << kind;
  }
  // 43x36: the square from row (43 - 36) // 2 = 3; open_clip's transform takes row 4 (and
  // resizes first, bicubic), which is another picture.
  EXPECT_GT(relative_error(clip_preprocess(images("tall"), 32), at("tensor_pixels_tall")), 1e-2);
  EXPECT_LT(relative_error(clip_preprocess(images("tall")[1], config), at("tensor_pixels_tall")[1]), 1e-5);
}

TEST_F(RuclipParity, YttmTokenizerGivesRuclipsIds) {
  const auto captions = strings("captions");
  ASSERT_EQ(static_cast<int64_t>(captions.size()), at("tokens").size(0));
  for (size_t i = 0; i < captions.size(); ++i) {
    EXPECT_EQ(tokenizer_.ruclip_ids(captions[i], 16), row(at("tokens"), static_cast<int64_t>(i))) << captions[i];
  }
  // The long caption was cut to 14 ids between BOS and EOS.
  EXPECT_GT(tokenizer_.encode(captions.back()).size(), 14u);
  // The prompt in each of ruclip Predictor's templates, lower-cased and stripped first.
  const auto templates = strings("templates");
  const std::string prompt = fixture_.metadata.at("prompt");
  ASSERT_EQ(static_cast<int64_t>(templates.size()), at("cherry.template_tokens").size(0));
  for (size_t i = 0; i < templates.size(); ++i) {
    EXPECT_EQ(tokenizer_.ruclip_ids(text::fill_clip_template(templates[i], prompt), 16),
              row(at("cherry.template_tokens"), static_cast<int64_t>(i)))
        << templates[i];
  }
  // Not stripped, the prompt's leading no-break space would be ids of its own.
  EXPECT_NE(tokenizer_.ruclip_ids(prompt, 16), row(at("cherry.template_tokens"), 0));
  EXPECT_THROW_WITH(tokenizer_.ruclip_ids("a", 1), Error, "context_length 1");
}

TEST_F(RuclipParity, TemplatesRerankAsRudallesCherryPick) {
  auto clip = model();
  const auto& tokens = at("cherry.template_tokens");  // [6 templates, 16]
  const double scale = std::exp(clip->logit_scale.item<double>());
  // cherry_pick_by_ruclip's scores are cosines; ours are scaled by exp(logit_scale).
  const auto scores =
      torch::cat({clip_scores(clip, images("square"), tokens, 2), clip_scores(clip, images("tall"), tokens, 2)});
  EXPECT_LT(relative_error(scores / scale, at("cherry.scores")), 1e-4);
  // One rendering alone scores otherwise: the mean over the templates is what ruclip ranks by.
  const auto single =
      torch::cat({clip_scores(clip, images("square"), tokens[0]), clip_scores(clip, images("tall"), tokens[0])});
  EXPECT_GT(relative_error(single / scale, at("cherry.scores")), 1e-3);
  // A checkpoint directory keeps the preprocessing: loaded, it scores the same.
  testing::ScratchDir scratch;
  io::save_checkpoint(scratch / "ruclip", {yaml_of(ruclip_config()), weights_, {}, {}});
  auto loaded = load_trained_clip(scratch / "ruclip");
  EXPECT_EQ(loaded->config().preprocess, "ruclip");
  EXPECT_LT(relative_error(clip_scores(loaded, images("tall"), tokens) / scale, at("cherry.scores").slice(0, 3)), 1e-4);
}

TEST(ClipTemplate, FillsThePromptLowerCasedAndStripped) {
  EXPECT_EQ(text::fill_clip_template("фото с {}", " \u00a0Красная СУМКА\t"), "фото с красная сумка");
  EXPECT_EQ(text::fill_clip_template("{}", "A Red Bag"), "a red bag");
  EXPECT_EQ(text::fill_clip_template("{} and more", "X"), "x and more");
  EXPECT_THROW_WITH(text::fill_clip_template("no slot", "x"), Error, "'no slot'", "{} once");
  EXPECT_THROW_WITH(text::fill_clip_template("{} {}", "x"), Error, "{} once");
  EXPECT_THROW_WITH(text::fill_clip_template("{0} {}", "x"), Error, "no other brace");
}

TEST(Clip, DefaultConfigIsViTB32) {
  // open_clip.create_model('ViT-B-32').state_dict(): 302 tensors, 151,277,313 numbers.
  Clip clip(ClipConfig{});
  const auto tensors = io::state_dict(*clip);
  EXPECT_EQ(tensors.size(), 302u);
  int64_t numbers = 0;
  for (const auto& [name, tensor] : tensors) numbers += tensor.numel();
  EXPECT_EQ(numbers, 151'277'313);
  EXPECT_EQ(tensors.at("visual.positional_embedding").sizes(), (std::vector<int64_t>{50, 768}));
  EXPECT_EQ(tensors.at("visual.conv1.weight").sizes(), (std::vector<int64_t>{768, 3, 32, 32}));
  EXPECT_EQ(tensors.at("text_projection").sizes(), (std::vector<int64_t>{512, 512}));
  EXPECT_EQ(tensors.at("transformer.resblocks.11.mlp.c_fc.weight").sizes(), (std::vector<int64_t>{2048, 512}));
  EXPECT_NEAR(clip->logit_scale.item<double>(), std::log(1 / 0.07), 1e-6);
}

ClipConfig tiny_config() {
  auto config = fixture_config();
  config.vision_layers = 1;
  config.text_layers = 1;
  return config;
}

TEST(Clip, ShapesFollowTheConfig) {
  torch::manual_seed(0);
  Clip clip(tiny_config());
  torch::NoGradGuard no_grad;
  const auto images = clip->encode_image(torch::randn({5, 3, 32, 32}));
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{5, 16}));
  const auto tokens = torch::randint(4, 63, {3, 7}, torch::kInt64);
  tokens.select(1, 6).fill_(63);
  const auto texts = clip->encode_text(tokens);
  EXPECT_EQ(texts.sizes(), (std::vector<int64_t>{3, 16}));
  const auto logits = clip->logits_from_features(images, texts);
  EXPECT_EQ(logits.per_image.sizes(), (std::vector<int64_t>{5, 3}));
  EXPECT_TRUE(torch::equal(logits.per_text, logits.per_image.t()));
  // |logits| <= exp(logit_scale): they are scaled cosines.
  EXPECT_LE(logits.per_image.abs().max().item<double>(), std::exp(tiny_config().init_logit_scale) + 1e-4);
  EXPECT_EQ(clip_preprocess(torch::rand({2, 3, 50, 64}), 32).sizes(), (std::vector<int64_t>{2, 3, 32, 32}));
}

TEST(Clip, BadInputIsRefusedClearly) {
  Clip clip(tiny_config());
  torch::NoGradGuard no_grad;
  EXPECT_THROW_WITH(clip->encode_image(torch::rand({1, 3, 40, 40})), Error, "[batch, 3, 32, 32]", "[1, 3, 40, 40]",
                    "clip_preprocess");
  EXPECT_THROW_WITH(clip->encode_text(torch::full({1, 13}, 5, torch::kInt64)), Error, "13 tokens",
                    "1 to 12 (context_length)");
  EXPECT_THROW_WITH(clip->encode_text(torch::full({1, 4}, 64, torch::kInt64)), Error, "token id 64",
                    "[0, 64)");
  EXPECT_THROW_WITH(clip->encode_text(torch::zeros({4})), Error, "[batch, length] int64");
  auto config = tiny_config();
  config.text_pooling = "eos";
  Clip eos(config);
  const auto tokens = torch::tensor({{5, 6, 3, 0}, {5, 6, 7, 8}});
  EXPECT_THROW_WITH(eos->encode_text(tokens), Error, "caption 1 has no end-of-text id 3");
  EXPECT_THROW_WITH(clip_preprocess(torch::rand({1, 1, 8, 8}), 32), Error, "[batch, 3, H, W]");
  EXPECT_THROW_WITH(clip_preprocess(torch::zeros({1, 3, 8, 8}, torch::kUInt8), 32), Error, "floating-point",
                    "Byte");
}

TEST(Clip, InconsistentSizesAreRefused) {
  auto config = tiny_config();
  config.image_size = 30;
  EXPECT_THROW_WITH(Clip{config}, Error, "image_size (30) must be a multiple of patch_size (8)");
  config = tiny_config();
  config.vision_heads = 5;
  EXPECT_THROW_WITH(Clip{config}, Error, "vision_width (48) must be a multiple of vision_heads (5)");
  config = tiny_config();
  config.text_heads = 3;
  EXPECT_THROW_WITH(Clip{config}, Error, "text_width (32) must be a multiple of text_heads (3)");
  config = tiny_config();
  config.text_pooling = "eos";
  config.eos_id = 64;
  EXPECT_THROW_WITH(Clip{config}, Error, "eos_id (64) is outside the vocabulary of 64");
  EXPECT_THROW_WITH(load_config<ClipConfig>(ConfigSource::from_string("activation: relu\n", "clip.yaml")),
                    ConfigError, "clip.yaml:1", "activation");
  EXPECT_THROW_WITH(load_config<ClipConfig>(ConfigSource::from_string("text_pooling: mean\n", "clip.yaml")),
                    ConfigError, "text_pooling");
  EXPECT_THROW_WITH(load_config<ClipConfig>(ConfigSource::from_string("preprocess: squash\n", "clip.yaml")),
                    ConfigError, "preprocess");
  config = tiny_config();
  config.image_mean = {0.5, 0.5};
  EXPECT_THROW_WITH(Clip{config}, Error, "image_mean and image_std need 3 values each", "got 2 and 3");
  config = tiny_config();
  config.image_std = {0.2, 0.0, 0.2};
  EXPECT_THROW_WITH(Clip{config}, Error, "image_std values must be positive");
}

TEST(Clip, ContrastiveLossReachesBothTowersAndTheScale) {
  torch::manual_seed(0);
  Clip clip(tiny_config());
  const auto tokens = torch::randint(4, 63, {4, 6}, torch::kInt64);
  tokens.select(1, 5).fill_(63);
  const auto logits = clip->logits(torch::randn({4, 3, 32, 32}), tokens);
  const auto labels = torch::arange(4);
  const auto loss = (torch::nn::functional::cross_entropy(logits.per_image, labels) +
                     torch::nn::functional::cross_entropy(logits.per_text, labels)) / 2;
  loss.backward();
  for (const char* name : {"visual.conv1.weight", "visual.class_embedding", "visual.proj",
                           "visual.transformer.resblocks.0.attn.in_proj_weight", "token_embedding.weight",
                           "positional_embedding", "transformer.resblocks.0.mlp.c_proj.weight", "text_projection",
                           "logit_scale"}) {
    const auto grad = clip->named_parameters()[name].grad();
    ASSERT_TRUE(grad.defined()) << name;
    EXPECT_GT(grad.abs().sum().item<double>(), 0.0) << name;
  }
  // Causal: no gradient reaches the embedding of positions after the pooled end of text.
  EXPECT_EQ(clip->positional_embedding.grad().slice(0, 6).abs().sum().item<double>(), 0.0);
  EXPECT_GT(clip->positional_embedding.grad().slice(0, 0, 6).abs().sum().item<double>(), 0.0);
}

TEST(ClipRerank, TopKIsSortedWithTiesInIndexOrder) {
  const auto scores = torch::tensor({0.5, 2.0, -1.0, 2.0, 0.7});
  auto result = top_k_scores(scores, 3);
  EXPECT_EQ(result.indices, (std::vector<int64_t>{1, 3, 4}));
  EXPECT_EQ(result.scores, (std::vector<double>{2.0, 2.0, static_cast<double>(0.7f)}));
  result = top_k_scores(scores, 10);
  EXPECT_EQ(result.indices, (std::vector<int64_t>{1, 3, 4, 0, 2}));
  EXPECT_THROW_WITH(top_k_scores(scores, 0), Error, "top_k must be positive");
  EXPECT_THROW_WITH(top_k_scores(scores.view({1, 5}), 1), Error, "[N] scores");
}

}  // namespace
}  // namespace dalle::models
