#include "router/request_id.h"

#include <sys/random.h>

#include <cerrno>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/check.h"

namespace duet::router {

absl::Status CheckRequestIdLength(std::string_view id, std::string_view field) {
  if (id.size() <= kMaxRequestIdBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s is %d bytes long; at most %d are allowed", field, id.size(), kMaxRequestIdBytes));
}

bool IsPrintableAscii(std::string_view id) {
  for (char c : id) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

std::string RandomHex(size_t num_bytes) {
  std::vector<char> bytes(num_bytes);
  size_t filled = 0;
  while (filled < num_bytes) {
    const ssize_t n = getrandom(bytes.data() + filled, num_bytes - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    DUET_CHECK_MSG(n > 0, absl::StrFormat("getrandom failed: errno %d", errno));
    filled += size_t(n);
  }
  return absl::BytesToHexString(absl::string_view(bytes.data(), bytes.size()));
}

std::string ClientOf(const grpc::CallbackServerContext& context) {
  std::string client = context.peer();
  auto range = context.client_metadata().equal_range("authorization");
  for (auto it = range.first; it != range.second; ++it) {
    absl::StrAppend(&client, "\n", absl::string_view(it->second.data(), it->second.size()));
  }
  return client;
}

}  // namespace duet::router
