// The public API key (--api-key) of `duet router` and `duet serve`, from where `ps` does not show
// it: --api-key-file or the DUET_API_KEY environment variable (--api-key itself still works).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace duet {

inline constexpr char kApiKeyEnv[] = "DUET_API_KEY";

// The key: `flag_value` (--api-key) if set, else the contents of `file` (--api-key-file,
// surrounding whitespace stripped), else $DUET_API_KEY, else empty (no key). Both a value and a
// file, an unreadable file or an empty one: InvalidArgument / NotFound.
absl::StatusOr<std::string> LoadApiKey(const std::string& flag_value, const std::string& file);

inline constexpr char kApiKeyHelp[] =
    "Bearer token required on HTTP /v1/*, /tokenize, /detokenize and gRPC duet.v1.Duet (visible in ps: "
    "prefer --api-key-file or DUET_API_KEY)";
inline constexpr char kApiKeyFileHelp[] = "File with the API key (else the DUET_API_KEY environment variable)";
inline constexpr char kApiKeyOnHealthHelp[] =
    "With an API key: HTTP /health and /metrics need it too (default: public, as in vLLM)";

}  // namespace duet
