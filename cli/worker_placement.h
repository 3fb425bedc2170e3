// Where `duet serve` puts its worker processes on the host's GPUs, and each one's share of the
// memory of the GPUs it uses.
//
// A decode worker runs on one GPU: by default the first one serve sees, with --decode-devices the
// i-th worker on the (i mod n)-th device named. It is placed by its CUDA_VISIBLE_DEVICES, which
// names that GPU first and the others after it, so inside the worker its GPU is device 0 and its
// peers stay reachable (KV goes GPU to GPU by CUDA IPC). A prefill worker
// likewise (--prefill-devices), unless it is a sequence-parallel group: then its ranks run on
// --devices and it sees what serve sees. Device numbers are serve's own, i.e. positions in serve's
// CUDA_VISIBLE_DEVICES when it is set.
//
// Memory: an executor's --gpu-memory-utilization is a fraction of its GPU's total memory, so
// executors sharing a GPU split the fraction: a worker gets serve's fraction over the number of
// executors on the most shared of its GPUs (a group's ranks count one each).
#ifndef DUET_CLI_WORKER_PLACEMENT_H_
#define DUET_CLI_WORKER_PLACEMENT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace duet {

struct PlacementRequest {
  int num_prefill_workers = 1;
  int num_decode_workers = 1;
  std::vector<int> prefill_group_devices;  // --devices: each prefill worker's ranks
  std::vector<int> prefill_devices;        // --prefill-devices (workers of one GPU each)
  std::vector<int> decode_devices;         // --decode-devices; empty (and the above): device 0
  double gpu_memory_utilization = 0.9;
  // serve's own CUDA_VISIBLE_DEVICES, if set (device numbers index into it).
  std::optional<std::string> visible_devices;
};

struct WorkerPlacement {
  // The worker's CUDA_VISIBLE_DEVICES (its GPU first); unset: it sees what serve sees.
  std::optional<std::string> cuda_visible_devices;
  double gpu_memory_utilization = 0;  // its --gpu-memory-utilization
};

struct Placement {
  std::vector<WorkerPlacement> decode;   // decode worker i
  std::vector<WorkerPlacement> prefill;  // prefill worker j
};

// Fails on a negative device, one past the end of serve's CUDA_VISIBLE_DEVICES, or both
// --prefill-devices and a group's --devices.
absl::StatusOr<Placement> PlaceWorkers(const PlacementRequest& request);

}  // namespace duet

#endif  // DUET_CLI_WORKER_PLACEMENT_H_
