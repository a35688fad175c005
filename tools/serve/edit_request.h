#pragma once
// The form of POST /v1/images/edits as OpenAI's clients send it (multipart/form-data): an
// `image`, an optional `mask`, and the fields of a generation request as text (prompt, n,
// size, response_format, and the framework's own: seed, candidates...). The kept region is
// ruDALL-E's image prompt: the top token rows that the mask leaves opaque (OpenAI's masks are
// transparent where the image is to be drawn). Without a mask, the image's own transparency
// is the mask, as OpenAI's API has it; the framework's `top_rows` field gives the rows
// instead. Whatever is wrong is an ApiError naming the field.
#include <cstdint>
#include <map>
#include <string>

#include "dalle/generate/image_prompt.h"
#include "serve/image_request.h"

namespace dalle::serve {

struct FormPart {
  std::string filename;      // empty for a text field
  std::string content_type;
  std::string data;
};
using Form = std::map<std::string, FormPart>;

struct EditRequest {
  ImageRequest request;
  generate::PromptImage image_prompt;
};

// The fields whose parts are files: their bytes are bounded by max_image_bytes, the other
// fields' by max_body_bytes.
bool is_file_field(const std::string& name);

// Reads `form` against `model` (its plain_size is the image tokenizer's input side, its
// image_tokens the grid's cells). Throws ApiError: 400 for a missing or unreadable image, a
// type other than PNG, JPEG or WebP, an image and a mask of different sizes, a mask the prior
// cannot honour (saying which masks work), and what read_image_request refuses.
EditRequest read_edit_request(const Form& form, const ServedModel& model);

}  // namespace dalle::serve
