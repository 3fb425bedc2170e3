// Runs an LlmEngine on its own thread, for servers: other threads hand it work as closures
// that run between steps, and subscribe to a request's outputs. The engine itself stays
// single-threaded; everything that touches it runs on the loop thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/llm_engine.h"

namespace duet {

class EngineLoop {
 public:
  using OutputCallback = std::function<void(const RequestOutput&)>;

  // After each step that ran a forward pass, with its number of tokens (on the loop thread).
  using StepDoneCallback = std::function<void(int64_t num_tokens)>;
  // `on_layer_done` (optional) is passed to every Step; `on_step_done` (optional) follows each.
  explicit EngineLoop(std::unique_ptr<LlmEngine> engine, LayerDoneCallback on_layer_done = nullptr,
                      StepDoneCallback on_step_done = nullptr);
  ~EngineLoop();  // stops the thread; pending closures are dropped
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Runs `fn` on the loop thread before the next step.
  void Post(std::function<void(LlmEngine&)> fn);
  // Runs `fn` on the loop thread and waits for its result.
  template <typename Fn>
  auto Call(Fn fn) -> decltype(fn(std::declval<LlmEngine&>())) {
    using R = decltype(fn(std::declval<LlmEngine&>()));
    auto promise = std::make_shared<std::promise<R>>();
    std::future<R> result = promise->get_future();
    Post([promise, fn = std::move(fn)](LlmEngine& e) mutable {
      if constexpr (std::is_void_v<R>) {
        fn(e);
        promise->set_value();
      } else {
        promise->set_value(fn(e));
      }
    });
    return result.get();
  }

  // Delivers each RequestOutput of request `id` to `callback` on the loop thread. After the
  // finishing output the subscription ends and the engine releases the request. Subscribe on the
  // loop thread (inside Post/Call) right after adding the request, so no output is missed.
  // Unsubscribe must also run on the loop thread.
  void Subscribe(const std::string& id, OutputCallback callback);
  void Unsubscribe(const std::string& id);

  // Aborts request `id` (if it is still running): its subscriber gets a finishing output with
  // reason abort, and its blocks are freed. Safe from any thread.
  void Abort(const std::string& id);

  // A snapshot of the engine's counters, readable from any thread.
  EngineStats Stats() const;

 private:
  void Run();
  void AbortOnLoop(const std::string& id);
  void Deliver(const RequestOutput& out);

  std::unique_ptr<LlmEngine> engine_;
  LayerDoneCallback on_layer_done_;
  StepDoneCallback on_step_done_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void(LlmEngine&)>> pending_;  // guarded by mu_
  bool stopping_ = false;                                 // guarded by mu_
  EngineStats stats_;                                     // guarded by mu_
  bool idle_work_left_ = false;  // the engine may have idle work (loop thread only)
  double delivery_seconds_ = 0;  // EngineStats' (loop thread only)
  double posted_seconds_ = 0;    // EngineStats' (loop thread only)
  std::map<std::string, OutputCallback> subscribers_;     // loop thread only
  std::thread thread_;
};

}  // namespace duet
