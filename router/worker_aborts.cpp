#include "router/worker_aborts.h"

#include <chrono>

#include "common/logging.h"

namespace duet::router {

struct WorkerAborts::Pending {
  Worker* worker = nullptr;
  v1::WorkerAbortRequest request;
  v1::WorkerAbortResponse response;
  absl::Time give_up_at;
  int attempts = 0;
  std::unique_ptr<grpc::ClientContext> context;  // the attempt in flight
};

WorkerAborts::WorkerAborts(absl::Duration give_up_after, int max_attempts)
    : give_up_after_(give_up_after), max_attempts_(max_attempts) {}

WorkerAborts::~WorkerAborts() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  for (auto& [raw, p] : pending_) {
    // (Attempt cancels one it has not made yet; one made but not started is cancelled once it starts.)
    if (p->context != nullptr) p->context->TryCancel();
  }
  mu_.Await(absl::Condition(
      +[](absl::flat_hash_map<Pending*, std::unique_ptr<Pending>>* pending) { return pending->empty(); }, &pending_));
}

int WorkerAborts::pending() const {
  absl::MutexLock lock(&mu_);
  return int(pending_.size());
}

void WorkerAborts::Send(Worker* worker, v1::WorkerAbortRequest request) {
  if (worker == nullptr) return;
  auto p = std::make_unique<Pending>();
  p->worker = worker;
  p->request = std::move(request);
  p->give_up_at = absl::Now() + give_up_after_;
  Pending* raw = p.get();
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    pending_.emplace(raw, std::move(p));
  }
  Attempt(raw);
}

void WorkerAborts::Attempt(Pending* p) {
  grpc::ClientContext* context;
  {
    absl::MutexLock lock(&mu_);
    p->context = std::make_unique<grpc::ClientContext>();
    p->context->set_deadline(absl::ToChronoTime(p->give_up_at));
    // A worker whose connection is down (refused, or broken while it was stalled) gets the call
    // once it is back, not an immediate UNAVAILABLE.
    p->context->set_wait_for_ready(true);
    if (stopping_) p->context->TryCancel();
    ++p->attempts;
    context = p->context.get();
  }
  // The callback may run before Abort returns: nothing of `p` is touched after the call.
  auto done = [this, p](grpc::Status status) { OnDone(p, status); };
  if (p->worker->prefill() != nullptr) {
    p->worker->prefill()->async()->Abort(context, &p->request, &p->response, std::move(done));
  } else {
    p->worker->decode()->async()->Abort(context, &p->request, &p->response, std::move(done));
  }
}

void WorkerAborts::OnDone(Pending* p, const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    // UNAVAILABLE: the connection broke after the call went out (a stalled worker whose keepalive
    // failed, a worker restarted); the next attempt waits for the channel to be ready again.
    const bool again = status.error_code() == grpc::StatusCode::UNAVAILABLE && !stopping_ &&
                       p->attempts < max_attempts_ && absl::Now() < p->give_up_at;
    if (!again) {
      if (!status.ok() && !stopping_) {
        DUET_LOG(WARNING) << "router: Abort of request '" << p->request.request_id() << "' on " << p->worker->name()
                          << " failed after " << p->attempts << " attempt(s): " << status.error_message()
                          << "; its KV lease releases what it holds";
      }
      pending_.erase(p);  // the context too: its callback is this one, and the last
      return;
    }
  }
  Attempt(p);
}

}  // namespace duet::router
