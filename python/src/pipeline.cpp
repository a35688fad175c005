// dalle._dalle.Pipeline: generate::Pipeline for Python. A call's own settings are keyword
// arguments (none: the config's); images come back as torch tensors without a copy, with the
// settings they were drawn with, which write their PNG and metadata as dalle-generate does.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <filesystem>
#include <mutex>
#include <optional>

#include "bindings.h"
#include "dalle/error.h"
#include "dalle/generate/pipeline.h"

namespace py = pybind11;

namespace dalle::python {
namespace {

// A pipeline and the lock that keeps two Python threads from generating with it at once
// (generate::Pipeline::generate is not safe to call concurrently).
struct PythonPipeline {
  explicit PythonPipeline(generate::PipelineConfig config) : pipeline(std::move(config)) {}
  generate::Pipeline pipeline;
  std::mutex generating;
};

// A model folder's generate.yaml or a pipeline config file, with the overrides.
generate::PipelineConfig pipeline_config(const std::string& model_or_config,
                                         const std::vector<std::string>& overrides) {
  if (!std::filesystem::is_directory(model_or_config)) {
    return load_config<generate::PipelineConfig>(config_source(model_or_config, overrides));
  }
  auto folder = generate::read_model_folder(model_or_config);
  auto source = ConfigSource::from_string(config_to_yaml(visit_of(folder)),
                                          model_or_config + "/" + generate::kModelFolderConfig);
  source.set_all(overrides);
  return load_config<generate::PipelineConfig>(source);
}

// The settings of one generate call, as its keyword arguments give them; empty: the config's.
struct CallSettings {
  std::optional<int64_t> keep, candidates, seed, top_k;
  std::optional<double> temperature, top_p, guidance_scale;
  std::optional<bool> superres;
  std::map<std::string, double> adapters;
  std::optional<torch::Tensor> image_prompt;
  int64_t image_prompt_rows = 0;
  int64_t preview_every = 0, preview_candidates = 0;

