// Hostile and careless input to the library's readers: decompression bombs, unbounded
// text, model folders with cut configs or corrupt weights. Each must be refused with a
// message naming the file, key or tensor, in bounded time and memory.
#include <torch/torch.h>
#include <unistd.h>

#include <opencv2/imgcodecs.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "dalle/data/caption_dataset.h"
#include "dalle/data/image.h"
#include "dalle/data/image_grid.h"
#include "dalle/input_limits.h"
#include "dalle/runtime.h"
#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors.h"
#include "dalle/io/stale_temporaries.h"
#include "dalle/io/state_dict.h"
#include "dalle/models/trained.h"
#include "hostile_files.h"
#include "test_support.h"

namespace dalle {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

const std::string kShipped = std::string(DALLE_SOURCE_DIR) + "/models/fashion-compose-f8/";

// Sets an environment variable for the scope of a test.
class ScopedEnvironment {
 public:
  ScopedEnvironment(const char* name, const std::string& value) : name_(name) { ::setenv(name, value.c_str(), 1); }
  ~ScopedEnvironment() { ::unsetenv(name_); }

 private:
  const char* name_;
};

// The peak resident memory since the last reset, in MB (Linux's VmHWM; writing 5 to
// clear_refs resets it).
int64_t peak_resident_mb() { return static_cast<int64_t>(process_memory_mib("VmHWM")); }
void reset_peak_resident() { std::ofstream("/proc/self/clear_refs") << "5"; }

// A little-endian TIFF whose first directory gives only ImageWidth and ImageLength (LONG).
std::string tiff_claiming(uint32_t width, uint32_t height) {
  const auto little = [](uint32_t value, int bytes) {
    std::string out;
    for (int i = 0; i < bytes; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFF);
    return out;
  };
  std::string tiff = std::string("II*\0", 4) + little(8, 4) + little(2, 2);
  for (const auto& [tag, value] : {std::pair{256u, width}, std::pair{257u, height}}) {
    tiff += little(tag, 2) + little(4, 2) + little(1, 4) + little(value, 4);
  }
  return tiff + little(0, 4);
}

TEST(HostileImages, HeadersClaimingTooManyPixelsAreRefusedBeforeDecoding) {
  reset_peak_resident();
  const auto start = std::chrono::steady_clock::now();
  for (const auto& [name, bytes] :
       {std::pair{std::string("rgb8.png"), testing::png_claiming(20000, 20000)},
        std::pair{std::string("rgba16.png"), testing::png_claiming(20000, 20000, 16, 6)},
        std::pair{std::string("huge.jpg"), testing::jpeg_claiming(60000, 60000)},
        std::pair{std::string("huge.tif"), tiff_claiming(100000, 100000)},
        std::pair{std::string("huge.ppm"), std::string("P6\n# made by hand\n30000 30000\n255\n")}}) {
    EXPECT_LT(bytes.size(), 1000u) << name;
    EXPECT_THROW_WITH(data::decode_image(bytes, name), data::ImageError, name.c_str(), "pixels, over the limit of 33554432",
                      "DALLE_MAX_IMAGE_PIXELS");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_LT(peak_resident_mb(), 2048) << "nothing was decoded";

  // The limit is the user's to move; below it images decode as before.
  ScratchDir dir;
  data::write_png(dir / "small.png", torch::rand({3, 16, 16}));
  EXPECT_EQ(data::read_image(dir / "small.png").size(2), 16);
  for (const char* name : {"small.tif", "small.ppm", "small.bmp", "small.jpg", "small.webp"}) {
    ASSERT_TRUE(cv::imwrite(dir / name, cv::Mat(12, 16, CV_8UC3, cv::Scalar(10, 20, 30)))) << name;
    EXPECT_EQ(data::read_image(dir / name).sizes(), (std::vector<int64_t>{3, 12, 16})) << name;
  }
  ScopedEnvironment limit("DALLE_MAX_IMAGE_PIXELS", "100");
  EXPECT_THROW_WITH(data::read_image(dir / "small.png"), data::ImageError, "small.png: 16x16 pixels");
  for (const char* name : {"small.tif", "small.ppm", "small.bmp", "small.jpg", "small.webp"}) {
    EXPECT_THROW_WITH(data::read_image(dir / name), data::ImageError, "16x12 pixels, over the limit of 100");
  }
  ScopedEnvironment nonsense("DALLE_MAX_IMAGE_PIXELS", "lots");
  EXPECT_THROW_WITH(data::read_image(dir / "small.png"), Error, "DALLE_MAX_IMAGE_PIXELS='lots'", "positive integer");
}

TEST(HostileText, LongCaptionsAreCutWhereTheyAreReadAndLabelsStaySmall) {
  ScratchDir dir;
  fs::create_directories(dir / "images");
  data::write_png(dir / "images/a.png", torch::rand({3, 8, 8}));
  const std::string long_caption = "a red bag " + std::string(5 << 20, 'x');
  testing::write_text(dir / "captions.tsv", "images/a.png\t" + long_caption + "\nimages/a.png\tbad \xC3\x28 utf8\n");
  const auto dataset = data::ImageCaptionDataset::open(dir.path().string());
  ASSERT_EQ(dataset->size(), 1u);
  ASSERT_EQ(dataset->record(0).captions.size(), 1u) << "the caption that is not UTF-8 is skipped";
  EXPECT_EQ(dataset->record(0).captions[0].size(), static_cast<size_t>(max_text_bytes()));
  EXPECT_EQ(dataset->report().skipped_malformed_lines, 1);
  // A line past max_caption_line_bytes (or a file without line ends) is read no further.
  testing::write_text(dir / "captions.tsv",
                      "images/a.png\ta red bag\nimages/a.png\t" + std::string(17 << 20, 'x') + "\n");
  EXPECT_THROW_WITH(data::ImageCaptionDataset::open(dir.path().string()), Error,
                    "captions.tsv:2: a line of over 16777216 bytes");

  // A label of any length takes at most six lines under its tile.
  const auto short_grid = data::make_grid({torch::rand({3, 32, 32})}, {"a red bag"}, {.tile_size = 32});
  const auto long_grid = data::make_grid({torch::rand({3, 32, 32})}, {long_caption}, {.tile_size = 32});
  EXPECT_LE(long_grid.size(1), short_grid.size(1) + 5 * 12);

  EXPECT_LT(excerpt(long_caption).size(), 100u);
  EXPECT_THAT(excerpt(long_caption), ::testing::EndsWith("... (5242890 bytes)"));
  EXPECT_THROW_WITH(check_prompt(long_caption, "prompts.txt:3"), Error, "prompts.txt:3", "5242890 bytes long",
                    "limit of 1024", "DALLE_MAX_TEXT_BYTES");
  EXPECT_THROW_WITH(check_prompt("caf\xE9", "prompt 2"), Error, "prompt 2: the prompt is not valid UTF-8");
  EXPECT_THROW_WITH(check_prompt(" \t ", "prompt 1"), Error, "prompt 1: the prompt is blank");
  EXPECT_NO_THROW(check_prompt("a red caf\xC3\xA9", "prompt 1"));
  EXPECT_NO_THROW(check_prompt("a red\tbag", "prompt 1"));
  const std::vector<std::pair<std::string, std::string>> controlled = {
      {std::string("a\0b", 3), "U+0000 at byte 2"}, {"a\x1b[31mred", "U+001B at byte 2"},
      {"two\nlines", "U+000A at byte 4"},         {"a\x7f", "U+007F at byte 2"},
      {"a \xC2\x9B" "31m", "U+009B at byte 3"}};
  for (const auto& [prompt, code] : controlled) {
    EXPECT_THROW_WITH(check_prompt(prompt, "prompt 1"), Error,
                      "prompt 1: the prompt holds a control character (" + code);
  }
  EXPECT_EQ(utf8_prefix("caf\xC3\xA9", 4), "caf") << "never half a character";
}

// A copy of a shipped model folder, for a test to damage.
std::string copy_of(const std::string& model, const ScratchDir& dir, const std::string& name) {
  const std::string target = dir / name;
  fs::copy(kShipped + model, target, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  return target;
}

TEST(HostileModels, AConfigWithoutItsSizesIsRefusedNotBuiltFromDefaults) {
  ScratchDir dir;
  const auto prior = copy_of("prior", dir, "prior");
  testing::write_text(prior + "/config.yaml", "");
  EXPECT_THROW_WITH(models::load_trained_prior(prior), ConfigError, "prior/config.yaml: 'model' is missing or empty",
                    "must name its sizes");
  const auto shipped = testing::read_text(kShipped + "prior/config.yaml");
  std::string without_width = shipped;
  without_width.erase(without_width.find("  width: 192\n"), std::string("  width: 192\n").size());
  testing::write_text(prior + "/config.yaml", without_width);
  EXPECT_THROW_WITH(models::load_trained_prior(prior), ConfigError, "prior/config.yaml: model.width is missing",
                    "the default, 3968, is no fallback");
  std::string without_ratio = shipped;
  without_ratio.erase(without_ratio.find("  mlp_ratio: 4\n"), std::string("  mlp_ratio: 4\n").size());
  testing::write_text(prior + "/config.yaml", without_ratio);
  EXPECT_NO_THROW(models::load_trained_prior(prior)) << "a small count may keep its default";

  const auto superres = copy_of("superres", dir, "superres");
  testing::write_text(superres + "/config.yaml", "kind: rrdbnet\n");
  EXPECT_THROW_WITH(models::load_trained_rrdbnet(superres), ConfigError, "superres/config.yaml: 'model' is missing or empty");
}

TEST(HostileModels, NonFiniteWeightsAreRefusedByName) {
  ScratchDir dir;
  const auto superres = copy_of("superres", dir, "superres");
  auto weights = io::read_safetensors(superres + "/model.safetensors").tensors;
  weights.at("conv_body.bias")[3] = std::numeric_limits<float>::quiet_NaN();
  io::write_safetensors(superres + "/model.safetensors", weights);
  EXPECT_THROW_WITH(models::load_trained_rrdbnet(superres), Error, "superres/model.safetensors",
                    "tensor 'conv_body.bias' holds NaN or infinite values");
  weights.at("conv_body.bias")[3] = std::numeric_limits<float>::infinity();
  io::write_safetensors(superres + "/model.safetensors", weights);
  EXPECT_THROW_WITH(models::load_trained_rrdbnet(superres), Error, "conv_body.bias");
}

TEST(HostileModels, AShapeThatOverflowsNamesTheFile) {
  const auto overflowing = [](const std::string& shape) {
    const std::string header = R"({"t": {"dtype": "F32", "shape": )" + shape + R"(, "data_offsets": [0, 0]}})";
    std::string bytes(8, '\0');
    const uint64_t size = header.size();
    std::memcpy(bytes.data(), &size, 8);
    return bytes + header;
  };
  for (const char* shape : {"[0, 4611686018427387904, 4]", "[4611686018427387904, 4, 0]", "[3037000500, 3037000500, 0]"}) {
    EXPECT_THROW_WITH(io::parse_safetensors(overflowing(shape), "big.safetensors"), io::FormatError,
                      "big.safetensors: not a valid safetensors file", "too large to address");
  }
}

TEST(HostileFiles, MessagesQuoteAnExcerptOfWhatTheFileSays) {
  const std::string endless(1 << 20, 'x');
  const std::string header = R"({")" + endless + R"(": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})";
  std::string bytes(8, '\0');
  const uint64_t size = header.size();
  std::memcpy(bytes.data(), &size, 8);
  try {
    io::parse_safetensors(bytes + header, "long-names.safetensors");
    ADD_FAILURE() << "a negative dimension was accepted";
  } catch (const io::FormatError& error) {
    EXPECT_LT(std::string(error.what()).size(), 400u);
    EXPECT_THAT(error.what(), ::testing::HasSubstr("(1048576 bytes) has a negative dimension"));
  }
  try {
    load_config<models::RrdbNetConfig>(ConfigSource::from_string("num_feat: " + endless + "\n", "long.yaml"));
    ADD_FAILURE() << "a word was read as an integer";
  } catch (const ConfigError& error) {
    EXPECT_LT(std::string(error.what()).size(), 400u);
    EXPECT_THAT(error.what(), ::testing::HasSubstr("long.yaml"));
    EXPECT_THAT(error.what(), ::testing::HasSubstr("num_feat: expected an integer, got 'xxx"));
  }
}

TEST(HostileFiles, TemporariesOfKilledWritersAreRemovedByTheNextWrite) {
  ScratchDir dir;
  const pid_t gone = testing::ended_process_id();
  const std::string stale = dir / ("checkpoints/step-000000002.tmp-" + std::to_string(gone) + "-0");
  const std::string live = dir / ("checkpoints/step-000000004.tmp-" + std::to_string(::getpid()) + "-0");
  fs::create_directories(stale);
  fs::create_directories(live);
  testing::write_text(dir / "checkpoints/notes.tmp-x", "not ours");
  io::CheckpointStore store(dir / "checkpoints");
  store.save(1, {.config_yaml = "model: {}\n"});
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live)) << "a running writer's temporary stays";
  EXPECT_TRUE(fs::exists(dir / "checkpoints/notes.tmp-x"));
  EXPECT_TRUE(fs::exists(dir / "checkpoints/step-000000001/model.safetensors"));

  const std::string export_leftover = dir / ("export.tmp-" + std::to_string(gone) + "-3");
  const std::string other_leftover = dir / ("other.tmp-" + std::to_string(gone) + "-3");
  fs::create_directories(export_leftover);
  fs::create_directories(other_leftover);
  io::remove_stale_temporaries(dir / "export");
  EXPECT_FALSE(fs::exists(export_leftover));
  EXPECT_TRUE(fs::exists(other_leftover)) << "only the named target's temporaries";
}

// threads: 0 takes the idle cores, at least one; OMP_NUM_THREADS (ctest sets it) keeps
// torch's default; a positive count is taken as it is.
TEST(SharedMachine, ThreadsDefaultToTheIdleCoresAndNeverToNone) {
  EXPECT_EQ(set_torch_threads(3), 3);
  EXPECT_EQ(torch::get_num_threads(), 3);
  const char* configured = std::getenv("OMP_NUM_THREADS");
  const std::string kept = configured ? configured : "";
  ::unsetenv("OMP_NUM_THREADS");
  const auto idle = set_torch_threads(0);
  EXPECT_GE(idle, 1);
  EXPECT_LE(idle, static_cast<int64_t>(std::thread::hardware_concurrency()));
  EXPECT_EQ(torch::get_num_threads(), idle);
  if (!kept.empty()) ::setenv("OMP_NUM_THREADS", kept.c_str(), 1);
}

// Random damage to shipped model folders, fed to the loaders the tools use: each load must
// succeed or throw dalle::Error (a message for the user), never another exception, a crash
// or a hang, and memory stays bounded. Deterministic: the seed is fixed.
TEST(HostileModels, FuzzedConfigsAndWeightsAreLoadedOrRefusedCleanly) {
  constexpr int kRounds = 400;
  constexpr int64_t kPeakBoundMb = 3072;
  const auto time_bound = std::chrono::seconds(240);
  struct Model {
    std::string folder;
    std::function<void(const std::string&)> load;
  };
  const std::vector<Model> models = {
      {"superres", [](const std::string& d) { models::load_trained_rrdbnet(d); }},
      {"vqgan", [](const std::string& d) { models::load_image_tokenizer(d); }},
      {"clip", [](const std::string& d) { models::load_trained_clip(d); }},
      {"prior", [](const std::string& d) { models::load_trained_prior(d); }},
  };
  ScratchDir dir;
  std::mt19937_64 rng(2026);
  const auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  int refused = 0, loaded = 0;
  reset_peak_resident();
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < kRounds && std::chrono::steady_clock::now() - start < time_bound; ++round) {
    const auto& model = models[static_cast<size_t>(round) % models.size()];
    const std::string folder = copy_of(model.folder, dir, "fuzzed");
    const bool damage_config = round % 2 == 0;
    const std::string file = folder + (damage_config ? "/config.yaml" : "/model.safetensors");
    std::string bytes = testing::read_text(file);
    std::string what;
    switch (pick(4)) {
      case 0:  // a few random bytes anywhere; for weights, mostly in the header
        for (size_t i = 0, n = 1 + pick(4); i < n; ++i) {
          const size_t at = damage_config || pick(2) ? pick(bytes.size()) : pick(std::min<size_t>(bytes.size(), 4096));
          bytes[at] = static_cast<char>(rng());
          what += "byte " + std::to_string(at) + " ";
        }
        break;
      case 1: {  // cut short
        const size_t keep = pick(bytes.size());
        bytes.resize(keep);
        what = "cut to " + std::to_string(keep);
        break;
      }
      case 2: {  // a line or a header byte range dropped
        const size_t from = pick(damage_config ? bytes.size() : std::min<size_t>(bytes.size(), 4096));
        const size_t end = damage_config ? bytes.find('\n', from) : from + 1 + pick(16);
        bytes.erase(from, end == std::string::npos ? std::string::npos : end - from + 1);
        what = "dropped from " + std::to_string(from);
        break;
      }
      default: {  // a digit of a number made larger
        const size_t from = pick(damage_config ? bytes.size() : std::min<size_t>(bytes.size(), 4096));
        const size_t at = bytes.find_first_of("0123456789", from);
        if (at != std::string::npos) bytes[at] = '9';
        what = "digit at " + std::to_string(at) + " made 9";
      }
    }
    testing::write_text(file, bytes);
    try {
      model.load(folder);
      ++loaded;
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& error) {
      ADD_FAILURE() << model.folder << " " << file << " (" << what << "): not a dalle::Error: " << error.what();
    }
    fs::remove_all(folder);
  }
  const auto elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(loaded + refused, 40) << "too few rounds in the time bound";
  EXPECT_GT(refused, 0);
  EXPECT_LT(peak_resident_mb(), kPeakBoundMb) << "a damaged model made the loader allocate too much";
  std::cout << "fuzzed " << loaded + refused << " model folders in " << elapsed << " s: " << refused << " refused, "
            << loaded << " loaded; peak resident " << peak_resident_mb() << " MB\n";
}

}  // namespace
}  // namespace dalle
