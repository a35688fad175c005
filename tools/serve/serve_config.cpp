#include "serve/serve_config.h"

#include <filesystem>
#include <fstream>

#include "dalle/error.h"
#include "dalle/input_limits.h"

namespace dalle::serve {

void ServeConfig::visit(ConfigVisitor& v) {
  v.field("host", host, "address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)");
  v.field("port", port, "TCP port to listen on (0: any free port, logged at start)", {.min = 0, .max = 65535});
  v.field("model_id", model_id,
          "the model's name in the API (`model` of a request, GET /v1/models); empty: the model folder's name, or "
          "the prior's");
  v.field("max_queue", max_queue,
          "requests waiting for the model at most; one more is refused at once with 429 (those being generated do "
          "not count)",
          {.min = 1, .max = 100000});
  v.field("max_n", max_n, "images one request may ask for (`n`)", {.min = 1, .max = 1024});
  v.field("max_candidates", max_candidates,
          "candidates one request may have sampled (`candidates`; the best `n` by CLIP are returned)",
          {.min = 1, .max = 65536});
  v.field("max_prompt_length", max_prompt_length,
          "characters in a prompt at most (also at most DALLE_MAX_TEXT_BYTES bytes; OpenAI's DALL-E 2: 1000)",
          {.min = 1, .max = 1000000});
  v.field("max_body_bytes", max_body_bytes, "bytes of a request body at most; more is refused with 413",
          {.min = 1024, .max = 1 << 30});
  v.field("max_image_bytes", max_image_bytes,
          "bytes of each file of POST /v1/images/edits (`image`, `mask`) at most; more is refused with 413 (OpenAI's "
          "DALL-E 2: 4 MB). Their pixels are bounded by DALLE_MAX_IMAGE_PIXELS", {.min = 1024, .max = 1 << 30});
  v.field("request_timeout_seconds", request_timeout_seconds,
          "seconds from a request's arrival to its answer at most, queueing included; then 504",
          {.min = 0.001, .max = 86400});
  v.field("batch_window_ms", batch_window_ms,
          "milliseconds the model waits after a request arrives for others to batch with it (0: none)",
          {.min = 0, .max = 60000});
  v.field("image_ttl_seconds", image_ttl_seconds,
          "seconds an image asked for with response_format url stays at its URL, and a finished job of "
          "POST /v1/images/jobs stays to be fetched", {.min = 1, .max = 604800});
  v.field("max_stored_images", max_stored_images,
          "images kept for URLs at most; beyond it the oldest go first", {.min = 1, .max = 1000000});
  v.field("api_key_file", api_key_file,
          "file holding the key clients must send as `Authorization: Bearer <key>` (its first line); empty: no key");
  v.field("max_connections", max_connections,
          "open connections at most (idle and slow ones included); one more is closed at once, before a byte "
          "of it is read", {.min = 1, .max = 1000000});
  v.field("max_connections_per_client", max_connections_per_client,
          "open connections from one client address at most (behind a proxy, every client is the proxy's "
          "address: name it in trusted_proxies); one more is closed at once", {.min = 1, .max = 1000000});
  v.field("trusted_proxies", trusted_proxies,
          "numeric addresses of the reverse proxies in front of the server (as they connect: 127.0.0.1, ::1): "
          "their connections are bound by max_connections alone, not max_connections_per_client, and a request "
          "from one names its client by X-Forwarded-For (the last address not a trusted proxy), in the logs. "
          "From any other address X-Forwarded-For is ignored");
  v.field("header_timeout_seconds", header_timeout_seconds,
          "seconds a request's line and headers may take, from the connection's opening or the answer before "
          "(an idle keep-alive connection is closed then too); then the connection is closed",
          {.min = 0.01, .max = 86400});
  v.field("body_timeout_seconds", body_timeout_seconds,
          "seconds a request's body may take after its headers; then the connection is closed",
          {.min = 0.01, .max = 86400});
  v.field("idle_timeout_seconds", idle_timeout_seconds,
          "seconds a connection may go without sending or taking a byte (an idle keep-alive connection, a "
          "stalled upload, a client that stopped reading) before it is closed",
          {.min = 1, .max = 86400});
  v.field("max_stored_jobs", max_stored_jobs,
          "jobs of POST /v1/images/jobs kept at most, finished or not; a finished one is kept image_ttl_seconds, "
          "and beyond the count the oldest finished go first", {.min = 1, .max = 1000000});
  v.field("max_memory_megabytes", max_memory_megabytes,
          "megabytes that requests may hold at once, the models aside: bodies being read, an uploaded image's "
          "decode, queued and running requests with the images they will make, stored job answers and images "
          "kept for URLs. A request that would pass it is refused with 503 and Retry-After (413 when it alone is "
          "larger). 0: a quarter of the machine's physical memory", {.min = 0, .max = int64_t{1} << 30});
  v.field("connection_threads", connection_threads,
          "no longer used: connections are served by one event loop (max_connections bounds them); read so that "
          "older configs load", {.min = 0, .max = 100000});
  v.section("pipeline", "the generation pipeline served (the keys of `dalle-generate --config`); a request's "
            "own fields override its sampling settings",
            pipeline);
}

std::string served_model_id(const ServeConfig& config, const std::string& model_folder) {
  if (!config.model_id.empty()) return config.model_id;
  auto path = std::filesystem::path(model_folder.empty() ? config.pipeline.prior : model_folder);
  if (!path.has_filename()) path = path.parent_path();  // "models/fashion-compose/"
  return path.filename().string();
}

std::string read_api_key(const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path);
  if (!in) throw Error("api_key_file " + path + ": cannot read it");
  std::string key;
  read_line_within(in, 4096, key, "api_key_file " + path, 1, "the key goes on the first line");
  const auto first = key.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) throw Error("api_key_file " + path + ": its first line is blank; put the key there");
  key = key.substr(first, key.find_last_not_of(" \t\r\n") - first + 1);
  return key;
}

}  // namespace dalle::serve
