// dalle-data: import Fashion-MNIST, build fashion-compose, inspect an image-caption dataset.
#include <filesystem>
#include <iostream>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/fashion_compose.h"
#include "dalle/data/fashion_mnist.h"
#include "dalle/log.h"
#include "tool_support.h"

using namespace dalle;

int main(int argc, char** argv) {
  CLI::App app{"Builds and inspects image-caption datasets."};
  app.name("dalle-data");
  tools::add_common_options(app);
  app.require_subcommand(1);

  data::FashionMnistImportOptions import;
  std::string import_out;
  auto* import_command = app.add_subcommand(
      "import-fashion-mnist", "write Fashion-MNIST as an image-caption dataset (PNG + captions.tsv)");
  import_command->add_option("--out", import_out, "output folder")->required();
  import_command->add_option("--split", import.split, "train or test")->check(CLI::IsMember({"train", "test"}));
  import_command->add_option("--limit", import.limit, "import at most this many items (0: all)")
      ->check(CLI::NonNegativeNumber);
  import_command->add_option("--template", import.templates,
                             "caption template, {item} or {a_item} replaced (repeatable)");
  import_command->add_option("--source", import.source, "folder of the idx files")->capture_default_str();

  std::string compose_out;
  tools::ConfigOptions compose_config;
  auto* compose_command = app.add_subcommand(
      "compose", "build fashion-compose: train, test and heldout splits plus a sample grid");
  compose_command->add_option("--out", compose_out, "output folder");
  compose_config.add_to(*compose_command, "dataset (configs/data/fashion-compose.yaml)");

  std::string inspect_root, grid_path;
  int64_t grid_count = 16;
  uint64_t grid_seed = 0;
  auto* inspect_command = app.add_subcommand(
      "inspect", "count a dataset's images and captions, report what was skipped, write a grid");
  inspect_command->add_option("dataset", inspect_root, "dataset folder (holding captions.jsonl or .tsv)")
      ->required();
  inspect_command->add_option("--grid", grid_path, "write a labelled sample grid PNG here");
  inspect_command->add_option("--count", grid_count, "images in the grid")->check(CLI::Range(1, 1024));
  inspect_command->add_option("--seed", grid_seed, "which images the grid shows");
  bool verify = false;
  inspect_command->add_flag("--verify", verify, "decode every image to count the unreadable ones");

  return tools::run_tool(app, argc, argv, [&] {
    if (*import_command) {
      const auto count = data::import_fashion_mnist(import_out, import);
      log::info("wrote ", count, " images to ", import_out);
    } else if (*compose_command) {
      auto config = load_config<data::FashionComposeConfig>(compose_config.source());
      if (compose_config.print_requested(visit_of(config))) return;
      if (compose_out.empty()) throw tools::UsageError("compose: --out is required");
      data::build_fashion_compose(config, compose_out);
      log::info("fashion-compose written to ", compose_out, "; sample grid ",
                (std::filesystem::path(compose_out) / "sample_grid.png").string());
    } else if (*inspect_command) {
      auto dataset = data::ImageCaptionDataset::open(inspect_root);
      if (verify) data::verify_images(*dataset);
      // After --verify, the grid reads images that were already counted: each unreadable one once.
      auto report = dataset->report();
      if (!grid_path.empty()) {
        data::write_sample_grid(*dataset, grid_path, grid_count, grid_seed);
        if (!verify) report = dataset->report();
      }
      std::cout << inspect_root << ": " << report.summary() << "\n";
      if (!grid_path.empty()) std::cout << "sample grid: " << grid_path << "\n";
    }
  });
}
