#include "dalle/io/safetensors.h"

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "dalle/io/checkpoint.h"
#include "dalle/io/safetensors_writer.h"
#include "test_support.h"

namespace dalle::io {
namespace {

using testing::ScratchDir;

std::string with_header(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  const uint64_t size = header.size();
  std::memcpy(bytes.data(), &size, 8);
  return bytes + header + data;
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  TensorMap tensors = {
      {"f64", torch::randn({2, 3}, torch::kFloat64)},
      {"f32", torch::randn({4}, torch::kFloat32)},
      {"f16", torch::randn({3, 1}).to(torch::kFloat16)},
      {"bf16", torch::randn({5}).to(torch::kBFloat16)},
      {"f8e4m3", torch::randn({2}).to(torch::kFloat8_e4m3fn)},
      {"f8e5m2", torch::randn({2}).to(torch::kFloat8_e5m2)},
      {"i64", torch::arange(5, torch::kInt64)},
      {"i32", torch::arange(3, torch::kInt32)},
      {"i16", torch::arange(3, torch::kInt16)},
      {"i8", torch::arange(-2, 2, torch::kInt8)},
      {"u8", torch::arange(4, torch::kUInt8)},
      {"bool", torch::tensor({true, false})},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::zeros({0, 3})},
      {"strided", torch::arange(12, torch::kFloat32).view({3, 4}).t()},
  };
  const std::string bytes = serialize_safetensors(tensors, {{"step", "12"}, {"format", "pt"}});
  uint64_t header_size;
  std::memcpy(&header_size, bytes.data(), 8);
  EXPECT_EQ(header_size % 8, 0u) << "the header is padded to 8 bytes";

