#include "router/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "rpc/internal_auth.h"

namespace duet::router {

const char* RoleName(WorkerRole role) { return role == WorkerRole::kPrefill ? "prefill" : "decode"; }

Worker::Worker(WorkerRole role, int index, std::string address, std::shared_ptr<grpc::Channel> channel,
               bool is_static)
    : role_(role),
      index_(index),
      address_(std::move(address)),
      name_(absl::StrCat(RoleName(role), " worker ", index, " (", address_, ")")),
      label_(absl::StrCat(RoleName(role), " worker ", index)),
      channel_(std::move(channel)),
      static_(is_static) {
  if (role_ == WorkerRole::kPrefill) {
    prefill_stub_ = v1::PrefillWorker::NewStub(channel_);
  } else {
    decode_stub_ = v1::DecodeWorker::NewStub(channel_);
  }
}

std::optional<v1::WorkerStats> Worker::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void Worker::SetStatsForTesting(const v1::WorkerStats& stats) {
  absl::MutexLock lock(&mu_);
  stats_ = stats;
}

grpc::ChannelArguments WorkerChannelArgs(const RegistryOptions& options) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_timeout)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Keep pinging on a quiet connection (the default stops after two pings without data).
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  const int backoff_ms = static_cast<int>(absl::ToInt64Milliseconds(options.max_reconnect_backoff));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(backoff_ms, 100));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::min(backoff_ms, 100));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, backoff_ms);
  // Each worker gets its own connection, not one shared with other channels in the process.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Large prompts (token ids) and logprobs: allow big messages.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (!options.worker_tls_server_name.empty()) {
    args.SetString(GRPC_SSL_TARGET_NAME_OVERRIDE_ARG, options.worker_tls_server_name);
  }
  return args;
}

WorkerRegistry::WorkerRegistry(const std::vector<std::string>& prefill_addresses,
                               const std::vector<std::string>& decode_addresses, RegistryOptions options)
    : options_(std::move(options)),
      channel_args_(WorkerChannelArgs(options_)),
      resolver_(options_.resolver != nullptr ? options_.resolver : std::shared_ptr<AddressResolver>(MakeSystemResolver())) {
  absl::MutexLock lock(&members_mu_);
  for (const std::string& address : prefill_addresses) AddWorker(WorkerRole::kPrefill, address, /*is_static=*/true);
  for (const std::string& address : decode_addresses) AddWorker(WorkerRole::kDecode, address, /*is_static=*/true);
}

Worker* WorkerRegistry::AddWorker(WorkerRole role, const std::string& address, bool is_static) {
  Members& m = members(role);
  auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
      address, options_.worker_credentials != nullptr ? options_.worker_credentials : grpc::InsecureChannelCredentials(),
      channel_args_, rpc::InternalTokenInterceptors(options_.internal_token));
  m.all.push_back(
      std::make_unique<Worker>(role, static_cast<int>(m.all.size()), address, std::move(channel), is_static));
  m.current.push_back(m.all.back().get());
  return m.all.back().get();
}

void WorkerRegistry::AddDiscoveryTarget(WorkerRole role, DiscoveryTarget target) {
  DUET_CHECK(!discovery_.joinable());
  absl::MutexLock lock(&refresh_mu_);
  targets_.push_back(Target{role, std::move(target), {}, {}});
}

void WorkerRegistry::RefreshDiscovery() {
  absl::MutexLock refresh_lock(&refresh_mu_);
  if (targets_.empty()) return;
  for (Target& t : targets_) {  // resolution blocks: outside members_mu_
    absl::StatusOr<std::vector<std::string>> addresses = resolver_->Resolve(t.target);
    if (addresses.ok()) {
      if (!t.error.empty()) DUET_LOG(INFO) << "router: " << t.target.spec << " resolves again";
      t.error.clear();
      t.addresses = *std::move(addresses);
    } else if (std::string error(addresses.status().message()); error != t.error) {
      DUET_LOG(WARNING) << "router: " << t.target.spec << ": " << error << "; keeping its "
                        << t.addresses.size() << " workers";
      t.error = std::move(error);
    }
  }
  bool retired_an_up_worker = false;
  {
    absl::MutexLock lock(&members_mu_);
    for (WorkerRole role : {WorkerRole::kPrefill, WorkerRole::kDecode}) {
      std::vector<std::string> addresses;
      for (const Target& t : targets_) {
        if (t.role != role) continue;
        for (const std::string& a : t.addresses) {
          if (std::find(addresses.begin(), addresses.end(), a) == addresses.end()) addresses.push_back(a);
        }
      }
      retired_an_up_worker |= ApplyDiscovered(role, addresses);
    }
  }
  if (retired_an_up_worker && options_.on_state_change) options_.on_state_change();
}

