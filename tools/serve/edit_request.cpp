#include "serve/edit_request.h"

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "dalle/data/image.h"
#include "dalle/input_limits.h"
#include "dalle/models/token_grid.h"
#include "serve/api_error.h"

namespace dalle::serve {

namespace {

using nlohmann::json;

// The fields that are not strings, as JSON would carry them; a value that does not read as
// one stays a string, which read_image_request refuses naming the field.
const std::set<std::string>& typed_fields() {
  static const std::set<std::string> fields = {"n", "seed", "candidates", "guidance_scale", "top_k", "top_p",
                                               "temperature", "superres", "stream", "partial_images",
                                               "partial_images_of_every_candidate", "adapters"};
  return fields;
}

json fields_as_json(const Form& form) {
  json body = json::object();
  for (const auto& [name, part] : form) {
    if (is_file_field(name) || name == "top_rows") continue;
    json value = part.data;
    if (typed_fields().count(name)) {
      auto parsed = json::parse(part.data, nullptr, /*allow_exceptions=*/false);
      if (!parsed.is_discarded() && (parsed.is_number() || parsed.is_boolean())) value = std::move(parsed);
    }
    body[name] = std::move(value);
  }
  return body;
}

bool known_image_type(const std::string& bytes) {
  const auto starts = [&](std::string_view magic) { return bytes.compare(0, magic.size(), magic) == 0; };
  return starts("\x89PNG\r\n\x1a\n") || starts("\xff\xd8\xff") ||
         (starts("RIFF") && bytes.size() >= 12 && bytes.compare(8, 4, "WEBP") == 0);
}

const FormPart* image_part(const Form& form, const std::string& name) {
  for (const auto& key : {name, name + "[]"}) {
    if (const auto at = form.find(key); at != form.end()) return &at->second;
  }
  return nullptr;
}

torch::Tensor decode(const FormPart& part, const std::string& name) {
  if (!known_image_type(part.data)) {
    throw ApiError(400, "Invalid '" + name + "': it must be a PNG, JPEG or WebP file.", name, "invalid_image_format");
  }
  try {
    return data::decode_image(part.data, name);
  } catch (const data::ImageError& error) {
    throw ApiError(400, "Invalid '" + name + "': " + std::string(error.what()), name, "invalid_image");
  }
}

std::string which_masks_work(int64_t grid, int64_t side) {
  const auto row = side / grid;
  return "ruDALL-E's image prompts keep whole token rows from the top and draw the rest: make the top of the mask "
         "opaque (1 to " + std::to_string(grid - 1) + " rows of " + std::to_string(row) + " pixels, at this "
         "model's " + std::to_string(side) + "x" + std::to_string(side) + ") and everything below transparent";
}

// `image_height` x `image_width`: the upload's size, for a mask's check.
int64_t top_rows_of(const Form& form, int64_t image_height, int64_t image_width, const ServedModel& model) {
  const auto grid = models::grid_side(model.image_tokens, "serve: the model's image tokens");
  if (const auto at = form.find("top_rows"); at != form.end()) {
    char* end = nullptr;
    const long long rows = std::strtoll(at->second.data.c_str(), &end, 10);
    if (at->second.data.empty() || *end != '\0' || rows < 1 || rows >= grid) {
      throw ApiError(400, "Invalid 'top_rows': expected the token rows kept from the top, 1 to " +
                              std::to_string(grid - 1) + ".", "top_rows", "invalid_value");
    }
    return rows;
  }
  const auto* mask = image_part(form, "mask");
  const std::string from = mask ? "mask" : "image";
  std::optional<torch::Tensor> alpha;
  try {
    alpha = data::decode_alpha(mask ? mask->data : image_part(form, "image")->data, from);
  } catch (const data::ImageError& error) {
    throw ApiError(400, "Invalid '" + from + "': " + std::string(error.what()), from, "invalid_image");
  }
  if (!alpha) {
    throw ApiError(400, mask ? "Invalid 'mask': it must be a PNG with an alpha channel, transparent where the image is "
                               "to be drawn."
                             : "The image has no transparency to serve as the mask: send a `mask` (a PNG, "
                               "transparent where the image is to be drawn), or `top_rows`.",
                   from, "invalid_mask");
  }
  if (mask && (alpha->size(1) != image_height || alpha->size(2) != image_width)) {
    throw ApiError(400, "Invalid 'mask': it must have the image's size.", "mask", "invalid_mask");
  }
  const auto rows = generate::top_rows_kept(*alpha, model.plain_size, grid);
  if (!rows) {
    throw ApiError(400, "The " + from + " keeps a region this model cannot: " +
                            which_masks_work(grid, model.plain_size) + ".", from, "invalid_mask");
  }
  return *rows;
}

}  // namespace

int64_t decode_bytes(const Form& form) {
  int64_t pixels = 0;
  for (const auto& name : {"image", "image[]", "mask"}) {
    if (const auto at = form.find(name); at != form.end()) {
      const auto declared = data::header_pixels(at->second.data).value_or(max_image_pixels());
      pixels = std::max(pixels, std::min(declared, max_image_pixels()));
    }
  }
  // Decodes come one after another (the image, then its alpha or the mask), each freed first;
  // scaling the image to the model's square adds little beside the decode.
  return pixels * (data::kDecodeBytesPerPixel + 2);
}

bool is_file_field(const std::string& name) {
  return name == "image" || name == "image[]" || name == "mask";
}

namespace {

const FormPart& required_image(const Form& form) {
  const auto* image = image_part(form, "image");
  if (!image) throw ApiError(400, "Missing required parameter: 'image'.", "image", "missing_required_parameter");
  return *image;
}

}  // namespace

ImageRequest read_edit_fields(const Form& form, const ServedModel& model) {
  required_image(form);
  return read_image_request(fields_as_json(form).dump(), model);
}

generate::PromptImage read_edit_image(const Form& form, const ServedModel& model) {
  auto upload = decode(required_image(form), "image");
  const int64_t height = upload.size(1), width = upload.size(2);
  auto image = generate::square_image(upload, model.plain_size).clone();
  upload = torch::Tensor();  // one full-size decode at a time: the alpha's comes after
  const auto rows = top_rows_of(form, height, width, model);
  return {.image = std::move(image), .top_rows = rows};
}

}  // namespace dalle::serve
