// dalle-encode-images: turns an image-caption dataset into a token dataset (dVAE or VQGAN
// tokens of every image, tokenizer ids of every caption), so that stage 2 trains without
// the encoder.
#include "dalle/generate/encode_images.h"
#include "dalle/runtime.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  CLI::App app{"Encodes images with a trained dVAE or VQGAN and captions with the tokenizer, into token shards."};
  app.name("dalle-encode-images");
  tools::add_common_options(app);
  generate::EncodeImagesOptions options;
  app.add_option("--dataset", options.dataset, "image-caption dataset folder")->required();
  // The checkpoint's config says which kind it is; --dvae and --vqgan are the same option.
  app.add_option("--image-tokenizer,--dvae,--vqgan", options.image_tokenizer,
                 "dVAE or VQGAN run directory or checkpoint directory")
      ->required();
  app.add_option("--tokenizer", options.tokenizer, "tokenizer model (its .yaml beside it)")->required()
      ->check(CLI::ExistingFile);
  app.add_option("--out", options.out, "token dataset folder to write")->required();
  app.add_option("--batch-size", options.batch_size, "images per encoder batch")->check(CLI::Range(1, 1 << 16));
  app.add_option("--workers", options.workers, "image loading threads")->check(CLI::Range(0, 64));
  app.add_option("--images-per-shard", options.images_per_shard, "images per shard file")
      ->check(CLI::Range(1, 1 << 24));
  return tools::run_tool(app, argc, argv, [&] {
    set_torch_threads(0);
    generate::encode_images(options);
  });
}
