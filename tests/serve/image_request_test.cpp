#include "serve/image_request.h"

#include "serve/api_error.h"
#include "test_support.h"

namespace dalle::serve {
namespace {

// The demo model: 64x64 images, 128x128 with super-resolution, CLIP reranks 16 candidates.
ServedModel demo_model() {
  return {.id = "fashion-compose", .plain_size = 64, .superres_size = 128, .has_clip = true,
          .default_candidates = 16, .max_n = 4, .max_candidates = 32, .max_prompt_length = 40};
}

// The ApiError `body` gives: its status, param and code.
void expect_refused(const std::string& body, int status, const std::string& param, const std::string& code,
                    const ServedModel& model = demo_model()) {
  try {
    read_image_request(body, model);
    ADD_FAILURE() << body << " was accepted";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.status(), status) << body << ": " << error.what();
    EXPECT_EQ(error.param(), param) << body << ": " << error.what();
    EXPECT_EQ(error.code(), code) << body << ": " << error.what();
  }
}

TEST(ImageRequest, ReadsOpenAisFieldsAndIgnoresUnknownOnes) {
  const auto request = read_image_request(
      R"({"prompt": "a red bag", "n": 2, "size": "64x64", "response_format": "b64_json", "user": "u1",
          "model": "fashion-compose", "quality": "hd", "style": "vivid", "stream": null})",
      demo_model());
  EXPECT_EQ(request.prompt, "a red bag");
  EXPECT_EQ(request.n, 2);
  EXPECT_FALSE(request.superres);
  EXPECT_EQ(request.image_size(demo_model()), 64);
  EXPECT_EQ(request.response_format, "b64_json");
  EXPECT_EQ(request.user, "u1");
  EXPECT_EQ(request.candidates, 16) << "the pipeline's";
  EXPECT_FALSE(request.seed.has_value());

  const auto plain = read_image_request(R"({"prompt": "a red bag", "n": null})", demo_model());
  EXPECT_EQ(plain.n, 1);
  EXPECT_EQ(plain.response_format, "url") << "OpenAI's default";
  EXPECT_TRUE(plain.superres) << "the model's full size";
}

TEST(ImageRequest, PartialImagesArePerReturnedImageUnlessEveryCandidateIsAskedFor) {
  auto model = demo_model();
  model.image_tokens = 64;
  const auto openai =
      read_image_request(R"({"prompt": "a red bag", "n": 2, "stream": true, "partial_images": 3})", model);
  EXPECT_EQ(openai.candidates, 16);
  EXPECT_EQ(openai.preview_candidates(), 2) << "one previewed candidate per returned image, not all 16";
  EXPECT_EQ(openai.preview_every(model), 16) << "after 16, 32 and 48 of 64 tokens";
  const auto every = read_image_request(R"({"prompt": "a red bag", "n": 2, "stream": true, "partial_images": 3,
                                             "partial_images_of_every_candidate": true})",
                                        model);
  EXPECT_EQ(every.preview_candidates(), 0) << "0: all of them";
  expect_refused(R"({"prompt": "a red bag", "stream": true, "partial_images": 1,
                     "partial_images_of_every_candidate": 1})",
                 400, "partial_images_of_every_candidate", "invalid_type");
}

TEST(ImageRequest, ReadsTheFrameworksOwnFields) {
  const auto request = read_image_request(
      R"({"prompt": "a red bag", "n": 3, "seed": 9007199254740993, "candidates": 3, "guidance_scale": 2,
          "top_k": 20, "top_p": 0.9, "temperature": 0.8, "superres": false})",
      demo_model());
  EXPECT_EQ(request.seed, 9007199254740993);
  EXPECT_EQ(request.candidates, 3);
  EXPECT_EQ(request.guidance_scale, 2.0);
  EXPECT_EQ(request.top_k, 20);
  EXPECT_EQ(request.top_p, 0.9);
  EXPECT_EQ(request.temperature, 0.8);
  EXPECT_FALSE(request.superres);

  generate::PromptRequest defaults{.prompt = "x", .stream_index = 5, .candidates = 16, .keep = 2,
                                   .sampling = {.guidance_scale = 1.5, .seed = 0},
                                   .schedule = {.top_k = {4, 8}, .top_p = {1.0, 1.0}}};
  const auto prompt = to_prompt_request(request, defaults, 77);
  EXPECT_EQ(prompt.prompt, "a red bag");
  EXPECT_EQ(prompt.stream_index, 0) << "as dalle-generate draws one prompt";
  EXPECT_EQ(prompt.candidates, 3);
  EXPECT_EQ(prompt.keep, 3);
  EXPECT_EQ(prompt.sampling.seed, 9007199254740993);
  EXPECT_EQ(prompt.sampling.top_k, 20);
  EXPECT_EQ(prompt.schedule.stages(), 0) << "a filter given replaces the schedule";
  EXPECT_FALSE(prompt.superres);

  const auto seedless = to_prompt_request(read_image_request(R"({"prompt": "a"})", demo_model()), defaults, 77);
  EXPECT_EQ(seedless.sampling.seed, 77);
  EXPECT_EQ(seedless.sampling.guidance_scale, 1.5) << "the pipeline's";
  EXPECT_EQ(seedless.schedule.stages(), 2);
  EXPECT_EQ(seedless.keep, 1);
}

