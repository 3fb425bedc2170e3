// A stand-in for `duet router` with the HTTP flags (--http-port, --api-key), for the OpenAI API
// tests until the CLI has them. Same flags as `duet router`; runs RunRouter.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_split.h"
#include "router/router.h"

int main(int argc, char** argv) {
  duet::router::RouterOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "missing value for %s\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--model") options.model_dir = value;
    else if (flag == "--served-model-name") options.served_model_names = {value};
    else if (flag == "--host") options.host = value;
    else if (flag == "--port") options.port = std::atoi(value.c_str());
    else if (flag == "--prefill") options.prefill_addresses = absl::StrSplit(value, ',', absl::SkipEmpty());
    else if (flag == "--decode") options.decode_addresses = absl::StrSplit(value, ',', absl::SkipEmpty());
    else if (flag == "--max-concurrent-requests") options.max_concurrent_requests = std::atoi(value.c_str());
    else if (flag == "--max-queued-requests") options.max_queued_requests = std::atoi(value.c_str());
    else if (flag == "--max-model-len") options.max_model_len = std::atoll(value.c_str());
    else if (flag == "--http-port") options.http_port = std::atoi(value.c_str());
    else if (flag == "--api-key") options.api_key = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  return duet::router::RunRouter(options);
}
