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


// The fields whose parts are files: their bytes are bounded by max_image_bytes, the other
// fields' by max_body_bytes.
bool is_file_field(const std::string& name);

// Reads `form` against `model` (its plain_size is the image tokenizer's input side, its
// image_tokens the grid's cells) in two steps: its fields, cheaply (a wrong field is reported
// before an image costs decoding; ApiError 400 for a missing image and what
// read_image_request refuses) ...
ImageRequest read_edit_fields(const Form& form, const ServedModel& model);
// ... and its image prompt: the image decoded and at once scaled and cropped to the model's
// square (as the pipeline would, so its tokens are the same: a request never holds the
// upload), its alpha or mask decoded only then. ApiError 400 for an unreadable image, a type
// other than PNG, JPEG or WebP, an image and a mask of different sizes, a mask the prior
// cannot honour (saying which masks work).
generate::PromptImage read_edit_image(const Form& form, const ServedModel& model);

// The most memory read_edit_image holds at once to decode the form's files: the pixels their
// headers declare (or the pixel limit, DALLE_MAX_IMAGE_PIXELS, for a header not read) times
// what a decode holds per pixel.
int64_t decode_bytes(const Form& form);

}  // namespace dalle::serve