bool WorkerRegistry::ApplyDiscovered(WorkerRole role, const std::vector<std::string>& addresses) {
  bool retired_an_up_worker = false;
  Members& m = members(role);
  auto listed = [&](const std::string& address) {
    return std::find(addresses.begin(), addresses.end(), address) != addresses.end();
  };
  std::vector<Worker*> kept;
  for (Worker* worker : m.current) {
    if (worker->static_ || listed(worker->address())) {
      kept.push_back(worker);
      continue;
    }
    worker->retired_ = true;
    retired_an_up_worker |= worker->up_.exchange(false, std::memory_order_acq_rel);
    if (options_.log_state_changes) {
      DUET_LOG(INFO) << "router: " << worker->name() << " left discovery; retired (requests on it go on)";
    }
  }
  m.current = std::move(kept);
  for (const std::string& address : addresses) {
    auto is_address = [&](Worker* w) { return w->address() == address; };
    if (std::any_of(m.current.begin(), m.current.end(), is_address)) continue;
    auto old = std::find_if(m.all.begin(), m.all.end(), [&](const auto& w) { return is_address(w.get()); });
    Worker* worker = nullptr;
    if (old != m.all.end()) {  // it came back: the same worker, down until it answers a poll
      worker = old->get();
      worker->retired_ = false;
      m.current.push_back(worker);
    } else {
      worker = AddWorker(role, address, /*is_static=*/false);
    }
    if (options_.log_state_changes) DUET_LOG(INFO) << "router: discovered " << worker->name();
  }
  return retired_an_up_worker;
}

std::vector<Worker*> WorkerRegistry::workers(WorkerRole role) const {
  absl::MutexLock lock(&members_mu_);
  return members(role).current;
}

WorkerRegistry::~WorkerRegistry() { Stop(); }

void WorkerRegistry::Start() {
  DUET_CHECK(!poller_.joinable());
  RefreshDiscovery();
  PollOnce();
  {
    absl::MutexLock lock(&mu_);
    stop_ = false;
  }
  poller_ = std::thread([this] { PollLoop(); });
  bool discovering = false;
  {
    absl::MutexLock lock(&refresh_mu_);
    discovering = !targets_.empty();
  }
  if (discovering) discovery_ = std::thread([this] { DiscoveryLoop(); });
}

void WorkerRegistry::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (poller_.joinable()) poller_.join();
  if (discovery_.joinable()) discovery_.join();  // waits for a resolution under way
  // No poll will run them; what they hold (the router's aborts) goes while the workers are here.
  std::vector<Worker::WhenGone> dropped;
  {
    absl::MutexLock lock(&members_mu_);
    for (Members* m : {&prefill_, &decode_}) {
      for (const std::unique_ptr<Worker>& worker : m->all) {
        absl::MutexLock worker_lock(&worker->mu_);
        for (Worker::WhenGone& w : worker->when_gone_) dropped.push_back(std::move(w));
        worker->when_gone_.clear();
      }
    }
  }
}

void WorkerRegistry::PollLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.poll_interval)) return;
    }
    PollOnce();
  }
}

void WorkerRegistry::DiscoveryLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.discovery_interval)) return;
    }
    RefreshDiscovery();
  }
}

namespace {

// Whether `answered` comes from another process than `known` (both said: a worker that does not
// report its instance is taken for the same process).
bool AnotherProcess(const std::string& known, const std::string& answered) {
  return !known.empty() && !answered.empty() && answered != known;
}

struct PendingPoll {
  Worker* worker = nullptr;
  grpc::ClientContext context;
  v1::WorkerStats stats;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::WorkerStats>> rpc;
};

}  // namespace

void WorkerRegistry::PollOnce() {
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<PendingPoll>> pending;
  const auto deadline = absl::ToChronoTime(absl::Now() + options_.poll_timeout);
  const v1::GetStatsRequest request;
  for (WorkerRole role : {WorkerRole::kPrefill, WorkerRole::kDecode}) {
    for (Worker* worker : workers(role)) {
      auto poll = std::make_unique<PendingPoll>();
      poll->worker = worker;
      poll->context.set_deadline(deadline);
      if (worker->prefill() != nullptr) {
        poll->rpc = worker->prefill()->AsyncGetStats(&poll->context, request, &cq);
      } else {
        poll->rpc = worker->decode()->AsyncGetStats(&poll->context, request, &cq);
      }
      poll->rpc->Finish(&poll->stats, &poll->status, poll.get());
      pending.push_back(std::move(poll));
    }
  }
  for (size_t done = 0; done < pending.size(); ++done) {
    void* tag = nullptr;
    bool ok = false;
    DUET_CHECK(cq.Next(&tag, &ok));
    PendingPoll* poll = static_cast<PendingPoll*>(tag);
    Worker* worker = poll->worker;
    SettleWhenGone(worker, poll->status, poll->stats);
    if (poll->status.ok()) {
      {
        absl::MutexLock lock(&worker->mu_);
        worker->stats_ = poll->stats;
        worker->consecutive_timeouts_ = 0;
      }
      SetUp(worker, true, "");
      continue;
    }
    bool down = poll->status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!down) {
      absl::MutexLock lock(&worker->mu_);
      down = ++worker->consecutive_timeouts_ >= options_.timeouts_to_mark_down;
    }
    if (down) {
      SetUp(worker, false, absl::StrCat("GetStats failed: ", poll->status.error_message()));
    }
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
}