  const auto read = parse_safetensors(bytes);
  ASSERT_EQ(read.tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const auto& copy = read.tensors.at(name);
    EXPECT_EQ(copy.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_EQ(copy.sizes(), tensor.sizes()) << name;
    // Compare bytes, not values: NaN != NaN, and the float8 types have no equality kernel.
    const auto bytes_of = [](const torch::Tensor& t) { return t.contiguous().reshape({-1}).view(torch::kUInt8); };
    EXPECT_TRUE(torch::equal(bytes_of(copy), bytes_of(tensor))) << name;
  }
  EXPECT_EQ(read.metadata, (Metadata{{"step", "12"}, {"format", "pt"}}));
}

TEST(Safetensors, ReadsFilesWrittenByTheReferencePackage) {
  const auto read = read_safetensors(std::string(DALLE_SOURCE_DIR) + "/tests/fixtures/reference.safetensors");
  EXPECT_EQ(read.metadata.at("note"), "dalle fixture");
  EXPECT_TRUE(torch::equal(read.tensors.at("float32"), torch::arange(6, torch::kFloat32).view({2, 3}) / 4));
  EXPECT_TRUE(torch::equal(read.tensors.at("float16"), torch::tensor({1.5, -2.25}).to(torch::kFloat16)));
  EXPECT_TRUE(torch::equal(read.tensors.at("bfloat16"), torch::tensor({0.5, -8.0}).view({2, 1}).to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(read.tensors.at("int64"), torch::tensor({int64_t{-3}, int64_t{1} << 40})));
  EXPECT_TRUE(torch::equal(read.tensors.at("uint8"), torch::tensor({0, 255, 7}).to(torch::kUInt8)));
  EXPECT_TRUE(torch::equal(read.tensors.at("bool"), torch::tensor({true, false, true})));
  EXPECT_EQ(read.tensors.at("scalar").dim(), 0);
  EXPECT_EQ(read.tensors.at("scalar").item<double>(), 3.0);
  EXPECT_EQ(read.tensors.at("empty").sizes(), (std::vector<int64_t>{0, 4}));
}

TEST(Safetensors, WriteIsAtomicAndReadable) {
  ScratchDir dir;
  write_safetensors(dir / "w.safetensors", {{"x", torch::ones({2})}});
  write_safetensors(dir / "w.safetensors", {{"x", torch::zeros({3})}});
  EXPECT_TRUE(torch::equal(read_safetensors(dir / "w.safetensors").tensors.at("x"), torch::zeros({3})));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

TEST(Safetensors, TruncatedFilesAreRefusedAtEveryLength) {
  const std::string bytes = serialize_safetensors({{"a", torch::randn({4, 4})}, {"b", torch::ones({3})}});
  for (size_t length = 0; length < bytes.size(); ++length) {
    EXPECT_THROW(parse_safetensors(std::string_view(bytes).substr(0, length)), FormatError) << length;
  }
  EXPECT_THROW_WITH(parse_safetensors(std::string_view(bytes).substr(0, 5), "t.safetensors"), FormatError,
                    "t.safetensors", "truncated");
  EXPECT_THROW_WITH(parse_safetensors(std::string_view(bytes).substr(0, bytes.size() - 1)), FormatError,
                    "outside the", "truncated file?");
}

TEST(Safetensors, HostileHeadersAreRefusedWithReasons) {
  const std::string four_floats(16, '\0');
  auto parse = [&](const std::string& header, const std::string& data) {
    return parse_safetensors(with_header(header, data), "h.safetensors");
  };
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 32]}}", four_floats),
                    FormatError, "outside the 16 data bytes");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 16]}}", four_floats),
                    FormatError, "holds 16 bytes but its dtype and shape need 12");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                          " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", four_floats),
                    FormatError, "overlaps");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8, 16]}}", four_floats),
                    FormatError, "belong to no tensor");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", four_floats),
                    FormatError, "8 trailing bytes");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [12, 4]}}", four_floats),
                    FormatError, "byte range");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"Q4\", \"shape\": [16], \"data_offsets\": [0, 16]}}", four_floats),
                    FormatError, "unsupported dtype 'Q4'");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"U8\", \"shape\": [-16], \"data_offsets\": [0, 16]}}", four_floats),
                    FormatError, "negative dimension");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"F64\", \"shape\": [4294967296, 4294967296], \"data_offsets\": [0, 16]}}",
                          four_floats), FormatError, "too large");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"U8\", \"shape\": [16], \"data_offsets\": [0, -16]}}", four_floats),
                    FormatError, "'data_offsets' must be two non-negative integers");
  EXPECT_THROW_WITH(parse("{\"a\": {\"dtype\": \"U8\", \"shape\": [16], \"offsets\": [0, 16]}}", four_floats),
                    FormatError, "unknown field 'offsets'");
  EXPECT_THROW_WITH(parse("{\"a\": 3}", ""), FormatError, "not described by an object");
  EXPECT_THROW_WITH(parse("[1, 2]", ""), FormatError, "not a JSON object");
  EXPECT_THROW_WITH(parse("{\"a\": ", ""), FormatError, "not valid JSON");
  EXPECT_THROW_WITH(parse("{\"__metadata__\": {\"k\": 1}}", ""), FormatError, "is not a string");
  EXPECT_THROW_WITH(parse(std::string(100000, '[') + std::string(100000, ']'), ""), FormatError, "nests deeper");

  std::string huge(8, '\0');
  const uint64_t size = kMaxSafetensorsHeaderBytes + 1;
  std::memcpy(huge.data(), &size, 8);
  EXPECT_THROW_WITH(parse_safetensors(huge), FormatError, "exceeds the limit");
}

// Random corruption must end in a FormatError or a successful parse, never a crash.
TEST(Safetensors, SurvivesRandomCorruption) {
  const std::string bytes = serialize_safetensors({{"a", torch::randn({3, 3})}, {"b", torch::arange(4)}},
                                                  {{"k", "v"}});
  std::mt19937 rng(1234);
  int refused = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string corrupt = bytes;
    for (int flips = 1 + static_cast<int>(rng() % 4); flips > 0; --flips) {
      corrupt[rng() % std::min<size_t>(corrupt.size(), 200)] = static_cast<char>(rng());
    }
    try {
      parse_safetensors(corrupt);
    } catch (const FormatError&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 1000);
}

