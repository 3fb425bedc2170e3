// A UCX (ucp) context and worker driven by one progress thread, plus registered memory regions.
//
// Every ucp call that touches the worker (endpoints, RMA, active messages, progress) runs on the
// progress thread: other threads hand it closures with Post() / Call(). That keeps the worker in
// UCS_THREAD_MODE_SINGLE and makes every UCX callback run on that one thread. While the owner
// has operations in flight, or for `spin_after_activity` after the last UCX event, the thread
// keeps progressing: sends queued inside UCX raise no events, and the target of an RMA put
// emulated over active messages (UCX does that for shared memory and tcp) must progress for the
// put to land, so sleeping between messages of a burst would cost a wake-up each. Otherwise it
// sleeps on the worker's event fd (UCP_FEATURE_WAKEUP), waking at least
// every `tick_period` to run the owner's tick (timeouts, lease expiry).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/check.h"

namespace duet::kvtransfer {

absl::Status UcxError(ucs_status_t status, std::string_view what);

// A buffer registered with ucp_mem_map, with its packed remote key.
class UcxMemoryRegion {
 public:
  static absl::StatusOr<std::unique_ptr<UcxMemoryRegion>> Register(ucp_context_h context,
                                                                   void* address, size_t bytes);
  ~UcxMemoryRegion();
  UcxMemoryRegion(const UcxMemoryRegion&) = delete;
  UcxMemoryRegion& operator=(const UcxMemoryRegion&) = delete;

  void* address() const { return address_; }
  size_t bytes() const { return bytes_; }
  ucp_mem_h handle() const { return memh_; }
  const std::string& packed_rkey() const { return packed_rkey_; }

 private:
  UcxMemoryRegion(ucp_context_h context, void* address, size_t bytes, ucp_mem_h memh,
                  std::string packed_rkey)
      : context_(context), address_(address), bytes_(bytes), memh_(memh),
        packed_rkey_(std::move(packed_rkey)) {}

  ucp_context_h context_;
  void* address_;
  size_t bytes_;
  ucp_mem_h memh_;
  std::string packed_rkey_;
};

class UcxWorker {
 public:
  struct Options {
    std::string name = "duet-kv";
    absl::Duration tick_period = absl::Milliseconds(5);
    absl::Duration spin_after_activity = absl::Milliseconds(2);
  };

  // Creates the context (features RMA, AM and WAKEUP; UCX_* environment variables apply) and
  // the worker. The progress thread starts with Start().
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const Options& options);
  // Stop() must have been called (owners stop it before their UCX objects go away).
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // The packed worker address a peer passes to ucp_ep_create.
  const std::string& address() const { return address_; }

  // Starts the progress thread; `tick` runs on it at least every tick_period and returns whether
  // operations are in flight (then the thread polls instead of sleeping).
  void Start(std::function<bool()> tick);
  // Runs `shutdown` on the progress thread (close endpoints there), keeps progressing until
  // `drained()` is true, then joins the thread. Idempotent.
  void Stop(std::function<void()> shutdown, std::function<bool()> drained);

  // Runs `fn` on the progress thread, soon.
  void Post(std::function<void()> fn);
  // Runs `fn` on the progress thread and waits for its result. Never from the progress thread.
  template <typename Fn>
  auto Call(Fn fn) -> decltype(fn()) {
    DUET_CHECK_MSG(!OnProgressThread(), "UcxWorker::Call from its own thread would deadlock");
    std::promise<decltype(fn())> result;
    auto future = result.get_future();
    Post([&] { result.set_value(fn()); });
    return future.get();
  }
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  UcxWorker(const Options& options, ucp_context_h context, ucp_worker_h worker, int worker_fd,
            int wake_fd, std::string address);
  void Loop(std::function<bool()> tick);
  void RunPosted();
  void Wake();
  void WaitForEvents();

  const Options options_;
  ucp_context_h context_;
  ucp_worker_h worker_;
  int worker_fd_;  // -1 when the transports offer no event fd: then the loop naps briefly
  int wake_fd_;    // eventfd that Post() signals
  std::string address_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::function<void()> shutdown_;
  std::function<bool()> drained_;

  absl::Mutex mu_;
  std::deque<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace duet::kvtransfer
