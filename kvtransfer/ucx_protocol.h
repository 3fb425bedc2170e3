// Wire formats of the UCX transport: the receiver descriptor blob and the completion notices
// (active messages) a sender sends after its RMA puts are remotely complete.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtransfer/kv_layout.h"
#include "kvtransfer/kv_transport.h"

namespace duet::kvtransfer {

// A registered pool at the receiver: where it is and the packed rkey that grants access to it.
struct RemoteRegion {
  uint64_t base_address = 0;
  uint64_t bytes = 0;
  std::string packed_rkey;
};

struct ReceiverDescriptor {
  KvLayout layout;                     // of the host pools (and the device pools, if exported)
  uint32_t num_blocks = 0;             // host pool blocks
  std::string host_id;                 // LocalHostIdentity() of the receiver
  std::string worker_address;          // ucp_worker_get_address bytes
  std::vector<RemoteRegion> regions;   // [2 * layer]: K pool, [2 * layer + 1]: V pool
  std::string device_export;           // DeviceKvMemory::Export(); empty: host pools only

  std::string Serialize() const;
  static absl::StatusOr<ReceiverDescriptor> Parse(std::string_view blob);
};

inline size_t KeyRegion(uint32_t layer) { return 2 * size_t{layer}; }
inline size_t ValueRegion(uint32_t layer) { return 2 * size_t{layer} + 1; }

// Active message id of every notice.
inline constexpr unsigned kNoticeAmId = 0x4b56;

enum class NoticeType : uint8_t {
  kLayerDone = 1,  // the layer's bytes are in place at the receiver
  kFinish = 2,     // the sender sent every layer of the request
  kAbort = 3,      // the sender gives the request up
};

// Sent as the active-message header; fixed size, little-endian.
struct Notice {
  static constexpr uint32_t kMagic = 0x4e4b5644;  // "DVKN"
  static constexpr uint8_t kVersion = 1;
  static constexpr uint16_t kHasChecksums = 1;
  static constexpr uint16_t kDeviceData = 2;  // the layer was written into the device pools

  uint32_t magic = kMagic;
  uint8_t version = kVersion;
  NoticeType type = NoticeType::kLayerDone;
  uint16_t flags = 0;
  uint64_t request_id = 0;
  uint32_t layer = 0;
  uint32_t num_tokens = 0;
  uint64_t key_checksum = 0;
  uint64_t value_checksum = 0;

  static absl::StatusOr<Notice> Parse(const void* data, size_t length);
};
static_assert(std::is_trivially_copyable_v<Notice>);

}  // namespace duet::kvtransfer
