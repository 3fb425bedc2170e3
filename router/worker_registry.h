// The router's view of its prefill and decode workers: one gRPC channel and stub per worker,
// an in-flight request count, an up/down state and the last stats each worker reported.
//
// Workers come from static address lists and from discovery targets (worker_registry_discovery.h)
// that a discovery thread re-resolves every `discovery_interval`: an address that appears becomes
// a worker (down until it answers a poll), one that disappears is retired (never assigned or
// polled again; the calls already on it go on). Worker objects live as long as the registry,
// since calls hold plain pointers to them; an address that comes back gets its old worker back.
//
// A poller thread calls GetStats on every worker every
// `poll_interval` (all in parallel, each with `poll_timeout`). A worker that refuses the call
// (UNAVAILABLE: connection refused or reset) is marked down at once; one that times out is
// marked down after `timeouts_to_mark_down` consecutive timeouts (a busy worker is not dead). A
// down worker is marked up again as soon as it answers. The request path also calls MarkDown
// when a call to a worker fails as if the worker were gone.
//
// Channels use HTTP/2 keepalive pings (every `keepalive_time`, dead after `keepalive_timeout`
// without an answer) so a stream to a worker whose host vanished fails instead of hanging. The
// workers' servers must accept those pings; see rpc::KeepaliveServerArgs().
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "duet/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "router/worker_registry_discovery.h"

namespace duet::router {

enum class WorkerRole { kPrefill, kDecode };

const char* RoleName(WorkerRole role);  // "prefill" / "decode"

class Worker {
 public:
  Worker(WorkerRole role, int index, std::string address, std::shared_ptr<grpc::Channel> channel,
         bool is_static = true);
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  WorkerRole role() const { return role_; }
  int index() const { return index_; }  // its number in its role, in the order the registry learned of it
  const std::string& address() const { return address_; }
  // "decode worker 1 (127.0.0.1:5001)", for the log.
  const std::string& name() const { return name_; }
  // "decode worker 1", for messages to clients (which are not told the cluster's addresses).
  const std::string& label() const { return label_; }

  // The connection, for calls the stubs do not make (e.g. reading replies as raw bytes).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  // The stub of this worker's role; the other one is null.
  v1::PrefillWorker::Stub* prefill() const { return prefill_stub_.get(); }
  v1::DecodeWorker::Stub* decode() const { return decode_stub_.get(); }

  bool up() const { return up_.load(std::memory_order_acquire); }
  int in_flight() const { return in_flight_.load(std::memory_order_acquire); }
  void AddInFlight(int delta) { in_flight_.fetch_add(delta, std::memory_order_acq_rel); }
  // The last stats GetStats returned; nullopt before the first answer.
  std::optional<v1::WorkerStats> stats() const;

  // For tests of assignment policies (no gRPC involved).
  void SetUpForTesting(bool up) { up_.store(up, std::memory_order_release); }
  void SetStatsForTesting(const v1::WorkerStats& stats);

 private:
  friend class WorkerRegistry;

  const WorkerRole role_;
  const int index_;
  const std::string address_;
  const std::string name_;
  const std::string label_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::PrefillWorker::Stub> prefill_stub_;
  std::unique_ptr<v1::DecodeWorker::Stub> decode_stub_;
  const bool static_;  // from the command line's list: never retired
  std::atomic<bool> up_{false};
  std::atomic<int> in_flight_{0};
  bool retired_ = false;  // guarded by the registry's members_mu_

  mutable absl::Mutex mu_;
  std::optional<v1::WorkerStats> stats_ ABSL_GUARDED_BY(mu_);
  int consecutive_timeouts_ ABSL_GUARDED_BY(mu_) = 0;
  // The process that gave the last answer (stats_'s instance_id; "" before one, or from a worker
  // that does not say).
  std::string InstanceId() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stats_ ? stats_->instance_id() : ""; }
  struct WhenGone {
    absl::Time deadline;
    std::string instance_id;  // the worker's when it was registered ("": not known)
    std::function<void()> run;
  };
  std::vector<WhenGone> when_gone_ ABSL_GUARDED_BY(mu_);  // WorkerRegistry::WhenGone's
};