TEST(Safetensors, MissingFileAndUnsupportedDtypeAreReported) {
  EXPECT_THROW_WITH(read_safetensors("/nonexistent.safetensors"), Error, "/nonexistent.safetensors", "cannot open");
  EXPECT_THROW_WITH(serialize_safetensors({{"c", torch::ones({2}, torch::kComplexFloat)}}), FormatError,
                    "cannot hold tensors of dtype");
}

// The path of the file mapped at `address` in this process (/proc/self/maps), or "".
std::string file_mapped_at(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range, permissions, offset, device, inode, path;
    fields >> range >> permissions >> offset >> device >> inode >> path;
    const auto dash = range.find('-');
    if (std::stoull(range.substr(0, dash), nullptr, 16) <= at && at < std::stoull(range.substr(dash + 1), nullptr, 16)) {
      return path;
    }
  }
  return "";
}

TEST(Safetensors, ReadTensorsAreViewsOfTheFileThatWritesNeverReach) {
  testing::ScratchDir dir;
  const std::string path = dir / "weights.safetensors";
  write_safetensors(path, {{"w", torch::arange(1024, torch::kFloat32)}});
  {
    auto read = read_safetensors(path).tensors.at("w");
    EXPECT_EQ(std::filesystem::canonical(file_mapped_at(read.data_ptr())), std::filesystem::canonical(path))
        << "no copy of the checkpoint in memory of its own";
    read.mul_(2);  // the mapping is private: the tensor changes, the file does not
    EXPECT_EQ(read[3].item<float>(), 6.0f);
  }
  EXPECT_TRUE(torch::equal(read_safetensors(path).tensors.at("w"), torch::arange(1024, torch::kFloat32)));
}

// release_pages: a mapped tensor read once leaves the process's memory, and reads its values
// from the file again if read; a parsed (copied) tensor, in memory of its own, is left alone.
TEST(Safetensors, ReleasedPagesLeaveMemoryAndAreReadAgain) {
  testing::ScratchDir dir;
  const std::string path = dir / "large.safetensors";
  const auto values = torch::arange(16 << 20, torch::kFloat32);  // 64 MiB
  write_safetensors(path, {{"w", values}});
  const auto file = read_safetensors(path);
  const auto& mapped = file.tensors.at("w");
  EXPECT_EQ(mapped.sum().item<double>(), values.sum().item<double>());  // every page read
  const int64_t read = testing::resident_file_kb();
  release_pages(mapped.narrow(0, 0, 1));  // less than a page: nothing
  EXPECT_GT(testing::resident_file_kb(), read - 1024);
  release_pages(mapped);
  const int64_t released = testing::resident_file_kb();
  EXPECT_GT(read - released, 48 * 1024) << "most of the 64 MiB left: " << read << " -> " << released << " kB";
  EXPECT_TRUE(torch::equal(mapped, values)) << "read from the file again";
  const auto parsed = parse_safetensors(serialize_safetensors({{"w", torch::arange(4096, torch::kFloat32)}}));
  release_pages(parsed.tensors.at("w"));  // in memory of its own: never dropped
  EXPECT_TRUE(torch::equal(parsed.tensors.at("w"), torch::arange(4096, torch::kFloat32)));
}

TEST(Safetensors, ATensorAtAnOffsetItsTypeCannotBeReadFromIsCopied) {
  testing::ScratchDir dir;
  const std::string path = dir / "packed.safetensors";
  // One int8 byte, then two float32 values starting at byte 1 of the data.
  std::string header = R"({"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t length = header.size();
  const float values[2] = {1.5f, -2.0f};
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << header << char{7};
  out.write(reinterpret_cast<const char*>(values), sizeof values);
  out.close();
  const auto read = read_safetensors(path).tensors;
  EXPECT_EQ(read.at("a").item<int8_t>(), 7);
  EXPECT_TRUE(torch::equal(read.at("b"), torch::tensor({1.5f, -2.0f})));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(read.at("b").data_ptr()) % 4, 0u);
}

