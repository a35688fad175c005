#pragma once
// The body of POST /v1/images/generations as OpenAI's clients send it, read and checked:
// OpenAI's fields (prompt, n, size, response_format, stream, partial_images, user, model;
// others ignored, as a client may send fields of newer models) and the framework's own (seed, candidates,
// guidance_scale, top_k, top_p, temperature, superres, adapters). Whatever is wrong is an ApiError
// naming the field, before the request costs the model anything.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dalle/generate/pipeline.h"

namespace dalle::serve {

// What a request is checked against: the model served and the server's limits.
struct ServedModel {
  std::string id;                  // what `model` must be, when given
  int64_t plain_size = 0;          // the side of the images without super-resolution
  int64_t superres_size = 0;       // and with it (0: the pipeline has none)
  int64_t image_tokens = 0;        // tokens drawn per image
  bool has_clip = false;           // whether candidates beyond n can be reranked away
  int64_t default_candidates = 1;  // the pipeline config's candidates
  int64_t max_n = 4;
  int64_t max_candidates = 64;
  int64_t max_prompt_length = 1000;  // characters
  std::vector<std::string> adapters;  // the named adapters a request may choose
};

// The weights a request may give an adapter: beyond them a low-rank change swamps the model.
inline constexpr double kMaxAdapterWeight = 10;

struct ImageRequest {
  std::string prompt;
  int64_t n = 1;
  std::string response_format = "url";  // or b64_json; OpenAI's default is url
  std::string user;
  bool superres = false;   // from `superres`, else from `size`, else whether the model has it
  int64_t candidates = 1;  // from `candidates`, else the pipeline's (at least n; n without CLIP)
  std::optional<int64_t> seed;
  std::optional<double> guidance_scale, temperature, top_p;
  std::optional<int64_t> top_k;
  bool stream = false;         // answer as server-sent events
  int64_t partial_images = 0;  // previews streamed per returned image while it is drawn (0-3)
  // Ours: previews of every candidate, not only of the first n (`partial_images_of_every_candidate`).
  bool partial_images_of_every_candidate = false;
  // Named adapters folded into the prior for it: {"NAME": WEIGHT, ...} or ["NAME", ...] (weight 1).
  std::vector<generate::AdapterChoice> adapters;

  // Throws ApiError 400 for partial_images without stream, which a synchronous answer
  // cannot carry (a job can: GET shows its latest ones).
  void check_partial_images_streamed() const;
  // The image positions between previews that make `partial_images` of them (0: none).
  int64_t preview_every(const ServedModel& model) const;
  // The candidates previewed: the first n, one per returned image (OpenAI's count of
  // partial images), or all of them (0) on request.
  int64_t preview_candidates() const { return partial_images_of_every_candidate ? 0 : n; }

  int64_t image_size(const ServedModel& model) const { return superres ? model.superres_size : model.plain_size; }
};

// A square size as OpenAI names it: "256x256".
std::string side_by_side(int64_t side);

// Reads `body` (JSON); throws ApiError: 400 for malformed JSON, a missing prompt, a wrong
// type or a value out of range, 404 (model_not_found) for another model.
ImageRequest read_image_request(std::string_view body, const ServedModel& model);

// The pipeline request for `request`: `defaults` (the config's, as Pipeline::prepare hands
// them to its settings) with the client's fields; a filter given replaces the config's
// schedule, as dalle-generate's --top-k does. Without `seed` the request draws with
// `random_seed`.
generate::PromptRequest to_prompt_request(const ImageRequest& request, generate::PromptRequest defaults,
                                          int64_t random_seed);

}  // namespace dalle::serve
