#include "cli/worker_placement.h"

#include <algorithm>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace duet {
namespace {

// The CUDA_VISIBLE_DEVICES entry that makes serve's device `device` a child's only one.
absl::StatusOr<std::string> VisibleEntry(int device, const std::optional<std::string>& serve_visible) {
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("--decode-devices: ", device, " is not a device"));
  if (!serve_visible.has_value()) return std::to_string(device);
  std::vector<std::string> entries;
  for (absl::string_view e : absl::StrSplit(*serve_visible, ',', absl::SkipWhitespace())) {
    entries.emplace_back(absl::StripAsciiWhitespace(e));
  }
  if (size_t(device) >= entries.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--decode-devices: device ", device, " but CUDA_VISIBLE_DEVICES=\"",
                                                   *serve_visible, "\" names ", entries.size()));
  }
  return entries[size_t(device)];
}

}  // namespace

absl::StatusOr<Placement> PlaceWorkers(const PlacementRequest& request) {
  const std::vector<int> prefill_devices =
      request.prefill_group_devices.empty() ? std::vector<int>{0} : request.prefill_group_devices;
  auto decode_device = [&](int i) {
    return request.decode_devices.empty() ? 0 : request.decode_devices[size_t(i) % request.decode_devices.size()];
  };
  std::map<int, int> executors;  // device -> executors on it
  for (int j = 0; j < request.num_prefill_workers; ++j) {
    for (int d : prefill_devices) ++executors[d];
  }
  for (int i = 0; i < request.num_decode_workers; ++i) ++executors[decode_device(i)];
  auto share = [&](const std::vector<int>& devices) {
    int most = 1;
    for (int d : devices) most = std::max(most, executors[d]);
    return request.gpu_memory_utilization / most;
  };

  Placement placement;
  for (int i = 0; i < request.num_decode_workers; ++i) {
    WorkerPlacement& w = placement.decode.emplace_back();
    if (!request.decode_devices.empty()) {
      DUET_ASSIGN_OR_RETURN(w.cuda_visible_devices, VisibleEntry(decode_device(i), request.visible_devices));
    }
    w.gpu_memory_utilization = share({decode_device(i)});
  }
  for (int j = 0; j < request.num_prefill_workers; ++j) {
    placement.prefill.push_back({std::nullopt, share(prefill_devices)});
  }
  return placement;
}

}  // namespace duet