// Written one tensor at a time in a declared order (not the names'): the file reads back
// whole; a tensor out of order, of another shape or dtype, or one left unwritten is refused.
TEST(SafetensorsWriter, WritesTensorsInTheDeclaredOrderAndRefusesAnyOther) {
  const auto b = torch::randn({2, 3}), a = torch::arange(5, torch::kInt64);
  std::ostringstream out;
  SafetensorsWriter writer(out, {{"b", torch::kFloat32, {2, 3}}, {"a", torch::kInt64, {5}}}, {{"kind", "test"}});
  EXPECT_THROW_WITH(writer.write("a", a), Error, "got tensor 'a' where 'b' comes next");
  EXPECT_THROW_WITH(writer.write("b", b.t()), Error, "'b' is", "declared Float [2, 3]");
  EXPECT_THROW_WITH(writer.write("b", b.to(torch::kFloat64)), Error, "declared Float");
  EXPECT_THROW_WITH(writer.finish(), Error, "2 declared tensors unwritten, 'b' first");
  writer.write("b", b);
  writer.write("a", a);
  writer.finish();
  EXPECT_THROW_WITH(writer.write("a", a), Error, "every declared tensor was written");
  const auto bytes = out.str();
  const auto file = parse_safetensors(bytes);
  EXPECT_TRUE(torch::equal(file.tensors.at("a"), a));
  EXPECT_TRUE(torch::equal(file.tensors.at("b"), b));
  EXPECT_EQ(file.metadata.at("kind"), "test");
  // b's bytes come first, as declared.
  EXPECT_EQ(std::memcmp(bytes.data() + bytes.size() - 5 * 8 - 6 * 4, b.data_ptr(), 6 * 4), 0);
  std::ostringstream twice;
  EXPECT_THROW_WITH(SafetensorsWriter(twice, {{"a", torch::kInt64, {5}}, {"a", torch::kInt64, {5}}}), FormatError,
                    "'a' is declared twice");
}

// A checkpoint written as it is made appears whole or not at all: a writer that stops early
// (an error while reading what it writes) leaves no directory and replaces nothing.
TEST(SafetensorsWriter, AStreamedCheckpointAppearsOnlyWhenComplete) {
  ScratchDir dir;
  const std::vector<TensorSpec> specs{{"w", torch::kFloat32, {3}}, {"v", torch::kFloat32, {2}}};
  save_checkpoint(dir / "ckpt", "model: {}\n", specs, [](SafetensorsWriter& writer) {
    writer.write("w", torch::ones({3}));
    writer.write("v", torch::zeros({2}));
  });
  const auto written = load_checkpoint(dir / "ckpt");
  EXPECT_TRUE(torch::equal(written.weights.at("w"), torch::ones({3})));
  EXPECT_TRUE(written.state.empty());
  EXPECT_THROW_WITH(save_checkpoint(dir / "ckpt", "model: {}\n", specs,
                                    [](SafetensorsWriter& writer) { writer.write("w", torch::full({3}, 2.0f)); }),
                    Error, "1 declared tensors unwritten, 'v' first");
  EXPECT_TRUE(torch::equal(load_checkpoint(dir / "ckpt").weights.at("w"), torch::ones({3})));
  EXPECT_THROW_WITH(save_checkpoint(dir / "other", "model: {}\n", specs,
                                    [](SafetensorsWriter&) { throw Error("the shards are short"); }),
                    Error, "the shards are short");
  EXPECT_FALSE(std::filesystem::exists(dir / "other"));
}

}  // namespace
}  // namespace dalle::io