TEST(ImageRequest, AdaptersAreNamesWithWeightsOrNamesAlone) {
  auto model = demo_model();
  model.adapters = {"sneaker", "style"};
  const auto weighted = read_image_request(R"({"prompt": "a", "adapters": {"style": -0.5, "sneaker": 2}})", model);
  // In the object's order as parsed; Pipeline::prepare puts them in the server's order.
  EXPECT_EQ(weighted.adapters, (std::vector<generate::AdapterChoice>{{"sneaker", 2.0}, {"style", -0.5}}));
  const auto named = read_image_request(R"({"prompt": "a", "adapters": ["style"]})", model);
  EXPECT_EQ(named.adapters, (std::vector<generate::AdapterChoice>{{"style", 1.0}}));
  EXPECT_EQ(to_prompt_request(named, {}, 1).adapters, named.adapters);
  EXPECT_TRUE(read_image_request(R"({"prompt": "a", "adapters": null})", model).adapters.empty());

  expect_refused(R"({"prompt": "a", "adapters": {"cartoon": 1}})", 400, "adapters", "invalid_value", model);
  expect_refused(R"({"prompt": "a", "adapters": ["sneaker", "sneaker"]})", 400, "adapters", "invalid_value", model);
  expect_refused(R"({"prompt": "a", "adapters": "sneaker"})", 400, "adapters", "invalid_type", model);
  expect_refused(R"({"prompt": "a", "adapters": [1]})", 400, "adapters", "invalid_type", model);
  expect_refused(R"({"prompt": "a", "adapters": {"sneaker": "1"}})", 400, "adapters.sneaker", "invalid_type", model);
  expect_refused(R"({"prompt": "a", "adapters": {"sneaker": 10.5}})", 400, "adapters.sneaker", "invalid_value",
                 model);
  expect_refused(R"({"prompt": "a", "adapters": ["sneaker"]})", 400, "adapters", "invalid_value");  // has none
}

TEST(ImageRequest, RefusesWhatIsMalformedMistypedOrOutOfRange) {
  expect_refused("{\"prompt\": ", 400, "", "invalid_json");
  expect_refused("[1, 2]", 400, "", "invalid_json");
  expect_refused(std::string(100, '[') + std::string(100, ']'), 400, "", "invalid_json");
  expect_refused("{\"prompt\": \"a\xff\"}", 400, "", "invalid_json");
  expect_refused(R"({"n": 1})", 400, "prompt", "missing_required_parameter");
  expect_refused(R"({"prompt": 7})", 400, "prompt", "invalid_type");
  expect_refused(R"({"prompt": "   "})", 400, "prompt", "invalid_value");
  expect_refused(R"({"prompt": "a prompt well beyond forty characters, which is this model's limit"})", 400, "prompt",
                 "string_above_max_length");
  expect_refused(R"({"prompt": "a", "n": "2"})", 400, "n", "invalid_type");
  expect_refused(R"({"prompt": "a", "n": 2.5})", 400, "n", "invalid_type");
  expect_refused(R"({"prompt": "a", "n": true})", 400, "n", "invalid_type");
  expect_refused(R"({"prompt": "a", "n": 0})", 400, "n", "invalid_value");
  expect_refused(R"({"prompt": "a", "n": 5})", 400, "n", "invalid_value");
  expect_refused(R"({"prompt": "a", "n": 100000000000000000000})", 400, "n", "invalid_type");
  expect_refused(R"({"prompt": "a", "n": 18446744073709551615})", 400, "n", "invalid_value");
  expect_refused(R"({"prompt": "a", "size": "1024x1024"})", 400, "size", "invalid_value");
  expect_refused(R"({"prompt": "a", "size": 64})", 400, "size", "invalid_type");
  expect_refused(R"({"prompt": "a", "size": "64x64", "superres": true})", 400, "superres", "invalid_value");
  expect_refused(R"({"prompt": "a", "response_format": "png"})", 400, "response_format", "invalid_value");
  expect_refused(R"({"prompt": "a", "model": "dall-e-3"})", 404, "model", "model_not_found");
  expect_refused(R"({"prompt": "a", "model": 3})", 400, "model", "invalid_type");
  expect_refused(R"({"prompt": "a", "user": []})", 400, "user", "invalid_type");
  expect_refused(R"({"prompt": "a", "seed": -1})", 400, "seed", "invalid_value");
  expect_refused(R"({"prompt": "a", "n": 3, "candidates": 2})", 400, "candidates", "invalid_value");
  expect_refused(R"({"prompt": "a", "candidates": 33})", 400, "candidates", "invalid_value");
  expect_refused(R"({"prompt": "a", "guidance_scale": "high"})", 400, "guidance_scale", "invalid_type");
  expect_refused(R"({"prompt": "a", "top_p": 0})", 400, "top_p", "invalid_value");
  expect_refused(R"({"prompt": "a", "temperature": 0})", 400, "temperature", "invalid_value");
  expect_refused(R"({"prompt": "a", "superres": "yes"})", 400, "superres", "invalid_type");

  auto plain = demo_model();
  plain.superres_size = 0;
  plain.has_clip = false;
  expect_refused(R"({"prompt": "a", "superres": true})", 400, "superres", "invalid_value", plain);
  expect_refused(R"({"prompt": "a", "size": "128x128"})", 400, "size", "invalid_value", plain);
  expect_refused(R"({"prompt": "a", "n": 2, "candidates": 4})", 400, "candidates", "invalid_value", plain);
  EXPECT_EQ(read_image_request(R"({"prompt": "a", "n": 2})", plain).candidates, 2) << "without CLIP, n";
}

TEST(ImageRequest, ErrorsHaveOpenAisShape) {
  EXPECT_EQ(ApiError(404, "no such model", "model", "model_not_found").json(),
            R"({"error":{"code":"model_not_found","message":"no such model","param":"model","type":"invalid_request_error"}})");
  EXPECT_EQ(ApiError(504, "too slow").json(),
            R"({"error":{"code":null,"message":"too slow","param":null,"type":"server_error"}})");
}

}  // namespace
}  // namespace dalle::serve
