#include "kvtransfer/ucx_protocol.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kvtransfer/byte_io.h"

namespace duet::kvtransfer {
namespace {

constexpr uint32_t kDescriptorMagic = 0x52564b44;  // "DKVR"
constexpr uint8_t kDescriptorVersion = 2;

}  // namespace

std::string ReceiverDescriptor::Serialize() const {
  ByteWriter writer;
  writer.Put<uint32_t>(kDescriptorMagic);
  writer.Put<uint8_t>(kDescriptorVersion);
  writer.PutBytes(layout.Serialize());
  writer.Put<uint32_t>(num_blocks);
  writer.PutBytes(host_id);
  writer.PutBytes(worker_address);
  writer.Put<uint32_t>(static_cast<uint32_t>(regions.size()));
  for (const RemoteRegion& region : regions) {
    writer.Put<uint64_t>(region.base_address);
    writer.Put<uint64_t>(region.bytes);
    writer.PutBytes(region.packed_rkey);
  }
  writer.PutBytes(device_export);
  return std::move(writer).Take();
}

absl::StatusOr<ReceiverDescriptor> ReceiverDescriptor::Parse(std::string_view blob) {
  ByteReader reader(blob, "KV receiver descriptor");
  DUET_ASSIGN_OR_RETURN(uint32_t magic, reader.Get<uint32_t>());
  if (magic != kDescriptorMagic) {
    return absl::InvalidArgumentError("not a KV receiver descriptor (bad magic)");
  }
  DUET_ASSIGN_OR_RETURN(uint8_t version, reader.Get<uint8_t>());
  if (version != kDescriptorVersion) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV receiver descriptor version %u is not supported (expected %u)", version,
        kDescriptorVersion));
  }
  ReceiverDescriptor descriptor;
  DUET_ASSIGN_OR_RETURN(std::string_view layout_bytes, reader.GetBytes());
  DUET_ASSIGN_OR_RETURN(descriptor.layout, KvLayout::Deserialize(layout_bytes));
  DUET_ASSIGN_OR_RETURN(descriptor.num_blocks, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(std::string_view host_id, reader.GetBytes());
  descriptor.host_id = std::string(host_id);
  DUET_ASSIGN_OR_RETURN(std::string_view address, reader.GetBytes());
  descriptor.worker_address = std::string(address);
  DUET_ASSIGN_OR_RETURN(uint32_t num_regions, reader.Get<uint32_t>());
  if (num_regions != 2 * size_t{descriptor.layout.num_layers}) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV receiver descriptor has %u regions for %u layers (expected K and V per layer)",
        num_regions, descriptor.layout.num_layers));
  }
  const uint64_t pool_bytes = uint64_t{descriptor.num_blocks} * descriptor.layout.BlockBytes();
  for (uint32_t i = 0; i < num_regions; ++i) {
    RemoteRegion region;
    DUET_ASSIGN_OR_RETURN(region.base_address, reader.Get<uint64_t>());
    DUET_ASSIGN_OR_RETURN(region.bytes, reader.Get<uint64_t>());
    DUET_ASSIGN_OR_RETURN(std::string_view rkey, reader.GetBytes());
    if (region.bytes != pool_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "KV receiver descriptor region %u has %u bytes, its layout needs %u", i, region.bytes,
          pool_bytes));
    }
    region.packed_rkey = std::string(rkey);
    descriptor.regions.push_back(std::move(region));
  }
  DUET_ASSIGN_OR_RETURN(std::string_view device_export, reader.GetBytes());
  descriptor.device_export = std::string(device_export);
  if (!reader.AtEnd()) {
    return absl::InvalidArgumentError("KV receiver descriptor has trailing bytes");
  }
  return descriptor;
}

absl::StatusOr<Notice> Notice::Parse(const void* data, size_t length) {
  Notice notice;
  if (length != sizeof(Notice)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV transfer notice has %u bytes, expected %u", length, sizeof(Notice)));
  }
  std::memcpy(&notice, data, sizeof(Notice));
  if (notice.magic != kMagic) return absl::InvalidArgumentError("KV notice has a bad magic");
  if (notice.version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KV notice version %u is not supported", notice.version));
  }
  if (notice.type != NoticeType::kLayerDone && notice.type != NoticeType::kFinish &&
      notice.type != NoticeType::kAbort) {
    return absl::InvalidArgumentError("KV notice has an unknown type");
  }
  return notice;
}

}  // namespace duet::kvtransfer
