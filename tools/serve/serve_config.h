#pragma once
// dalle-serve's config: where it listens, the limits that bound what one client may cost,
// and the generation pipeline it serves (docs/serve.md; every key in docs/config.md).
#include <cstdint>
#include <string>
#include <vector>

#include "dalle/config.h"
#include "dalle/generate/pipeline.h"

namespace dalle::serve {

struct ServeConfig {
  std::string host = "127.0.0.1";
  int64_t port = 8000;
  std::string model_id;
  int64_t max_queue = 16;
  int64_t max_n = 4;
  int64_t max_candidates = 64;
  int64_t max_prompt_length = 1000;
  int64_t max_body_bytes = 1 << 20;
  int64_t max_image_bytes = 4 << 20;
  double request_timeout_seconds = 300;
  int64_t batch_window_ms = 20;
  int64_t image_ttl_seconds = 600;
  int64_t max_stored_images = 256;
  std::string api_key_file;
  int64_t max_connections = 4096;
  int64_t max_connections_per_client = 256;
  std::vector<std::string> trusted_proxies;
  double header_timeout_seconds = 10;
  double body_timeout_seconds = 60;
  int64_t idle_timeout_seconds = 5;
  int64_t max_stored_jobs = 256;
  int64_t max_memory_megabytes = 0;  // 0: a quarter of the machine's memory
  int64_t connection_threads = 0;  // read and ignored: older configs name it
  generate::PipelineConfig pipeline;

  void visit(ConfigVisitor& v);
};

// The id clients name in `model`: model_id, else the last part of `model_folder` or of the
// prior's path ("models/fashion-compose" -> "fashion-compose").
std::string served_model_id(const ServeConfig& config, const std::string& model_folder);

// Reads the bearer token clients must send: the file's first line, whitespace trimmed.
// An empty path gives "" (no key); a missing, unreadable or blank file is refused.
std::string read_api_key(const std::string& path);

}  // namespace dalle::serve
