// Text to images from a downstream application, through the installed dalle package: a
// pipeline config in, a grid of the best images out, in one library call.
//   generate_grid PIPELINE.yaml OUT_DIR "a caption" ["another caption" ...]
#include <dalle/config.h>
#include <dalle/generate/pipeline.h>
#include <dalle/runtime.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: generate_grid PIPELINE.yaml OUT_DIR CAPTION [CAPTION ...]\n";
    return 2;
  }
  try {
    std::cout << dalle::runtime_summary() << "\n";
    const auto config = dalle::load_config<dalle::generate::PipelineConfig>(dalle::ConfigSource::from_file(argv[1]));
    dalle::generate::Pipeline pipeline(config);
    const auto images = pipeline.generate(std::vector<std::string>(argv + 3, argv + argc));
    dalle::generate::write_generation(argv[2], pipeline.config(), images);
    for (const auto& image : images) {
      std::cout << image.prompt << " #" << image.rank << " (sample " << image.candidate << ")";
      if (image.clip_score) std::cout << " CLIP " << *image.clip_score;
      std::cout << "\n";
    }
    std::cout << "wrote " << argv[2] << "/grid.png\n";
  } catch (const std::exception& error) {
    std::cerr << "generate_grid: " << error.what() << "\n";
    return 1;
  }
}
