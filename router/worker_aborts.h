// The router's Abort calls to workers: they release what a request still holds on a worker (a KV
// reservation, a prefill, a decode) after the request ended without it, cancelled, timed out or
// failed elsewhere.
//
// A worker that is stalled when the request ends (SIGSTOPped, swapping, its connection broken by
// keepalive) keeps what the request holds until the Abort reaches it, or until its KV lease runs
// out. So an Abort goes to a worker whether or not the registry has it down, waits for the channel
// to be ready rather than failing at once, and is sent again when the connection breaks under it
// (at most `max_attempts` calls), until `give_up_after` from Send: set it to cover the KV lease,
// past which the worker has released the blocks by itself. A worker that does not know the
// request (it has ended there, or the worker was restarted) answers found=false: harmless.
#pragma once

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/worker_registry.h"

namespace duet::router {

class WorkerAborts {
 public:
  explicit WorkerAborts(absl::Duration give_up_after, int max_attempts = 20);
  // Cancels the calls still pending and waits for their callbacks.
  ~WorkerAborts();
  WorkerAborts(const WorkerAborts&) = delete;
  WorkerAborts& operator=(const WorkerAborts&) = delete;

  // Sends `request` (its request id, and worker.proto's release_now or kv_target) to `worker`
  // (which outlives this object), asynchronously.
  void Send(Worker* worker, v1::WorkerAbortRequest request);

  // Aborts not yet answered by their worker nor given up.
  int pending() const;

 private:
  struct Pending;
  void Attempt(Pending* p);
  void OnDone(Pending* p, const grpc::Status& status);

  const absl::Duration give_up_after_;
  const int max_attempts_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<Pending*, std::unique_ptr<Pending>> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace duet::router
