#include "kvtransfer/kv_layout.h"

#include "absl/strings/str_format.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "kvtransfer/byte_io.h"

namespace duet::kvtransfer {
namespace {

constexpr uint8_t kLayoutWireVersion = 1;

bool IsKnownDtype(uint8_t value) {
  return value == static_cast<uint8_t>(KvDtype::kFloat32) ||
         value == static_cast<uint8_t>(KvDtype::kBFloat16) ||
         value == static_cast<uint8_t>(KvDtype::kFloat16);
}

}  // namespace

size_t DtypeSize(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32:
      return 4;
    case KvDtype::kBFloat16:
    case KvDtype::kFloat16:
      return 2;
  }
  DUET_CHECK_MSG(false, "unknown KvDtype");
  return 0;
}

std::string_view DtypeName(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32:
      return "float32";
    case KvDtype::kBFloat16:
      return "bfloat16";
    case KvDtype::kFloat16:
      return "float16";
  }
  return "unknown";
}

absl::Status KvLayout::Validate() const {
  if (num_layers == 0 || block_size == 0 || num_kv_heads == 0 || head_dim == 0) {
    return absl::InvalidArgumentError("KV layout has a zero dimension: " + DebugString());
  }
  return absl::OkStatus();
}

std::string KvLayout::DebugString() const {
  return absl::StrFormat("{layers=%u block_size=%u kv_heads=%u head_dim=%u dtype=%s}", num_layers,
                         block_size, num_kv_heads, head_dim, DtypeName(dtype));
}

std::string KvLayout::Serialize() const {
  ByteWriter writer;
  writer.Put<uint8_t>(kLayoutWireVersion);
  writer.Put<uint8_t>(static_cast<uint8_t>(dtype));
  writer.Put<uint16_t>(static_cast<uint16_t>(ElementSize()));
  writer.Put<uint32_t>(num_layers);
  writer.Put<uint32_t>(block_size);
  writer.Put<uint32_t>(num_kv_heads);
  writer.Put<uint32_t>(head_dim);
  writer.Put<uint32_t>(0);  // reserved
  return std::move(writer).Take();
}

absl::StatusOr<KvLayout> KvLayout::Deserialize(std::string_view bytes) {
  ByteReader reader(bytes, "KV layout");
  DUET_ASSIGN_OR_RETURN(uint8_t version, reader.Get<uint8_t>());
  if (version != kLayoutWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("KV layout wire version %u is not supported (expected %u)", version,
                        kLayoutWireVersion));
  }
  DUET_ASSIGN_OR_RETURN(uint8_t dtype, reader.Get<uint8_t>());
  DUET_ASSIGN_OR_RETURN(uint16_t element_size, reader.Get<uint16_t>());
  if (!IsKnownDtype(dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV layout has unknown dtype code %u (element size %u bytes)", dtype, element_size));
  }
  KvLayout layout;
  layout.dtype = static_cast<KvDtype>(dtype);
  if (element_size != layout.ElementSize()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "KV layout says dtype %s has %u-byte elements", DtypeName(layout.dtype), element_size));
  }
  DUET_ASSIGN_OR_RETURN(layout.num_layers, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(layout.block_size, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(layout.num_kv_heads, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(layout.head_dim, reader.Get<uint32_t>());
  DUET_ASSIGN_OR_RETURN(uint32_t reserved, reader.Get<uint32_t>());
  (void)reserved;
  if (!reader.AtEnd()) return absl::InvalidArgumentError("KV layout blob has trailing bytes");
  DUET_RETURN_IF_ERROR(layout.Validate());
  return layout;
}

absl::StatusOr<LayoutMatch> CheckCompatible(const KvLayout& sender, const KvLayout& receiver) {
  DUET_RETURN_IF_ERROR(sender.Validate());
  DUET_RETURN_IF_ERROR(receiver.Validate());
  auto mismatch = [&](std::string_view what) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "incompatible KV layouts: %s differs (sender %s, receiver %s)", what, sender.DebugString(),
        receiver.DebugString()));
  };
  if (sender.dtype != receiver.dtype) return mismatch("dtype");
  if (sender.num_layers != receiver.num_layers) return mismatch("layer count");
  if (sender.head_dim != receiver.head_dim) return mismatch("head_dim");
  if (sender.num_kv_heads != receiver.num_kv_heads) {
    return absl::UnimplementedError(absl::StrFormat(
        "incompatible KV layouts: kv head count differs (sender %s, receiver %s); re-sharding "
        "between tensor-parallel layouts is not implemented",
        sender.DebugString(), receiver.DebugString()));
  }
  return sender.block_size == receiver.block_size ? LayoutMatch::kSameShape
                                                  : LayoutMatch::kReblock;
}

}  // namespace duet::kvtransfer