int WorkerRegistry::NumUp(WorkerRole role) const {
  int n = 0;
  for (const Worker* worker : workers(role)) n += worker->up() ? 1 : 0;
  return n;
}

void WorkerRegistry::MarkDown(Worker* worker, std::string_view reason) { SetUp(worker, false, reason); }

void WorkerRegistry::ConfirmDown(Worker* worker, std::string reason, std::function<void(Probe)> done) {
  struct StatsCall {
    grpc::ClientContext context;
    v1::GetStatsRequest request;
    v1::WorkerStats stats;
  };
  auto probe = std::make_shared<StatsCall>();
  probe->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.poll_timeout));
  std::string instance_before;
  {
    absl::MutexLock lock(&worker->mu_);
    instance_before = worker->InstanceId();
  }
  auto on_answer = [this, worker, probe, reason = std::move(reason), instance_before = std::move(instance_before),
                    done = std::move(done)](grpc::Status status) mutable {
    SettleWhenGone(worker, status, probe->stats);
    if (status.ok()) {
      absl::MutexLock lock(&worker->mu_);
      worker->stats_ = probe->stats;
    } else {
      SetUp(worker, false, absl::StrCat(reason, "; GetStats: ", status.error_message()));
    }
    if (done) {
      const bool replaced = status.ok() && AnotherProcess(instance_before, probe->stats.instance_id());
      done(replaced                                               ? Probe::kGone
           : status.ok()                                          ? Probe::kAnswered
           : status.error_code() == grpc::StatusCode::UNAVAILABLE ? Probe::kGone
                                                                  : Probe::kUnresponsive);
    }
    probe.reset();  // the context before what `done` keeps alive (see CallWorker in router_service.cpp)
  };
  if (worker->prefill() != nullptr) {
    worker->prefill()->async()->GetStats(&probe->context, &probe->request, &probe->stats, std::move(on_answer));
  } else {
    worker->decode()->async()->GetStats(&probe->context, &probe->request, &probe->stats, std::move(on_answer));
  }
}

void WorkerRegistry::WhenGone(Worker* worker, absl::Time deadline, std::function<void()> gone) {
  absl::MutexLock lock(&worker->mu_);
  worker->when_gone_.push_back({deadline, worker->InstanceId(), std::move(gone)});
}

void WorkerRegistry::SettleWhenGone(Worker* worker, const grpc::Status& status, const v1::WorkerStats& stats) {
  // Run and dropped outside the lock: they may call into the registry, and what they hold (the
  // router's aborts) may go with them.
  std::vector<Worker::WhenGone> settled, run, kept;
  {
    absl::MutexLock lock(&worker->mu_);
    const absl::Time now = absl::Now();
    const bool refused = status.error_code() == grpc::StatusCode::UNAVAILABLE;
    for (Worker::WhenGone& w : worker->when_gone_) {
      const bool replaced = status.ok() && AnotherProcess(w.instance_id, stats.instance_id());
      if (w.deadline <= now || (status.ok() && !replaced)) {
        settled.push_back(std::move(w));
      } else {
        (refused || replaced ? run : kept).push_back(std::move(w));
      }
    }
    worker->when_gone_.swap(kept);
  }
  for (Worker::WhenGone& w : run) w.run();
}

void WorkerRegistry::SetUp(Worker* worker, bool up, std::string_view reason) {
  {
    absl::MutexLock lock(&members_mu_);  // against a retirement between the check and the store
    if (worker->retired_) return;
    const bool was = worker->up_.exchange(up, std::memory_order_acq_rel);
    if (was == up) return;
    if (options_.log_state_changes) {
      if (up) {
        DUET_LOG(INFO) << worker->name() << " is up";
      } else {
        DUET_LOG(WARNING) << worker->name() << " is down: " << reason;
      }
    }
  }
  // Outside the lock: the listener may ask how many workers are up.
  if (options_.on_state_change) options_.on_state_change();
}

}  // namespace duet::router
