#include <filesystem>

#include "dalle/error.h"
#include "dalle/generate/pipeline.h"

#include "dalle/models/adapter.h"

namespace dalle::generate {

namespace fs = std::filesystem;

void SamplingSchedule::visit(ConfigVisitor& v) {
  v.field("top_k", top_k,
          "top_k of each stage (ruDALL-E: 2048, 1536, 1024, 1024, 512, 384, 256, 128); empty: no schedule",
          {.min = 0});
  v.field("top_p", top_p, "top_p of each stage, as many as top_k (ruDALL-E: 0.995, 0.99, 0.99, 0.98, 0.97, 0.96, "
          "0.95, 0.95)", {.min = 1e-6, .max = 1.0});
}

int64_t SamplingSchedule::stage_of(int64_t candidate, int64_t candidates) const {
  return stages() == 0 ? 0 : candidate * stages() / candidates;
}

models::SamplingOptions SamplingSchedule::options(int64_t stage, const models::SamplingOptions& sampling) const {
  auto options = sampling;
  if (stages() == 0) return options;
  options.top_k = top_k.at(static_cast<size_t>(stage));
  options.top_p = top_p.at(static_cast<size_t>(stage));
  return options;
}

void PipelineConfig::visit(ConfigVisitor& v) {
  v.field("prior", prior,
          "prior run directory or checkpoint (required): the sparse transformer, or DALL-E Mega / Mini's BART "
          "prior (kind bart_prior)");
  v.field("tokenizer", tokenizer,
          "caption tokenizer model: ours (SentencePiece) or ruDALL-E's YouTokenToMe bpe.model, told apart by "
          "content; for a BART prior, a folder with min-dalle's vocab.json and merges.txt; empty: the one the "
          "prior was trained with");
  v.field("decoder", decoder,
          "dVAE or VQGAN run or checkpoint (for a BART prior, min-dalle's VQGAN detokenizer); empty: the prior's "
          "image tokenizer");
  v.field("encoder", encoder,
          "dVAE or VQGAN run or checkpoint that turns image prompts into the prior's tokens (for a BART prior, "
          "dalle-mini's VQGAN: scripts/import-model mega --vqgan); empty: the decoder, or none for a BART prior, "
          "whose detokenizer cannot encode");
  v.field("clip", clip,
          "CLIP run or checkpoint that reranks the candidates, trained by dalle-train-clip with the caption "
          "tokenizer; empty: no reranking");
  v.field("clip_tokenizer", clip_tokenizer,
          "the imported CLIP's own tokenizer, told apart by content: CLIP's BPE merges file "
          "(bpe_simple_vocab_16e6.txt.gz, from OpenAI CLIP or open_clip) for weights exported by "
          "scripts/export_open_clip.py, or ruCLIP's YouTokenToMe bpe.model for scripts/export_ruclip.py's; empty: "
          "CLIP reads the caption tokenizer's ids");
  v.field("clip_templates", clip_templates,
          "renderings of the prompt CLIP scores the candidates against, each with {} where the prompt goes "
          "(lower-cased and stripped); the caption's text feature is the mean of theirs, as ruclip's Predictor makes "
          "it for ruDALL-E's cherry_pick_by_ruclip (its six: {}, фото, на котором изображено {}, изображение с {}, "
          "картинка с {}, фото с {}, на фото видно {}). Needs clip_tokenizer; empty: the prompt alone");
  v.field("superres", superres, "RRDBNet run or checkpoint that upscales the kept images; empty: none");
  v.field("adapters", adapters,
          "low-rank adapter files (dalle-export --adapter) folded into the prior's weights when it loads, in order, "
          "each \"FILE\" or \"FILE:WEIGHT\" (weight 1: as trained; 0.5: half its effect); sampling is then as "
          "fast as the prior's own");
  v.field("named_adapters", named_adapters,
          "adapters a request may choose by name (dalle-serve's --adapter NAME=FILE, its requests' `adapters`), each "
          "\"NAME=FILE\": loaded at start, folded (after `adapters`) into the prior for the batches of the requests "
          "that choose them and taken out for the others; the prior's layers they touch are kept once more in "
          "host memory. Not with dtype int8");
  v.field("candidates", candidates, "images sampled per prompt (N; DALL-E: 512, most of the gain by 32)",
          {.min = 1, .max = 65536});
  v.field("keep", keep, "images kept per prompt, the best K by CLIP score (0: all N; needs clip when below N)",
          {.min = 0, .max = 65536});
  v.field("batch_size", batch_size, "images sampled at once", {.min = 1, .max = 65536});
  v.field("dtype", dtype,
          "the prior's weights and arithmetic: float32, or 16 bits at half the memory (bfloat16 has float32's "
          "range and fast CPU kernels; float16 is for GPUs), or int8 on the CPU: its matrices' weights in 8 bits "
          "with a scale per output channel, a quarter of the memory, activations in float32 (FBGEMM); the other "
          "models stay float32",
          dtype_choices({"float32", "bfloat16", "float16", "int8"}));
  v.section("sampling", "sampling from the prior", sampling);
  v.section("schedule",
            "ruDALL-E's stages: each prompt's candidates split evenly between (top_k, top_p) pairs, in order, "
            "replacing sampling.top_k and sampling.top_p",
            schedule);
  v.section("image_prompt", "an image whose top rows or masked cells every sample keeps (\"continue this picture\")",
            image_prompt);
  v.field("tile", tile, "super-resolution tile side in input pixels (0: whole images at once)", {.min = 0});
  v.field("tile_overlap", tile_overlap, "pixels each super-resolution tile overlaps its neighbours by", {.min = 0});
  v.field("device", device, "where the models run", {.choices = {"auto", "cpu", "cuda"}});
  v.field("threads", threads, "torch intra-op threads (0: one per idle core)", {.min = 0, .max = 1024});
  v.field("cuda_graphs", cuda_graphs,
          "on a GPU, replay each decoding step of the prior from a CUDA graph, captured once per batch size and "
          "attention length (a multiple of 64 cache slots): one launch per step instead of hundreds of kernels. "
          "It keeps the last batch size's KV cache allocated between calls; false launches each step's kernels "
          "one by one (the same tokens). No effect on the CPU");
}

PipelineConfig read_model_folder(const std::string& folder) {
  const auto file = fs::path(folder) / kModelFolderConfig;
  if (!fs::is_regular_file(file)) {
    throw Error(folder + ": not a model folder (it has no " + kModelFolderConfig + ", the pipeline config)");
  }
  auto config = load_config<PipelineConfig>(ConfigSource::from_file(file.string()));
  for (auto* path : {&config.prior, &config.tokenizer, &config.decoder, &config.encoder, &config.clip,
                     &config.clip_tokenizer, &config.superres}) {
    if (!path->empty() && fs::path(*path).is_relative()) *path = (fs::path(folder) / *path).string();
  }
  for (auto& spec : config.adapters) {
    const auto weighted = models::parse_weighted_adapter(spec);
    if (fs::path(weighted.path).is_relative()) {
      spec = (fs::path(folder) / weighted.path).string() + (spec.size() > weighted.path.size() ? spec.substr(weighted.path.size()) : "");
    }
  }
  for (auto& spec : config.named_adapters) {
    const auto named = models::parse_named_adapter(spec);
    if (fs::path(named.path).is_relative()) spec = named.name + "=" + (fs::path(folder) / named.path).string();
  }
  return config;
}

}  // namespace dalle::generate
