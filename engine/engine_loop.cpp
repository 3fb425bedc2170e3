#include "engine/engine_loop.h"

#include <chrono>

#include "common/logging.h"

namespace duet {

EngineLoop::EngineLoop(std::unique_ptr<LlmEngine> engine, LayerDoneCallback on_layer_done,
                       StepDoneCallback on_step_done)
    : engine_(std::move(engine)), on_layer_done_(std::move(on_layer_done)), on_step_done_(std::move(on_step_done)) {
  stats_ = engine_->Stats();
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void EngineLoop::Post(std::function<void(LlmEngine&)> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

void EngineLoop::Subscribe(const std::string& id, OutputCallback callback) {
  subscribers_[id] = std::move(callback);
}

void EngineLoop::Unsubscribe(const std::string& id) { subscribers_.erase(id); }

void EngineLoop::Abort(const std::string& id) {
  Post([this, id](LlmEngine&) { AbortOnLoop(id); });
}

void EngineLoop::AbortOnLoop(const std::string& id) {
  if (!engine_->Abort(id)) return;
  RequestOutput out{id};
  out.finished = true;
  out.finish_reason = FinishReason::kAbort;
  Deliver(out);
}

void EngineLoop::Deliver(const RequestOutput& out) {
  auto it = subscribers_.find(out.id);
  if (it != subscribers_.end()) {
    OutputCallback callback = it->second;
    if (out.finished) subscribers_.erase(it);
    callback(out);
  }
  if (out.finished) engine_->Release(out.id);
}

EngineStats EngineLoop::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void EngineLoop::Run() {
  for (;;) {
    // Late scheduling: what is posted while the launched step's first half runs joins the next step.
    engine_->WaitForSchedulingPoint();
    std::vector<std::function<void(LlmEngine&)>> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto ready = [&] { return stopping_ || !pending_.empty() || engine_->HasUnfinished(); };
      // Idle: the engine's deferred work runs in slices until it is done or work arrives.
      while (!ready() && idle_work_left_) {
        lock.unlock();
        idle_work_left_ = engine_->RunIdleWork();
        lock.lock();
      }
      cv_.wait(lock, ready);
      if (stopping_) return;
      work.swap(pending_);
    }
    using Clock = std::chrono::steady_clock;
    const Clock::time_point posted_start = Clock::now();
    for (auto& fn : work) fn(*engine_);
    if (!work.empty()) posted_seconds_ += std::chrono::duration<double>(Clock::now() - posted_start).count();
    if (engine_->HasUnfinished()) {
      idle_work_left_ = true;  // a step may leave work for the next idle time
      absl::StatusOr<std::vector<RequestOutput>> outputs = engine_->Step(on_layer_done_);
      if (!outputs.ok()) {
        DUET_LOG(ERROR) << "engine step failed: " << outputs.status().message();
      } else {
        const Clock::time_point delivery_start = Clock::now();
        if (on_step_done_ && engine_->last_step_num_tokens() > 0) on_step_done_(engine_->last_step_num_tokens());
        for (const RequestOutput& out : *outputs) Deliver(out);
        delivery_seconds_ += std::chrono::duration<double>(Clock::now() - delivery_start).count();
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    stats_ = engine_->Stats();
    stats_.delivery_seconds = delivery_seconds_;
    stats_.posted_seconds = posted_seconds_;
  }
}

}  // namespace duet

