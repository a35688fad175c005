#include "dalle/generate/encode_images.h"

#include <torch/torch.h>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/loader.h"
#include "dalle/log.h"
#include "dalle/models/trained.h"
#include "dalle/text/tokenizer.h"

namespace dalle::generate {

data::TokenDatasetInfo encode_images(const EncodeImagesOptions& options) {
  const auto vae = models::load_image_tokenizer(options.image_tokenizer);
  const auto tokenizer = text::Tokenizer::load(options.tokenizer);
  auto dataset = data::ImageCaptionDataset::open(options.dataset, {.image_size = vae.image_size});
  data::DataLoader<data::ImageCaptionDataset> loader(
      dataset, {.batch_size = options.batch_size, .workers = options.workers, .drop_last = false,
                .sampler = {.shuffle = false}});

  const int64_t grid = vae.grid_size();
  data::TokenDatasetWriter writer(
      options.out,
      {.image_vocab_size = vae.model->vocab_size(), .text_vocab_size = tokenizer.vocab_size(),
       .grid_height = grid, .grid_width = grid, .text_length = tokenizer.text_length(),
       .source = "images " + options.dataset + ", " + vae.kind + " " + options.image_tokenizer + ", tokenizer " +
                 options.tokenizer},
      options.images_per_shard);

  torch::NoGradGuard no_grad;
  int64_t skipped = 0;
  log::Progress progress("encoding images", static_cast<int64_t>(dataset->size()));
  for (int64_t b = 0; b < loader.batches_per_epoch(); ++b) {
    auto batch = loader.next();
    skipped += batch.skipped;
    progress.advance(static_cast<int64_t>(batch.examples.size()) + batch.skipped);
    if (batch.examples.empty()) continue;
    std::vector<torch::Tensor> images;
    for (const auto& example : batch.examples) images.push_back(example.image);
    const auto tokens = vae.model->encode_tokens(torch::stack(images));
    for (size_t i = 0; i < batch.examples.size(); ++i) {
      const auto& captions = dataset->record(static_cast<size_t>(batch.examples[i].index)).captions;
      std::vector<torch::Tensor> ids;
      for (const auto& caption : captions) ids.push_back(torch::tensor(tokenizer.encode(caption).ids));
      writer.add(tokens[static_cast<int64_t>(i)], torch::stack(ids), captions);
    }
  }
  progress.finish();
  if (skipped == static_cast<int64_t>(dataset->size())) {
    throw Error(options.dataset + ": no image could be read (" + dataset->report().summary() + ")");
  }
  const auto info = writer.finish();
  log::info("encoded ", info.images, " images and ", info.captions, " captions into ", info.shards,
            " shards in ", options.out, "; ", skipped, " unreadable images skipped");
  return info;
}

}  // namespace dalle::generate
