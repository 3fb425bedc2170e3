#include "cli/worker_placement.h"

#include <algorithm>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace duet {
namespace {

// Without CUDA_VISIBLE_DEVICES of serve's own, a child's list names the indices up to this; CUDA
// ignores every entry from the first that names no device on, so the list stops at the host's GPUs.
constexpr int kMaxListedDevices = 64;

// The CUDA_VISIBLE_DEVICES that makes serve's device `device` a child's device 0, the other GPUs
// serve sees following in their order: the child runs on its GPU by default and can still reach
// its peers (CUDA IPC of KV to a worker on another GPU needs the peer's device visible).
absl::StatusOr<std::string> VisibleOrder(int device, const std::optional<std::string>& serve_visible) {
  if (device < 0) return absl::InvalidArgumentError(absl::StrCat("device ", device, " is not a device"));
  std::vector<std::string> entries;
  if (serve_visible.has_value()) {
    for (absl::string_view e : absl::StrSplit(*serve_visible, ',', absl::SkipWhitespace())) {
      entries.emplace_back(absl::StripAsciiWhitespace(e));
    }
    if (size_t(device) >= entries.size()) {
      return absl::InvalidArgumentError(absl::StrCat("device ", device, " but CUDA_VISIBLE_DEVICES=\"", *serve_visible,
                                                     "\" names ", entries.size()));
    }
  } else {
    for (int d = 0; d < std::max(kMaxListedDevices, device + 1); ++d) entries.push_back(std::to_string(d));
  }
  std::rotate(entries.begin(), entries.begin() + device, entries.begin() + device + 1);
  return absl::StrJoin(entries, ",");
}

// Worker i of a role placed by a device list (--decode-devices, --prefill-devices): the
// (i mod n)-th device; without a list, serve's first.
int RoleDevice(const std::vector<int>& devices, int i) { return devices.empty() ? 0 : devices[size_t(i) % devices.size()]; }

}  // namespace

absl::StatusOr<Placement> PlaceWorkers(const PlacementRequest& request) {
  if (!request.prefill_devices.empty() && !request.prefill_group_devices.empty()) {
    return absl::InvalidArgumentError(
        "--prefill-devices places prefill workers of one GPU each; a sequence-parallel group's GPUs are --devices");
  }
  // The devices each worker's executors run on, decode workers first.
  std::vector<std::vector<int>> decode_devices, prefill_devices;
  for (int i = 0; i < request.num_decode_workers; ++i) decode_devices.push_back({RoleDevice(request.decode_devices, i)});
  for (int j = 0; j < request.num_prefill_workers; ++j) {
    prefill_devices.push_back(request.prefill_group_devices.empty()
                                  ? std::vector<int>{RoleDevice(request.prefill_devices, j)}
                                  : request.prefill_group_devices);
  }
  std::map<int, int> executors;  // device -> executors on it
  for (const auto* role : {&decode_devices, &prefill_devices}) {
    for (const std::vector<int>& devices : *role) {
      for (int d : devices) ++executors[d];
    }
  }
  // A worker placed by its role's device list (`flag`) sees its GPU first; the others see what
  // serve sees.
  auto place = [&](const std::vector<int>& devices, const char* flag,
                   std::vector<WorkerPlacement>& out) -> absl::Status {
    WorkerPlacement& w = out.emplace_back();
    if (flag != nullptr) {
      absl::StatusOr<std::string> visible = VisibleOrder(devices[0], request.visible_devices);
      if (!visible.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", visible.status().message()));
      w.cuda_visible_devices = *std::move(visible);
    }
    int most = 1;
    for (int d : devices) most = std::max(most, executors[d]);
    w.gpu_memory_utilization = request.gpu_memory_utilization / most;
    return absl::OkStatus();
  };
  Placement placement;
  for (const std::vector<int>& devices : decode_devices) {
    DUET_RETURN_IF_ERROR(place(devices, request.decode_devices.empty() ? nullptr : "--decode-devices", placement.decode));
  }
  for (const std::vector<int>& devices : prefill_devices) {
    DUET_RETURN_IF_ERROR(
        place(devices, request.prefill_devices.empty() ? nullptr : "--prefill-devices", placement.prefill));
  }
  return placement;
}

}  // namespace duet