  void apply(generate::PromptRequest& request, const std::shared_ptr<const generate::PromptImage>& image) const {
    if (candidates) request.candidates = *candidates;
    if (keep) request.keep = *keep;
    if (seed) request.sampling.seed = *seed;
    if (temperature) request.sampling.temperature = *temperature;
    if (guidance_scale) request.sampling.guidance_scale = *guidance_scale;
    if (top_k || top_p) request.schedule = {};  // as dalle-generate's --top-k
    if (top_k) request.sampling.top_k = *top_k;
    if (top_p) request.sampling.top_p = *top_p;
    if (superres) request.superres = *superres;
    for (const auto& [name, weight] : adapters) request.adapters.push_back({name, weight});
    request.image_prompt = image;
    request.preview_every = preview_every;
    request.preview_candidates = preview_candidates;
  }
};

py::dict preview_dict(const generate::Preview& preview) {
  py::dict out;
  out["request"] = preview.request;
  out["candidate"] = preview.candidate;
  out["drawn"] = preview.drawn;
  out["total"] = preview.total;
  out["tokens"] = preview.tokens;
  out["image"] = preview.image;
  return out;
}

// For each prompt, the settings its images were drawn with and its images, best first.
using Generated = std::vector<std::pair<generate::PipelineConfig, std::vector<generate::GeneratedImage>>>;

Generated generate_images(PythonPipeline& self, const std::vector<std::string>& prompts, const CallSettings& settings,
                          const std::function<void(py::list)>& on_preview) {
  if (prompts.empty()) throw Error("generate: no prompts");
  std::shared_ptr<const generate::PromptImage> image;
  if (settings.image_prompt) {
    image = std::make_shared<const generate::PromptImage>(
        generate::PromptImage{.image = settings.image_prompt->detach().to(torch::kCPU, torch::kFloat32),
                              .top_rows = settings.image_prompt_rows});
  }
  std::vector<generate::PreparedRequest> requests;
  for (size_t index = 0; index < prompts.size(); ++index) {
    const auto own_settings = [&](generate::PromptRequest& request) { settings.apply(request, image); };
    requests.push_back(self.pipeline.prepare(prompts[index], static_cast<int64_t>(index), own_settings));
  }
  // Previews reach Python with the GIL taken; an exception of the callable stops its calls and
  // is raised once the images are drawn.
  std::optional<py::error_already_set> failed;
  generate::PreviewCallback previews;
  if (on_preview) {
    previews = [&](const std::vector<generate::Preview>& shown) {
      py::gil_scoped_acquire gil;
      if (failed) return;
      try {
        py::list list;
        for (const auto& preview : shown) list.append(preview_dict(preview));
        on_preview(list);
      } catch (py::error_already_set& error) {
        failed.emplace(std::move(error));
      }
    };
  }
  std::vector<generate::GeneratedImage> images;
  {
    py::gil_scoped_release release;
    std::lock_guard lock(self.generating);
    images = self.pipeline.generate(requests, previews);
  }
  if (failed) throw std::move(*failed);
  Generated out;
  for (const auto& request : requests) out.push_back({request.settings(), {}});
  for (auto& image : images) out[static_cast<size_t>(image.request)].second.push_back(std::move(image));
  return out;
}

}  // namespace

void add_pipeline(py::module_& module) {
  py::class_<generate::GeneratedImage>(module, "GeneratedImage", "One image of a generate call (see dalle.Image).")
      .def_readonly("prompt", &generate::GeneratedImage::prompt)
      .def_readonly("prompt_index", &generate::GeneratedImage::prompt_index)
      .def_readonly("candidate", &generate::GeneratedImage::candidate)
      .def_readonly("rank", &generate::GeneratedImage::rank)
      .def_readonly("seed", &generate::GeneratedImage::seed)
      .def_readonly("top_k", &generate::GeneratedImage::top_k)
      .def_readonly("top_p", &generate::GeneratedImage::top_p)
      .def_readonly("tokens", &generate::GeneratedImage::tokens)
      .def_readonly("image", &generate::GeneratedImage::image)
      .def_readonly("clip_score", &generate::GeneratedImage::clip_score);

  py::class_<generate::PipelineConfig>(module, "PipelineSettings",
                                       "A pipeline's settings as a request changed them (what a PNG records).")
      .def("items", [](generate::PipelineConfig& config) { return flatten_config(visit_of(config)); })
      .def("yaml", [](generate::PipelineConfig& config) { return config_to_yaml(visit_of(config)); })
      .def("metadata", &generate::image_metadata, py::arg("image"))
      .def("png", [](const generate::PipelineConfig& config, const generate::GeneratedImage& image) {
        return py::bytes(generate::encode_generated_png(config, image));
      }, py::arg("image"));

  py::class_<PythonPipeline>(module, "Pipeline", "generate::Pipeline (see dalle.Pipeline).")
      .def(py::init([](const std::string& model_or_config, const std::vector<std::string>& overrides) {
             auto config = pipeline_config(model_or_config, overrides);
             py::gil_scoped_release release;  // loading takes a while: other Python threads run
             return std::make_unique<PythonPipeline>(std::move(config));
           }),
           py::arg("model_or_config"), py::arg("overrides"))
      .def_property_readonly("settings", [](const PythonPipeline& self) { return self.pipeline.config(); })
      .def("image_size", [](const PythonPipeline& self, bool superres) { return self.pipeline.image_size(superres); },
           py::arg("superres"))
      .def("image_tokens", [](const PythonPipeline& self) { return self.pipeline.image_tokens(); })
      .def(
          "generate",
          [](PythonPipeline& self, const std::vector<std::string>& prompts, std::optional<int64_t> keep,
             std::optional<int64_t> candidates, std::optional<int64_t> seed, std::optional<double> temperature,
             std::optional<int64_t> top_k, std::optional<double> top_p, std::optional<double> guidance_scale,
             std::optional<bool> superres, std::map<std::string, double> adapters,
             std::optional<torch::Tensor> image_prompt, int64_t image_prompt_rows, int64_t preview_every,
             int64_t preview_candidates, const std::function<void(py::list)>& on_preview) {
            const CallSettings settings{.keep = keep, .candidates = candidates, .seed = seed, .top_k = top_k,
                                        .temperature = temperature, .top_p = top_p,
                                        .guidance_scale = guidance_scale, .superres = superres,
                                        .adapters = std::move(adapters), .image_prompt = std::move(image_prompt),
                                        .image_prompt_rows = image_prompt_rows, .preview_every = preview_every,
                                        .preview_candidates = preview_candidates};
            return generate_images(self, prompts, settings, on_preview);
          },
          py::arg("prompts"), py::arg("keep") = py::none(), py::arg("candidates") = py::none(),
          py::arg("seed") = py::none(), py::arg("temperature") = py::none(), py::arg("top_k") = py::none(),
          py::arg("top_p") = py::none(), py::arg("guidance_scale") = py::none(), py::arg("superres") = py::none(),
          py::arg("adapters") = std::map<std::string, double>{}, py::arg("image_prompt") = py::none(),
          py::arg("image_prompt_rows") = 0, py::arg("preview_every") = 0, py::arg("preview_candidates") = 0,
          py::arg("on_preview") = nullptr);
}

}  // namespace dalle::python
