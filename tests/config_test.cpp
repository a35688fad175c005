#include "dalle/config.h"

#include "test_support.h"

namespace dalle {
namespace {

using testing::ScratchDir;

struct OptimizerSection {
  double learning_rate = 1e-4;
  std::vector<int64_t> betas_permille = {900, 999};
  std::vector<double> decays = {0.9, 0.99};
  void visit(ConfigVisitor& v) {
    v.field("learning_rate", learning_rate, "peak learning rate", {.min = 0.0, .max = 1.0});
    v.field("betas_permille", betas_permille, "Adam betas x 1000", {.min = 0, .max = 1000});
    v.field("decays", decays, "moving average decays", {.min = 0.0, .max = 1.0});
  }
};

struct ExampleConfig {
  int64_t layers = 2;
  bool fp16 = false;
  std::string attention = "row";
  std::vector<std::string> captions = {"a", "b"};
  OptimizerSection optimizer;
  void visit(ConfigVisitor& v) {
    v.field("layers", layers, "number of layers", {.min = 1, .max = 64});
    v.field("fp16", fp16, "train in fp16");
    v.field("attention", attention, "attention mask", {.choices = {"row", "column", "conv"}});
    v.field("captions", captions, "validation captions");
    v.section("optimizer", "the optimizer", optimizer);
    v.moved("learning_rate", "optimizer.learning_rate");
  }
};

ExampleConfig parse(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  auto source = ConfigSource::from_string(yaml, "test.yaml");
  source.set_all(sets);
  return load_config<ExampleConfig>(source);
}

TEST(Config, EmptyDocumentKeepsDefaults) {
  const auto config = parse("");
  EXPECT_EQ(config.layers, 2);
  EXPECT_EQ(config.attention, "row");
  EXPECT_DOUBLE_EQ(config.optimizer.learning_rate, 1e-4);
}

TEST(Config, ReadsEveryFieldType) {
  const auto config = parse(
      "layers: 12\nfp16: true\nattention: conv\ncaptions: [x, y, z]\n"
      "optimizer:\n  learning_rate: 4.5e-4\n  betas_permille: [900, 960]\n  decays: [0.5, 1, 0.25]\n");
  EXPECT_EQ(config.layers, 12);
  EXPECT_TRUE(config.fp16);
  EXPECT_EQ(config.attention, "conv");
  EXPECT_EQ(config.captions, (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_DOUBLE_EQ(config.optimizer.learning_rate, 4.5e-4);
  EXPECT_EQ(config.optimizer.betas_permille, (std::vector<int64_t>{900, 960}));
  EXPECT_EQ(config.optimizer.decays, (std::vector<double>{0.5, 1.0, 0.25}));
}

TEST(Config, UnknownKeyIsRefusedWithLineAndSuggestion) {
  EXPECT_THROW_WITH(parse("layers: 3\nlayres: 4\n"), ConfigError, "test.yaml:2:1",
                    "unknown key 'layres'", "did you mean 'layers'");
}

TEST(Config, MisspeltNestedKeyNamesItsPath) {
  EXPECT_THROW_WITH(parse("optimizer:\n  learning_rat: 0.1\n"), ConfigError, "test.yaml:2:3",
                    "'optimizer.learning_rat'", "did you mean 'optimizer.learning_rate'");
}

TEST(Config, UnknownKeyWithoutCloseMatchListsKnownKeys) {
  EXPECT_THROW_WITH(parse("completely_different: 1\n"), ConfigError, "known keys here:", "layers");
}

TEST(Config, WrongTypeIsRefused) {
  EXPECT_THROW_WITH(parse("\nlayers: many\n"), ConfigError, "test.yaml:2:9", "layers: expected an integer",
                    "'many'");
  EXPECT_THROW_WITH(parse("layers: 2.5\n"), ConfigError, "expected an integer");
  EXPECT_THROW_WITH(parse("fp16: maybe\n"), ConfigError, "fp16: expected a boolean");
  EXPECT_THROW_WITH(parse("captions: just-one\n"), ConfigError, "captions: expected a list of strings");
  EXPECT_THROW_WITH(parse("optimizer: 3\n"), ConfigError, "optimizer: expected a section");
  EXPECT_THROW_WITH(parse("optimizer: {decays: [0.5, x]}\n"), ConfigError,
                    "optimizer.decays: expected a list of numbers");
  EXPECT_THROW_WITH(parse("optimizer: {decays: 0.5}\n"), ConfigError, "expected a list of numbers");
  EXPECT_THROW_WITH(parse("layers: [1, 2]\n"), ConfigError, "layers: expected an integer");
  EXPECT_THROW_WITH(parse("optimizer: {learning_rate: .nan}\n"), ConfigError, "expected a finite number");
  EXPECT_THROW_WITH(parse("optimizer: {learning_rate: .inf}\n"), ConfigError, "expected a finite number");
}

TEST(Config, OutOfRangeAndDisallowedChoiceAreRefused) {
  EXPECT_THROW_WITH(parse("layers: 65\n"), ConfigError, "layers: 65 is out of range", "in [1, 64]");
  EXPECT_THROW_WITH(parse("optimizer: {betas_permille: [900, 1001]}\n"), ConfigError,
                    "optimizer.betas_permille: 1001 is out of range");
  EXPECT_THROW_WITH(parse("optimizer: {decays: [0.5, 1.5]}\n"), ConfigError, "optimizer.decays: 1.5 is out of range");
  EXPECT_THROW_WITH(parse("attention: diagonal\n"), ConfigError, "'diagonal' is not allowed",
                    "one of 'row' 'column' 'conv'");
}

TEST(Config, AMovedKeyIsRefusedWithItsNewPlace) {
  EXPECT_THROW_WITH(parse("layers: 3\nlearning_rate: 0.1\n"), ConfigError, "test.yaml:2:",
                    "'learning_rate' has moved to 'optimizer.learning_rate'");
  EXPECT_THROW_WITH(parse("", {"learning_rate=0.1"}), ConfigError, "--set learning_rate=0.1",
                    "has moved to 'optimizer.learning_rate'");
  EXPECT_EQ(parse("optimizer: {learning_rate: 0.1}\n").optimizer.learning_rate, 0.1);
}

TEST(Config, PartsOfALargerDocumentBindAndAnEmptyRequiredSectionIsRefused) {
  ExampleConfig config;
  const auto read_optimizer = [&config](ConfigVisitor& v) { v.section("optimizer", "", config.optimizer); };
  bind_config_parts(ConfigSource::from_string("optimizer: {learning_rate: 0.5}\nother: 1\n", "run.yaml"),
                    read_optimizer, {"optimizer"});
  EXPECT_EQ(config.optimizer.learning_rate, 0.5) << "keys outside the parts read are left alone";
  EXPECT_THROW_WITH(bind_config_parts(ConfigSource::from_string("optimizer: {learning_rat: 0.5}\n", "run.yaml"),
                                      read_optimizer, {"optimizer"}),
                    ConfigError, "unknown key 'optimizer.learning_rat'");
  for (const char* empty : {"", "other: 1\n", "optimizer:\n", "optimizer: {}\n"}) {
    SCOPED_TRACE(empty);
    EXPECT_THROW_WITH(bind_config_parts(ConfigSource::from_string(empty, "run.yaml"), read_optimizer, {"optimizer"}),
                      ConfigError, "run.yaml: 'optimizer' is missing or empty");
  }
  const auto source = ConfigSource::from_string("data: {image_size: 64, train: x}\n", "run.yaml");
  EXPECT_EQ(peek_integer(source, "data.image_size", 256, {.min = 8}), 64);
  EXPECT_EQ(peek_integer(source, "data.batch_size", 8), 8);
  EXPECT_EQ(peek_integer(source, "model.side", 3), 3);
  EXPECT_TRUE(names_key(source, "data.image_size"));
  EXPECT_FALSE(names_key(source, "data.batch_size"));
  EXPECT_FALSE(names_key(source, "model.side"));
  EXPECT_FALSE(names_key(ConfigSource::from_string("model:\n", "run.yaml"), "model"));
  EXPECT_THROW_WITH(peek_integer(source, "data.image_size", 256, {.max = 32}), ConfigError, "data.image_size");
}

TEST(Config, YamlSyntaxErrorNamesFileAndLine) {
  EXPECT_THROW_WITH(parse("layers: 3\noptimizer: [unclosed\n"), ConfigError, "test.yaml:", "YAML syntax error");
  EXPECT_THROW_WITH(parse("- a list\n- at the top\n"), ConfigError, "must be a mapping");
}

TEST(Config, ADuplicateKeyIsRefusedWithBothLines) {
  EXPECT_THROW_WITH(parse("layers: 4\nfp16: true\nlayers: 8\n"), ConfigError, "test.yaml:3:",
                    "key 'layers' is given twice (lines 1 and 3)");
  EXPECT_THROW_WITH(parse("optimizer:\n  learning_rate: 0.1\nlayers: 2\noptimizer:\n  decays: [0.5]\n"),
                    ConfigError, "test.yaml:4:", "key 'optimizer' is given twice (lines 1 and 4)");
  EXPECT_THROW_WITH(parse("optimizer: {decays: [0.5], decays: [0.25]}\n"), ConfigError,
                    "key 'optimizer.decays' is given twice");
  ScratchDir dir;
  testing::write_text(dir / "twice.yaml", "layers: 2\nlayers: 3\n");
  EXPECT_THROW_WITH(ConfigSource::from_file(dir / "twice.yaml"), ConfigError, "twice.yaml:2:",
                    "key 'layers' is given twice (lines 1 and 2)");
}

// Nested aliases ("billion laughs"): each level names the one before ten times, 10^9 values
// in all. The document is checked once per node and refused at once, as are aliases that
// repeat a section a few times (kept) and an alias inside the section it names (a cycle).
TEST(Config, NestedAliasesAreRefusedAtOnceAndAFewAreRead) {
  std::string bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n";
  for (char level = 'b'; level <= 'j'; ++level) {
    const std::string before(1, static_cast<char>(level - 1));
    bomb += std::string(1, level) + ": &" + std::string(1, level) + " [";
    for (int i = 0; i < 10; ++i) bomb += (i ? ", *" : "*") + before;
    bomb += "]\n";
  }
  EXPECT_THROW_WITH(parse(bomb), ConfigError, "test.yaml: its aliases expand to over 1000000 values");
  const auto twice = parse("attention: &mask column\ncaptions: [*mask, *mask]\n");
  EXPECT_EQ(twice.captions, (std::vector<std::string>{"column", "column"}));
  EXPECT_THROW_WITH(parse("captions: &c [p, *c]\n"), ConfigError, "test.yaml:1:", "a cycle");
  EXPECT_THROW_WITH(parse("optimizer: {decays: [0.5], decays: &d [0.25]}\nlayers: *d\n"), ConfigError,
                    "key 'optimizer.decays' is given twice");
}

// One spelling of a dtype in every recipe (torch's names); the short names of older recipes
// load as the new ones (with a warning), where the key allows the type.
TEST(Config, OlderDtypeSpellingsReadAsTorchsNames) {
  struct Recipe {
    std::string mode = "float32", moments = "float32";
    std::vector<std::string> list;
    void visit(ConfigVisitor& v) {
      v.field("mode", mode, "", dtype_choices({"float32", "bfloat16", "float16"}));
      v.field("moments", moments, "", dtype_choices({"float32", "bfloat16"}));
      v.field("list", list, "", dtype_choices({"float32", "bfloat16", "float16", "int8"}));
    }
  };
  const auto read = [](const std::string& yaml) { return load_config<Recipe>(ConfigSource::from_string(yaml, "r.yaml")); };
  const auto old = read("mode: fp16\nmoments: bf16\nlist: [fp32, int8, bfloat16]\n");
  EXPECT_EQ(old.mode, "float16");
  EXPECT_EQ(old.moments, "bfloat16");
  EXPECT_EQ(old.list, (std::vector<std::string>{"float32", "int8", "bfloat16"}));
  EXPECT_EQ(read("mode: bfloat16\n").mode, "bfloat16");
  EXPECT_THROW_WITH(read("moments: fp16\n"), ConfigError, "r.yaml:1:", "'fp16' is not allowed",
                    "one of 'float32' 'bfloat16'");
  EXPECT_THROW_WITH(read("mode: int8\n"), ConfigError, "'int8' is not allowed");
}

TEST(Config, MissingFileIsReported) {
  EXPECT_THROW_WITH(ConfigSource::from_file("/nonexistent/config.yaml"), ConfigError,
                    "/nonexistent/config.yaml", "cannot read");
}

TEST(Config, SetOverridesFileValuesAndCreatesSections) {
  const auto config = parse("layers: 3\n", {"layers=5", "optimizer.learning_rate=0.5", "captions=[p, q]"});
  EXPECT_EQ(config.layers, 5);
  EXPECT_DOUBLE_EQ(config.optimizer.learning_rate, 0.5);
  EXPECT_EQ(config.captions, (std::vector<std::string>{"p", "q"}));
}

TEST(Config, BadOverridesNameTheOverride) {
  EXPECT_THROW_WITH(parse("", {"optimizer.learnin_rate=0.1"}), ConfigError,
                    "--set optimizer.learnin_rate=0.1", "unknown key");
  EXPECT_THROW_WITH(parse("", {"layers=lots"}), ConfigError, "--set layers=lots", "expected an integer");
  EXPECT_THROW_WITH(parse("", {"layers"}), ConfigError, "expected key.path=value");
  EXPECT_THROW_WITH(parse("layers: 3\n", {"layers.deeper=1"}), ConfigError, "'layers' is not a section");
  EXPECT_THROW_WITH(parse("", {"layers.deeper=1"}), ConfigError, "--set layers.deeper=1: layers: expected an integer");
  EXPECT_THROW_WITH(parse("", {"a..b=1"}), ConfigError, "empty key");
}

TEST(Config, ReplaceRewritesExistingKeysOfTheSameKindOnly) {
  ExampleConfig defaults;
  auto source = ConfigSource::from_string(config_to_yaml(visit_of(defaults)), "run/config.yaml");
  source.replace("layers=12");
  source.replace("optimizer.learning_rate=1");  // an integer is a number
  source.replace("attention=conv");
  source.replace("captions=[x]");
  source.replace("fp16=True");  // as the reader of --set spells a flag
  const auto config = load_config<ExampleConfig>(ConfigSource::from_string(source.yaml()));
  EXPECT_EQ(config.layers, 12);
  EXPECT_EQ(config.optimizer.learning_rate, 1.0);
  EXPECT_EQ(config.attention, "conv");
  EXPECT_EQ(config.captions, std::vector<std::string>{"x"});
  EXPECT_TRUE(config.fp16);
  EXPECT_THAT(source.yaml(), ::testing::HasSubstr("fp16: true"));

  EXPECT_THROW_WITH(source.replace("optimizer.learnin_rate=0.1"), ConfigError, "run/config.yaml has no key",
                    "'optimizer.learnin_rate'");
  EXPECT_THROW_WITH(source.replace("layers.deeper=1"), ConfigError, "has no key 'layers.deeper'");
  EXPECT_THROW_WITH(source.replace("layers=2.5"), ConfigError, "'layers' as an integer, and the new value is a number");
  EXPECT_THROW_WITH(source.replace("optimizer.learning_rate=fast"), ConfigError, "as a number", "is text");
  EXPECT_THROW_WITH(source.replace("fp16=1"), ConfigError, "'fp16' as true or false", "is an integer");
  EXPECT_THROW_WITH(source.replace("captions=x"), ConfigError, "'captions' as a list");
  EXPECT_THROW_WITH(source.replace("optimizer=3"), ConfigError, "'optimizer' as a section");
  EXPECT_THROW_WITH(source.replace("attention={a: 1}"), ConfigError, "as text, and the new value is a section");
  EXPECT_THROW_WITH(source.replace("layers"), ConfigError, "expected key.path=value");
  EXPECT_THAT(source.yaml(), ::testing::HasSubstr("learning_rate: 1.0"));
  EXPECT_EQ(load_config<ExampleConfig>(ConfigSource::from_string(source.yaml())).layers, 12);  // refusals change nothing
}

TEST(Config, YamlRoundTripPreservesEveryValue) {
  auto original = parse("layers: 7\nfp16: true\nattention: column\ncaptions: ['a: colon', \"quote\\\"d\"]\n"
                        "optimizer: {learning_rate: 0.1, betas_permille: [1, 2, 3], decays: [0.1, 0.995]}\n");
  const std::string yaml = config_to_yaml(visit_of(original));
  const auto copy = load_config<ExampleConfig>(ConfigSource::from_string(yaml));
  EXPECT_EQ(copy.layers, 7);
  EXPECT_TRUE(copy.fp16);
  EXPECT_EQ(copy.attention, "column");
  EXPECT_EQ(copy.captions, original.captions);
  EXPECT_EQ(copy.optimizer.learning_rate, 0.1);  // exact: doubles are written round-trippable
  EXPECT_EQ(copy.optimizer.betas_permille, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(copy.optimizer.decays, (std::vector<double>{0.1, 0.995}));
}

TEST(Config, SaveConfigWritesTheEffectiveConfig) {
  ScratchDir dir;
  auto config = parse("layers: 9\n", {"optimizer.learning_rate=0.25"});
  save_config(dir / "config.yaml", visit_of(config));
  const auto reread = load_config<ExampleConfig>(ConfigSource::from_file(dir / "config.yaml"));
  EXPECT_EQ(reread.layers, 9);
  EXPECT_EQ(reread.optimizer.learning_rate, 0.25);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1) << "a temporary was left";
}

// A recipe that changes a few keys of another names it as `base`, relative to itself; its
// own keys win, sections merge key by key, a list replaces the base's whole, --set wins last.
TEST(Config, BaseFilesMergeUnderTheOwnKeysAndSetWinsLast) {
  ScratchDir dir;
  std::filesystem::create_directories(dir / "recipes/variants");
  testing::write_text(dir / "recipes/grand.yaml", "layers: 3\nattention: conv\ncaptions: [a, b]\nfp16: true\n");
  testing::write_text(dir / "recipes/parent.yaml",
                      "base: grand.yaml\nlayers: 4\noptimizer:\n  learning_rate: 0.2\n  decays: [0.1]\n");
  testing::write_text(dir / "recipes/variants/child.yaml",
                      "base: ../parent.yaml\noptimizer:\n  learning_rate: 0.3\ncaptions: [x]\n");
  auto source = ConfigSource::from_file(dir / "recipes/variants/child.yaml");
  auto config = load_config<ExampleConfig>(source);
  EXPECT_EQ(config.layers, 4);
  EXPECT_EQ(config.attention, "conv");
  EXPECT_TRUE(config.fp16);
  EXPECT_DOUBLE_EQ(config.optimizer.learning_rate, 0.3);
  EXPECT_EQ(config.optimizer.decays, (std::vector<double>{0.1}));
  EXPECT_EQ(config.captions, (std::vector<std::string>{"x"}));
  source.set("layers=6");
  EXPECT_EQ(load_config<ExampleConfig>(source).layers, 6);
  EXPECT_FALSE(names_key(source, "base")) << "base is resolved, not a key of the config";

  testing::write_text(dir / "recipes/empty.yaml", "");
  testing::write_text(dir / "recipes/on-empty.yaml", "base: empty.yaml\nlayers: 5\n");
  EXPECT_EQ(load_config<ExampleConfig>(ConfigSource::from_file(dir / "recipes/on-empty.yaml")).layers, 5);
}

TEST(Config, BaseFileErrorsNameTheFileThatGaveTheKey) {
  ScratchDir dir;
  testing::write_text(dir / "base.yaml", "layers: 3\nlayres: 4\n");
  testing::write_text(dir / "child.yaml", "base: base.yaml\nfp16: true\n");
  EXPECT_THROW_WITH(load_config<ExampleConfig>(ConfigSource::from_file(dir / "child.yaml")), ConfigError,
                    std::string(dir / "base.yaml:2:1"), std::string("unknown key 'layres'"));
  testing::write_text(dir / "base.yaml", "optimizer:\n  decays: [2]\n");
  testing::write_text(dir / "child.yaml", "base: base.yaml\nfp16: true\noptimizer:\n  learning_rate: 0.1\n");
  EXPECT_THROW_WITH(load_config<ExampleConfig>(ConfigSource::from_file(dir / "child.yaml")), ConfigError,
                    std::string(dir / "base.yaml:2:"), std::string("optimizer.decays"));
  testing::write_text(dir / "child.yaml", "base: base.yaml\nlayers: 0\n");
  EXPECT_THROW_WITH(load_config<ExampleConfig>(ConfigSource::from_file(dir / "child.yaml")), ConfigError,
                    std::string(dir / "child.yaml:2:"), std::string("layers"));

  testing::write_text(dir / "child.yaml", "base: missing.yaml\n");
  EXPECT_THROW_WITH(ConfigSource::from_file(dir / "child.yaml"), ConfigError, "missing.yaml", "cannot read");
  testing::write_text(dir / "child.yaml", "base: [a, b]\n");
  EXPECT_THROW_WITH(ConfigSource::from_file(dir / "child.yaml"), ConfigError, "child.yaml:1",
                    "base: expected the path of a config file");
  testing::write_text(dir / "a.yaml", "base: b.yaml\n");
  testing::write_text(dir / "b.yaml", "base: ./a.yaml\n");
  EXPECT_THROW_WITH(ConfigSource::from_file(dir / "a.yaml"), ConfigError, "a cycle");
}

TEST(Config, ReferenceListsEveryKeyWithDefaultsAndLimits) {
  ExampleConfig config;
  const std::string reference = config_reference(visit_of(config));
  for (const char* expected : {"`layers` | int | `2` | in [1, 64] | number of layers",
                               "`optimizer.learning_rate`", "`optimizer.betas_permille`",
                               "`optimizer.decays` | list of float | `[0.9, 0.99]`",
                               "one of 'row' 'column' 'conv'", "`fp16` | bool | `false`"}) {
    EXPECT_THAT(reference, ::testing::HasSubstr(expected));
  }
}

}  // namespace
}  // namespace dalle
