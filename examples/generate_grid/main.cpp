// Composes a few fashion-compose pictures from Fashion-MNIST and writes them as a labelled
// grid: the library used as a downstream project would, through its installed package.
#include <dalle/data/fashion_compose.h>
#include <dalle/data/image.h>
#include <dalle/runtime.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: generate_grid OUT.png\n";
    return 2;
  }
  try {
    std::cout << dalle::runtime_summary() << "\n";
    dalle::data::FashionComposeConfig config;
    dalle::data::FashionComposer composer(config, dalle::data::load_fashion_mnist("test"));
    std::mt19937_64 rng(7);
    std::vector<torch::Tensor> images;
    std::vector<std::string> captions;
    for (int i = 0; i < 6; ++i) {
      auto composed = composer.compose(dalle::data::ComposeSplit::test, rng);
      images.push_back(composed.image);
      captions.push_back(composed.caption);
    }
    dalle::data::write_png(argv[1], dalle::data::make_grid(images, captions, {.columns = 3, .tile_size = 128}));
    std::cout << "wrote " << argv[1] << "\n";
  } catch (const std::exception& error) {
    std::cerr << "generate_grid: " << error.what() << "\n";
    return 1;
  }
}
