#include "serve/image_request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "dalle/input_limits.h"
#include "serve/api_error.h"

namespace dalle::serve {

namespace {

using nlohmann::json;

// Deeper JSON than a request needs is refused before it is parsed: nesting costs the parser
// memory and time, and no field here nests.
constexpr int kMaxDepth = 16;

bool nested_too_deep(std::string_view body) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : body) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) return true;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return false;
}

json parse_body(std::string_view body) {
  const auto unreadable = ApiError(400,
                                   "We could not parse the JSON body of your request. (HINT: This likely means you "
                                   "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, "
                                   "but what was sent was not valid JSON.)",
                                   "", "invalid_json");
  if (nested_too_deep(body)) throw unreadable;
  auto parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) throw unreadable;
  if (!parsed.is_object()) throw ApiError(400, "The request body must be a JSON object.", "", "invalid_json");
  return parsed;
}

std::string type_name(const json& value) {
  if (value.is_string()) return "a string";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number_integer()) return "an integer";
  if (value.is_number()) return "a decimal";
  if (value.is_array()) return "an array";
  return "an object";
}

ApiError wrong_type(const std::string& name, const std::string& expected, const json& value) {
  return {400, "Invalid type for '" + name + "': expected " + expected + ", but got " + type_name(value) + " instead.",
          name, "invalid_type"};
}

ApiError out_of_range(const std::string& name, const std::string& value, const std::string& range) {
  return {400, "Invalid '" + name + "': " + value + " is out of range; expected " + range + ".", name,
          "invalid_value"};
}

// The field's value, or nothing when it is absent or null (as OpenAI's clients send unset fields).
const json* field(const json& body, const std::string& name) {
  const auto at = body.find(name);
  return at == body.end() || at->is_null() ? nullptr : &*at;
}

std::optional<std::string> string_field(const json& body, const std::string& name) {
  const auto* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_string()) throw wrong_type(name, "a string", *value);
  return value->get<std::string>();
}

std::optional<int64_t> integer_field(const json& body, const std::string& name, int64_t min, int64_t max) {
  const auto* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_number_integer()) throw wrong_type(name, "an integer", *value);
  const auto range = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  if (value->is_number_unsigned() && value->get<uint64_t>() > static_cast<uint64_t>(max)) {
    throw out_of_range(name, value->dump(), range);
  }
  const auto number = value->get<int64_t>();
  if (number < min || number > max) throw out_of_range(name, std::to_string(number), range);
  return number;
}

std::optional<double> number_field(const json& body, const std::string& name, double min, double max) {
  const auto* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_number()) throw wrong_type(name, "a number", *value);
  const auto number = value->get<double>();
  if (!(number >= min && number <= max)) {
    throw out_of_range(name, value->dump(), "a number in [" + json(min).dump() + ", " + json(max).dump() + "]");
  }
  return number;
}

std::optional<bool> bool_field(const json& body, const std::string& name) {
  const auto* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_boolean()) throw wrong_type(name, "a boolean", *value);
  return value->get<bool>();
}

int64_t characters(std::string_view utf8) {
  int64_t count = 0;
  for (const char c : utf8) count += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
  return count;
}

std::string read_prompt(const json& body, const ServedModel& model) {
  const auto prompt = string_field(body, "prompt");
  if (!prompt) throw ApiError(400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter");
  try {
    check_prompt(*prompt, "Invalid 'prompt'");
  } catch (const Error& error) {
    throw ApiError(400, error.what(), "prompt", "invalid_value");
  }
  if (characters(*prompt) > model.max_prompt_length) {
    throw ApiError(400,
                   "Invalid 'prompt': string too long. Expected a string with maximum length " +
                       std::to_string(model.max_prompt_length) + ", but got a string with length " +
                       std::to_string(characters(*prompt)) + " instead.",
                   "prompt", "string_above_max_length");
  }
  return *prompt;
}


// Whether the image is upscaled: `superres` when given, else what `size` names, else yes
// when the model can.
bool read_superres(const json& body, const ServedModel& model) {
  const auto size = string_field(body, "size");
  const auto superres = bool_field(body, "superres");
  if (superres && *superres && model.superres_size == 0) {
    throw ApiError(400, "Invalid 'superres': this model has no super-resolution stage.", "superres", "invalid_value");
  }
  if (!size || *size == "auto") return superres.value_or(model.superres_size > 0);
  const auto sizes = model.superres_size > 0 ? side_by_side(model.superres_size) + " (with superres) or " +
                                                   side_by_side(model.plain_size) + " (without)"
                                             : side_by_side(model.plain_size);
  std::optional<bool> by_size;
  if (model.superres_size > 0 && *size == side_by_side(model.superres_size)) by_size = true;
  if (*size == side_by_side(model.plain_size)) by_size = false;
  if (!by_size) {
    throw ApiError(400, "Invalid 'size': " + excerpt(*size) + " is not a size this model makes; it makes " + sizes +
                            ".", "size", "invalid_value");
  }
  if (superres && *superres != *by_size) {
    throw ApiError(400, "'size' " + *size + " and 'superres' " + (*superres ? "true" : "false") + " disagree; it makes " +
                            sizes + ".", "superres", "invalid_value");
  }
  return *by_size;
}

int64_t read_candidates(const json& body, const ServedModel& model, int64_t n) {
  const auto given = integer_field(body, "candidates", 1, model.max_candidates);
  if (!model.has_clip) {
    if (given && *given != n) {
      throw ApiError(400,
                     "Invalid 'candidates': this model has no CLIP model to choose the best n of more candidates; "
                     "leave candidates out or make it n (" + std::to_string(n) + ").",
                     "candidates", "invalid_value");
    }
    return n;
  }
  if (given && *given < n) {
    throw ApiError(400, "Invalid 'candidates': " + std::to_string(*given) + " is fewer than n (" + std::to_string(n) +
                            "); n of the candidates are returned.", "candidates", "invalid_value");
  }
  return given.value_or(std::min(std::max(model.default_candidates, n), model.max_candidates));
}

ApiError unknown_adapter(const std::string& name, const ServedModel& model) {
  std::string known;
  for (const auto& adapter : model.adapters) {
    if (!known.empty()) known += ", ";
    known += adapter;
  }
  return {400, "Invalid 'adapters': " + excerpt(name) + " is no adapter of this model; " +
                   (known.empty() ? std::string("it has none.") : "it has " + known + " (GET /v1/models)."),
          "adapters", "invalid_value"};
}

// `adapters`: an object of names and weights, or an array of names (weight 1).
std::vector<generate::AdapterChoice> read_adapters(const json& body, const ServedModel& model) {
  const auto* value = field(body, "adapters");
  if (!value) return {};
  if (!value->is_object() && !value->is_array()) {
    throw wrong_type("adapters", "an object of adapter names and weights, or an array of names", *value);
  }
  std::vector<generate::AdapterChoice> choices;
  for (const auto& [key, item] : value->items()) {
    generate::AdapterChoice choice;
    if (value->is_array() && !item.is_string()) throw wrong_type("adapters", "an array of adapter names", item);
    choice.name = value->is_array() ? item.get<std::string>() : key;
    if (std::find(model.adapters.begin(), model.adapters.end(), choice.name) == model.adapters.end()) {
      throw unknown_adapter(choice.name, model);
    }
    for (const auto& earlier : choices) {
      if (earlier.name == choice.name) {
        throw ApiError(400, "Invalid 'adapters': '" + choice.name + "' is named twice.", "adapters", "invalid_value");
      }
    }
    if (value->is_object()) {  // the name is one of ours: safe to echo
      const auto param = std::string("adapters.").append(choice.name);
      if (!item.is_number()) throw wrong_type(param, "a number (the adapter's weight)", item);
      choice.weight = item.get<double>();
      if (!(std::abs(choice.weight) <= kMaxAdapterWeight)) {
        throw out_of_range(param, item.dump(), "a weight in [-10, 10]");
      }
    }
    choices.push_back(std::move(choice));
  }
  return choices;
}

}  // namespace

