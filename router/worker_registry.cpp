#include "router/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "rpc/internal_auth.h"

namespace duet::router {

const char* RoleName(WorkerRole role) { return role == WorkerRole::kPrefill ? "prefill" : "decode"; }

Worker::Worker(WorkerRole role, int index, std::string address, std::shared_ptr<grpc::Channel> channel)
    : role_(role),
      index_(index),
      address_(std::move(address)),
      name_(absl::StrCat(RoleName(role), " worker ", index, " (", address_, ")")),
      label_(absl::StrCat(RoleName(role), " worker ", index)),
      channel_(std::move(channel)) {
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
  return args;
}

WorkerRegistry::WorkerRegistry(const std::vector<std::string>& prefill_addresses,
                               const std::vector<std::string>& decode_addresses, RegistryOptions options)
    : options_(options) {
  const grpc::ChannelArguments args = WorkerChannelArgs(options_);
  auto make = [&](WorkerRole role, const std::vector<std::string>& addresses,
                  std::vector<std::unique_ptr<Worker>>* out) {
    for (size_t i = 0; i < addresses.size(); ++i) {
      auto channel = grpc::experimental::CreateCustomChannelWithInterceptors(
          addresses[i], grpc::InsecureChannelCredentials(), args, rpc::InternalTokenInterceptors(options_.internal_token));
      out->push_back(std::make_unique<Worker>(role, static_cast<int>(i), addresses[i], std::move(channel)));
    }
  };
  make(WorkerRole::kPrefill, prefill_addresses, &prefill_);
  make(WorkerRole::kDecode, decode_addresses, &decode_);
}

WorkerRegistry::~WorkerRegistry() { Stop(); }

void WorkerRegistry::Start() {
  DUET_CHECK(!poller_.joinable());
  PollOnce();
  {
    absl::MutexLock lock(&mu_);
    stop_ = false;
  }
  poller_ = std::thread([this] { PollLoop(); });
}

void WorkerRegistry::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (poller_.joinable()) poller_.join();
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

namespace {

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
  for (const auto* list : {&prefill_, &decode_}) {
    for (const std::unique_ptr<Worker>& worker : *list) {
      auto poll = std::make_unique<PendingPoll>();
      poll->worker = worker.get();
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
  for (const std::unique_ptr<Worker>& worker : workers(role)) n += worker->up() ? 1 : 0;
  return n;
}

void WorkerRegistry::MarkDown(Worker* worker, std::string_view reason) { SetUp(worker, false, reason); }

void WorkerRegistry::ConfirmDown(Worker* worker, std::string reason, std::function<void(bool down)> done) {
  struct Probe {
    grpc::ClientContext context;
    v1::GetStatsRequest request;
    v1::WorkerStats stats;
  };
  auto probe = std::make_shared<Probe>();
  probe->context.set_deadline(absl::ToChronoTime(absl::Now() + options_.poll_timeout));
  auto on_answer = [this, worker, probe, reason = std::move(reason),
                    done = std::move(done)](grpc::Status status) mutable {
    if (status.ok()) {
      absl::MutexLock lock(&worker->mu_);
      worker->stats_ = probe->stats;
    } else {
      SetUp(worker, false, absl::StrCat(reason, "; GetStats: ", status.error_message()));
    }
    if (done) done(!status.ok());
    probe.reset();  // the context before what `done` keeps alive (see CallWorker in router_service.cpp)
  };
  if (worker->prefill() != nullptr) {
    worker->prefill()->async()->GetStats(&probe->context, &probe->request, &probe->stats, std::move(on_answer));
  } else {
    worker->decode()->async()->GetStats(&probe->context, &probe->request, &probe->stats, std::move(on_answer));
  }
}

void WorkerRegistry::SetUp(Worker* worker, bool up, std::string_view reason) {
  const bool was = worker->up_.exchange(up, std::memory_order_acq_rel);
  if (was == up || !options_.log_state_changes) return;
  if (up) {
    DUET_LOG(INFO) << worker->name() << " is up";
  } else {
    DUET_LOG(WARNING) << worker->name() << " is down: " << reason;
  }
}

}  // namespace duet::router