// Holds a worker's in-flight count up for its lifetime.
class InFlightGuard {
 public:
  InFlightGuard() = default;
  explicit InFlightGuard(Worker* worker) : worker_(worker) {
    if (worker_ != nullptr) worker_->AddInFlight(1);
  }
  InFlightGuard(InFlightGuard&& other) noexcept : worker_(other.worker_) { other.worker_ = nullptr; }
  InFlightGuard& operator=(InFlightGuard&& other) noexcept {
    if (this != &other) {
      Reset();
      worker_ = other.worker_;
      other.worker_ = nullptr;
    }
    return *this;
  }
  ~InFlightGuard() { Reset(); }
  void Reset() {
    if (worker_ != nullptr) worker_->AddInFlight(-1);
    worker_ = nullptr;
  }

 private:
  Worker* worker_ = nullptr;
};

struct RegistryOptions {
  absl::Duration poll_interval = absl::Milliseconds(200);
  // Generous: a worker on a CPU-starved machine answers late but is not dead (a refused
  // connection still marks it down at once).
  absl::Duration poll_timeout = absl::Seconds(1);
  int timeouts_to_mark_down = 3;
  absl::Duration keepalive_time = absl::Milliseconds(1000);
  absl::Duration keepalive_timeout = absl::Milliseconds(1000);
  // Reconnect backoff cap, so a restarted worker is found again quickly.
  absl::Duration max_reconnect_backoff = absl::Milliseconds(1000);
  bool log_state_changes = true;  // "router: decode worker 0 (...) is down: ..." on stderr
  // The cluster's internal token, sent on every call to a worker (rpc/internal_auth.h); empty:
  // none.
  std::string internal_token;
  // How the router's channels reach the workers: TLS credentials (rpc::ChannelCredentials) or
  // null for plaintext. With TLS, a worker's certificate must name its address (an IP address
  // SAN for host:port addresses), or worker_tls_server_name when set (one name for every worker,
  // e.g. when discovery yields pod IPs).
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
  std::string worker_tls_server_name;
  // How often the discovery targets are resolved again. A Kubernetes headless Service's records
  // have a 5 s TTL by default (CoreDNS).
  absl::Duration discovery_interval = absl::Seconds(2);
  // Resolves the discovery targets; null: MakeSystemResolver(). Tests substitute a fake.
  std::shared_ptr<AddressResolver> resolver;
  // Runs after a worker went up or down or an up worker left discovery (on the thread that saw
  // it: the poller, the discovery thread or a gRPC callback thread; no registry lock held), e.g.
  // to update the router's health status.
  std::function<void()> on_state_change;
};

// Channel arguments for a connection from the router to a worker (keepalive, backoff).
grpc::ChannelArguments WorkerChannelArgs(const RegistryOptions& options);


class WorkerRegistry {
 public:
  WorkerRegistry(const std::vector<std::string>& prefill_addresses,
                 const std::vector<std::string>& decode_addresses, RegistryOptions options = {});
  ~WorkerRegistry();  // stops the poller
  WorkerRegistry(const WorkerRegistry&) = delete;
  WorkerRegistry& operator=(const WorkerRegistry&) = delete;

  // Polls every worker once (so the up/down states are known), then starts the poller thread.
  void Start();
  void Stop();
  // One round of GetStats on all workers, in parallel; returns when all have answered or timed out.
  void PollOnce();

  // Before Start: also follow `target` for workers of `role` (any number of targets per role).
  void AddDiscoveryTarget(WorkerRole role, DiscoveryTarget target);
  // Resolves every discovery target once and applies the answers (see the top of this file); a
  // target whose resolution fails keeps the addresses it last had. Start calls it first, then
  // the discovery thread every discovery_interval.
  void RefreshDiscovery();