std::string side_by_side(int64_t side) { return std::to_string(side) + "x" + std::to_string(side); }

ImageRequest read_image_request(std::string_view body, const ServedModel& model) {
  const auto parsed = parse_body(body);
  ImageRequest request;
  request.prompt = read_prompt(parsed, model);
  if (const auto name = string_field(parsed, "model"); name && *name != model.id) {
    throw ApiError(404, "The model `" + excerpt(*name) + "` does not exist or you do not have access to it.", "model",
                   "model_not_found");
  }
  request.n = integer_field(parsed, "n", 1, model.max_n).value_or(1);
  request.response_format = string_field(parsed, "response_format").value_or("url");
  if (request.response_format != "url" && request.response_format != "b64_json") {
    throw ApiError(400, "Invalid 'response_format': " + excerpt(request.response_format) +
                            "; expected 'url' or 'b64_json'.", "response_format", "invalid_value");
  }
  request.user = string_field(parsed, "user").value_or("");
  request.superres = read_superres(parsed, model);
  request.candidates = read_candidates(parsed, model, request.n);
  request.seed = integer_field(parsed, "seed", 0, std::numeric_limits<int64_t>::max());
  request.guidance_scale = number_field(parsed, "guidance_scale", 0.0, 100.0);
  request.temperature = number_field(parsed, "temperature", 1e-4, 100.0);
  request.top_k = integer_field(parsed, "top_k", 0, int64_t{1} << 30);
  request.top_p = number_field(parsed, "top_p", 1e-6, 1.0);
  request.stream = bool_field(parsed, "stream").value_or(false);
  request.partial_images = integer_field(parsed, "partial_images", 0, 3).value_or(0);
  request.partial_images_of_every_candidate = bool_field(parsed, "partial_images_of_every_candidate").value_or(false);
  request.adapters = read_adapters(parsed, model);
  return request;
}

void ImageRequest::check_partial_images_streamed() const {
  if (partial_images > 0 && !stream) {
    throw ApiError(400, "'partial_images' are streamed: send 'stream': true with them (or submit a job, which "
                        "holds them).", "partial_images", "invalid_value");
  }
}

int64_t ImageRequest::preview_every(const ServedModel& model) const {
  // ceil(tokens / (k + 1)): k previews before the last position, none at it.
  return partial_images == 0 ? 0 : (model.image_tokens + partial_images) / (partial_images + 1);
}

generate::PromptRequest to_prompt_request(const ImageRequest& request, generate::PromptRequest defaults,
                                          int64_t random_seed) {
  auto prompt = std::move(defaults);
  prompt.prompt = request.prompt;
  prompt.stream_index = 0;  // as dalle-generate draws a single prompt
  prompt.candidates = request.candidates;
  prompt.keep = request.n;
  prompt.superres = request.superres;
  auto& sampling = prompt.sampling;
  sampling.seed = request.seed.value_or(random_seed);
  if (request.guidance_scale) sampling.guidance_scale = *request.guidance_scale;
  if (request.temperature) sampling.temperature = *request.temperature;
  if (request.top_k || request.top_p) prompt.schedule = {};
  if (request.top_k) sampling.top_k = *request.top_k;
  if (request.top_p) sampling.top_p = *request.top_p;
  prompt.adapters = request.adapters;
  return prompt;
}

}  // namespace dalle::serve
