#include "rpc/kv_target_auth.h"

#include <cstdint>

#include "openssl/evp.h"
#include "openssl/hmac.h"
#include "rpc/internal_auth.h"

namespace duet::rpc {
namespace {

std::string HmacSha256(std::string_view key, std::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), int(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
       message.size(), out, &length);
  return std::string(reinterpret_cast<const char*>(out), length);
}

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(char(v >> (8 * i)));
}

template <typename Ids>
void PutIds(std::string& out, const Ids& ids) {
  PutU64(out, uint64_t(ids.size()));
  for (uint32_t id : ids) PutU64(out, id);
}

// Every field a writer acts on, each length-prefixed, so no two targets share an encoding.
std::string SignedBytes(const v1::KvTarget& target) {
  std::string out = "duet.v1.KvTarget/1";
  PutU64(out, target.transfer_id());
  PutU64(out, target.receiver_descriptor().size());
  out += target.receiver_descriptor();
  PutIds(out, target.block_ids());
  PutIds(out, target.device_block_ids());
  PutU64(out, target.first_token());
  return out;
}

}  // namespace

std::string KvTargetKey(std::string_view internal_token) {
  if (internal_token.empty()) return "";
  return HmacSha256(internal_token, "duet KV target key/1");
}

void SignKvTarget(std::string_view key, v1::KvTarget* target) {
  target->clear_authenticator();
  if (!key.empty()) target->set_authenticator(HmacSha256(key, SignedBytes(*target)));
}

absl::Status VerifyKvTarget(std::string_view key, const v1::KvTarget& target) {
  if (key.empty()) return absl::OkStatus();
  if (target.authenticator().empty()) {
    return absl::PermissionDeniedError("the KV target is not signed: it must be a decode worker's ReserveKv reply");
  }
  if (!ConstantTimeEquals(target.authenticator(), HmacSha256(key, SignedBytes(target)))) {
    return absl::PermissionDeniedError(
        "the KV target was not granted by a decode worker of this cluster (its descriptor, transfer id or block "
        "ids differ from the reservation's, or the workers' internal tokens differ)");
  }
  return absl::OkStatus();
}

}  // namespace duet::rpc
