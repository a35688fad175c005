// dalle-tokenizer: train a SentencePiece BPE caption tokenizer, encode and decode captions.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "dalle/data/caption_dataset.h"
#include "dalle/input_limits.h"
#include "dalle/log.h"
#include "dalle/text/tokenizer.h"
#include "tool_support.h"

using namespace dalle;
namespace fs = std::filesystem;

namespace {

// Captions from a dataset folder, or from a text file holding one caption per line.
std::vector<std::string> read_captions(const std::string& path) {
  std::vector<std::string> captions;
  if (fs::is_directory(path)) {
    auto dataset = data::ImageCaptionDataset::open(path);
    for (size_t i = 0; i < dataset->size(); ++i) {
      const auto& more = dataset->record(i).captions;
      captions.insert(captions.end(), more.begin(), more.end());
    }
    return captions;
  }
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open the captions file");
  const auto limit = static_cast<size_t>(max_caption_line_bytes());
  std::string line;
  for (int64_t number = 1; read_line_within(in, limit, line, path, number, "a captions file holds one caption a line");
       ++number) {
    captions.push_back(line);
  }
  return captions;
}

// --config and --set override the config saved beside the model.
text::Tokenizer load_tokenizer(const std::string& model, const tools::ConfigOptions& options) {
  auto config_options = options;
  if (config_options.path.empty() && fs::exists(text::Tokenizer::config_path(model))) {
    config_options.path = text::Tokenizer::config_path(model);
  }
  return text::Tokenizer::load(model, load_config<text::TokenizerConfig>(config_options.source()));
}

std::vector<int64_t> parse_ids(const std::string& line) {
  std::vector<int64_t> ids;
  std::istringstream in(line);
  for (std::string word; in >> word;) {
    try {
      size_t used = 0;
      ids.push_back(std::stoll(word, &used));
      if (used != word.size()) throw std::invalid_argument(word);
    } catch (const std::logic_error&) {
      throw Error("'" + word + "' is not a token id");
    }
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Trains and applies the SentencePiece BPE caption tokenizer."};
  app.name("dalle-tokenizer");
  tools::add_common_options(app);
  app.require_subcommand(1);

  std::string captions, model;
  uint32_t seed = 0;
  tools::ConfigOptions train_config, use_config;
  auto* train = app.add_subcommand("train", "train a BPE model on captions");
  train->add_option("--captions", captions, "dataset folder, or a text file with one caption per line (required)");
  train->add_option("--out", model, "where to write the model, its config beside it as <out>.yaml (required)");
  train->add_option("--seed", seed, "random seed of the trainer");
  train_config.add_to(*train, "tokenizer (configs/text/tokenizer.yaml)");

  std::vector<std::string> texts;
  bool dropout = false;
  auto* encode = app.add_subcommand("encode", "print the ids of each caption, one caption per line");
  encode->add_option("--model", model, "tokenizer model")->required()->check(CLI::ExistingFile);
  encode->add_option("captions", texts, "captions (default: read lines from standard input)");
  encode->add_flag("--dropout", dropout, "apply BPE-dropout, as in training");
  encode->add_option("--seed", seed, "BPE-dropout seed");
  use_config.add_to(*encode, "tokenizer (default: <model>.yaml)");

  std::vector<std::string> id_lists;
  auto* decode = app.add_subcommand("decode", "print the caption of each line of ids");
  decode->add_option("--model", model, "tokenizer model")->required()->check(CLI::ExistingFile);
  decode->add_option("ids", id_lists, "one quoted list of ids per caption (default: standard input)");

  return tools::run_tool(app, argc, argv, [&] {
    if (*train) {
      auto config = load_config<text::TokenizerConfig>(train_config.source());
      if (train_config.print_requested(visit_of(config))) return;
      if (captions.empty() || model.empty()) throw tools::UsageError("train: --captions and --out are required");
      const auto all = read_captions(captions);
      text::Tokenizer::train(all, config, model, seed);
      log::info("trained a ", config.vocab_size, "-token BPE model on ", all.size(), " captions: ", model);
      return;
    }
    auto tokenizer = load_tokenizer(model, use_config);
    auto config = tokenizer.config();
    if (*encode && use_config.print_requested(visit_of(config))) return;
    auto lines = *encode ? texts : id_lists;
    if (lines.empty()) {
      std::string line;
      for (int64_t number = 1; read_line_within(std::cin, static_cast<size_t>(max_caption_line_bytes()), line,
                                                "standard input", number, "one text or id list a line");
           ++number) {
        lines.push_back(line);
      }
    }
    if (*encode) {
      text::Tokenizer::seed_dropout(seed);
      for (const auto& line : lines) {
        auto encoding = dropout ? tokenizer.encode_for_training(line) : tokenizer.encode(line);
        for (size_t i = 0; i < encoding.ids.size(); ++i) std::cout << (i ? " " : "") << encoding.ids[i];
        std::cout << "\n";
      }
    } else {
      for (const auto& line : lines) std::cout << tokenizer.decode(parse_ids(line)) << "\n";
    }
  });
}