  // The workers of a role now (static ones first, then discovered ones in the order they came),
  // up or down; retired workers are not among them. A snapshot: the set may change after.
  std::vector<Worker*> workers(WorkerRole role) const;
  std::vector<Worker*> prefill_workers() const { return workers(WorkerRole::kPrefill); }
  std::vector<Worker*> decode_workers() const { return workers(WorkerRole::kDecode); }
  int NumUp(WorkerRole role) const;

  // Marks `worker` down; it stays down until it answers a poll again.
  void MarkDown(Worker* worker, std::string_view reason);
  // How a ConfirmDown probe ended.
  enum class Probe {
    kAnswered,      // up
    kUnresponsive,  // down: no answer within poll_timeout, but the process may only be stalled
                    // (SIGSTOPped, swapping) and go on with what it was doing once it runs again
    kGone,          // down: the call was refused (UNAVAILABLE), so no process serves its port;
                    // or a new process answers there (another WorkerStats.instance_id than the
                    // one before the probe): the one that failed the call is gone
  };
  // A call to `worker` failed as if the worker were gone (UNAVAILABLE, broken stream). Asks it for
  // its stats (poll_timeout) and marks it down unless it answers: a live worker that reported a
  // failure elsewhere (e.g. a KV transfer to a dead peer) stays up. Asynchronous: `done` gets
  // the probe's end, on a gRPC callback thread; the registry must outlive the call.
  void ConfirmDown(Worker* worker, std::string reason, std::function<void(Probe)> done);
  // Runs `gone` once (on the thread of the poll or probe that finds it) if a call to `worker`'s
  // GetStats is refused (UNAVAILABLE: no process serves its port) or answered by another process
  // than the one known now (its instance_id) before `deadline`; forgotten when the same process
  // answers, or at the first poll after the deadline. For what a worker that stopped answering
  // might still do were it only stalled: a prefill worker's KV writes into a reservation, which
  // the router may release once the worker is known gone.
  void WhenGone(Worker* worker, absl::Time deadline, std::function<void()> gone);

 private:
  struct Target {
    WorkerRole role;
    DiscoveryTarget target;
    std::vector<std::string> addresses;  // its last answer
    std::string error;                   // its last failure, "" after an answer (logged once)
  };
  struct Members {
    std::vector<std::unique_ptr<Worker>> all;  // every worker ever known; never shrinks
    std::vector<Worker*> current;              // not retired, in order
  };

  Members& members(WorkerRole role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_) {
    return role == WorkerRole::kPrefill ? prefill_ : decode_;
  }
  const Members& members(WorkerRole role) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_) {
    return role == WorkerRole::kPrefill ? prefill_ : decode_;
  }
  Worker* AddWorker(WorkerRole role, const std::string& address, bool is_static)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_);
  // Makes the discovered workers of `role` exactly `addresses` (static workers stay); true when a
  // worker that was up left.
  bool ApplyDiscovered(WorkerRole role, const std::vector<std::string>& addresses)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(members_mu_);
  void SetUp(Worker* worker, bool up, std::string_view reason);
  // A GetStats call's end (`stats`: its answer when `status` is OK) for the WhenGone callbacks:
  // refused or another process's answer runs them, the same process's forgets them, anything else
  // forgets those past their deadline.
  void SettleWhenGone(Worker* worker, const grpc::Status& status, const v1::WorkerStats& stats);
  void PollLoop();
  void DiscoveryLoop();

  const RegistryOptions options_;
  const grpc::ChannelArguments channel_args_;
  const std::shared_ptr<AddressResolver> resolver_;

  mutable absl::Mutex members_mu_;
  Members prefill_ ABSL_GUARDED_BY(members_mu_);
  Members decode_ ABSL_GUARDED_BY(members_mu_);

  absl::Mutex refresh_mu_;  // one RefreshDiscovery at a time
  std::vector<Target> targets_ ABSL_GUARDED_BY(refresh_mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread poller_;     // started and joined by the owner thread only
  std::thread discovery_;  // likewise; only with discovery targets
};

}  // namespace duet::router
