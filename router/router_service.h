// The public duet.v1.Duet service: validates and tokenizes requests (a chat through the model's
// chat template, its tool calls parsed in the response: router/grpc_chat.h; n > 1 is served in
// front of it, router/choices_service.h), admits them up to a limit, places each on a decode
// worker (KV reservation) and a prefill worker, and relays the decode worker's token stream to the
// client. The client's deadline and cancellation reach every
// downstream call; Abort(request_id) cancels a request wherever it is.
//
// Everything runs on gRPC's callback API, on both sides: a request in flight is a reactor and a
// chain of callbacks, never a waiting thread, so thousands of open streams cost memory only.
//
// One request:
//   (wait in the router while max_prefill_tokens_per_worker × prefill workers up are prefilling)
//   decode.ReserveKv (next decode worker on RESOURCE_EXHAUSTED / UNAVAILABLE)
//   prefill.Prefill  (on UNAVAILABLE: the worker is marked down, the reservation released, and
//                     the request placed once more on another prefill worker with a fresh one;
//                     the release waits for the lease while the worker, not answering, may only
//                     be stalled with writes still to make, or until a poll finds it gone)
//   decode.Decode    (streamed to the client; when the stream breaks, UNAVAILABLE or with its
//                     worker confirmed down, the worker is marked down and the request migrates)
// Conditional disaggregation (RouterServiceOptions::local_prefill_max_tokens): a prompt with little
// to compute that arrives while the prefill workers are busy skips ReserveKv and Prefill; its Decode call carries
// prefill_here, and the decode worker prefills it in its own batch.
// Request migration: the request is placed again, the prompt and the output already relayed to
// the client as the new pair's prefill (ReserveKv for both, Prefill and Decode with
// output_token_ids, worker.proto), and the client's stream goes on from the next token: no token
// lost or repeated, the workers rebuilding the request's state from those tokens (the same greedy
// output; a seeded one continues its draws: engine/llm_engine.h, ResumedOutput). At most
// max_request_migrations times a request; when no pair can take it the client gets UNAVAILABLE
// saying so. duet:request_migrations_total{outcome} counts them.
// Workers' replies are parsed and checked here, not by the generated stubs: a reply or stream
// message that is not a valid message (or names tokens outside the vocabulary, an unknown finish
// reason, ...) ends the request at once with INTERNAL and releases what it holds on the workers.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "duet/v1/duet.grpc.pb.h"
#include "engine/sampling_params.h"
#include "frontend/tokenizer/tokenizer.h"
#include "metrics/registry.h"
#include "metrics/vllm_metrics.h"
#include "router/assignment_policy.h"
#include "router/openai_protocol.h"
#include "router/worker_aborts.h"
#include "router/worker_registry.h"

namespace duet::router {

struct RouterServiceOptions {
  std::string model_name;
  int64_t vocab_size = 0;     // token ids must be in [0, vocab_size)
  int64_t max_model_len = 0;  // prompt + max_tokens must fit
  // Requests placed on workers or waiting for their turn at the prefill workers, at most; the
  // next ones wait in the router's queue, in arrival order, up to max_queued_requests (counted
  // in num_requests_waiting). Beyond that a request is refused with RESOURCE_EXHAUSTED (HTTP 429).
  int max_concurrent_requests = 256;
  int max_queued_requests = 1024;
  int kv_lease_ms = 30000;
  absl::Duration reserve_timeout = absl::Seconds(10);   // ReserveKv
  absl::Duration prefill_timeout = absl::Seconds(600);  // Prefill (liveness comes from keepalive)
  // A worker Abort during clean-up is retried for this long, or for the KV lease when that is longer
  // (router/worker_aborts.h): a worker stalled meanwhile still gets it once it is back.
  absl::Duration abort_timeout = absl::Seconds(1);
  // How often a request whose decode worker fails mid-stream moves to another prefill/decode pair
  // (see the top of this file); 0: it fails with UNAVAILABLE.
  int max_request_migrations = 1;
  // Send Prefill together with ReserveKv, the KV target following in SetKvTarget, to prefill
  // workers that take a late target (WorkerStats.late_kv_target): the reservation's round trip
  // overlaps the prefill instead of adding to the time to first token. False: one after the other.
  bool overlap_kv_reservation = true;
  // Conditional disaggregation (as NVIDIA Dynamo's disaggregated router): a prompt with at most
  // local_prefill_max_tokens tokens to compute (those past what the prefix index predicts its
  // decode worker has cached: a chat's earlier turns) is prefilled by its decode worker, in that
  // worker's own batch beside the decoding requests (DecodeRequest.prefill_here: no prefill
  // worker, no KV transfer), when the prefill workers are busy: at least local_prefill_queue_tokens
  // prompt tokens per prefill worker up are reserving, prefilling or waiting for their turn (0:
  // whatever their load), or none is up. Not for a request that asks for prompt logprobs or
  // continues a migrated output.
  // 0 (the default): every prompt goes to a prefill worker.
  int64_t local_prefill_max_tokens = 0;
  int64_t local_prefill_queue_tokens = 0;
  // Prompt tokens of the requests between their KV reservation and the end of their prefill, per
  // prefill worker up (a request alone may exceed it). The others wait in the router, in arrival
  // order, before reserving: a reservation is not held, nor its lease spent, while a long queue at
  // the prefill worker drains. 4× the workers' default max_num_batched_tokens keeps their batches full.
  int64_t max_prefill_tokens_per_worker = 8192;
  // Where the router's metrics (role "router") are registered; null: a registry of its own.
  metrics::Registry* metrics_registry = nullptr;
  // Learns what each placement leaves in the workers' KV caches (router/prefix_index.h): the
  // prompt on the prefill worker when it is placed there, the prompt on the decode worker when it
  // reserves the KV, and the prompt and output there when the stream finishes. Null: none (and
  // duet:routed_prompt_blocks_cached_total stays 0).
  PrefixIndex* prefix_index = nullptr;
  // A request's `chat`: rendered with this template (null: chat is INVALID_ARGUMENT), tool_choice
  // "auto" parsing calls in auto_tool_call_format (unset: "auto" is INVALID_ARGUMENT), as HTTP's
  // chat completions (router/grpc_chat.h).
  const LoadedChatTemplate* chat_template = nullptr;
  std::optional<openai::ToolCallFormat> auto_tool_call_format;
};

class RouterService final : public v1::Duet::CallbackService {
 public:
  // `tokenizer` may be null (then text prompts are rejected). All pointers outlive the service.
  RouterService(RouterServiceOptions options, const Tokenizer* tokenizer, WorkerRegistry* registry,
                AssignmentPolicy* policy);
  // Waits until every request has ended and released its workers (stop the server first).
  ~RouterService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request, v1::ModelInfo* response) override;

  // Requests admitted (queued included) and not yet ended.
  int num_in_flight() const { return in_flight_.load(std::memory_order_acquire); }
  const metrics::RouterMetrics& metrics() const { return *metrics_; }
  metrics::RouterMetrics& metrics() { return *metrics_; }
  metrics::Registry& metrics_registry() { return *metrics_registry_; }

  // A request after validation: what the workers are sent.
  struct Prepared {
    std::string client_request_id;  // what the client gave, or the id made for it; echoed back
    std::string request_id;         // what the workers are sent (unique among all clients')
    std::vector<int32_t> prompt_token_ids;
    SamplingParams params;
    v1::SamplingOptions sampling;  // `params` written out in full
    openai::ToolCalling tools;     // a chat's: the tool calls its output is parsed for
  };
  // Validation and tokenization alone (InvalidArgument with a clear message).
  absl::StatusOr<Prepared> Prepare(const v1::GenerateRequest& request) const;

  // One in-flight request, as Abort sees it.
  class ActiveCall;

 private:
  class GenerateCall;  // the reactor of one Generate and its downstream calls
  class PrefillGate;   // the bound on requests reserving and prefilling at once
  class AdmissionQueue;  // max_concurrent_requests and the queue behind it

  uint64_t NewTransferId();
  // GenerateCall objects alive (each may still have calls to workers in flight).
  void CallCreated();
  void CallDestroyed();

  const RouterServiceOptions options_;
  const Tokenizer* const tokenizer_;
  openai::ProtocolContext chat_context_;  // for PrepareChat
  WorkerRegistry* const registry_;
  AssignmentPolicy* const policy_;

  std::atomic<int> in_flight_{0};
  std::atomic<uint64_t> next_transfer_id_;

  std::unique_ptr<metrics::Registry> own_metrics_registry_;  // when the options give none
  metrics::Registry* metrics_registry_;
  std::unique_ptr<metrics::RouterMetrics> metrics_;
  std::unique_ptr<AdmissionQueue> admission_;
  std::unique_ptr<PrefillGate> prefill_gate_;

  absl::Mutex mu_;
  // By (client, client's request id); see the top of this file.
  absl::flat_hash_map<std::pair<std::string, std::string>, std::shared_ptr<ActiveCall>> active_ ABSL_GUARDED_BY(mu_);
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;
  // Last: let go first, once every call has ended; cancels the aborts still pending when the last
  // holder lets go (the registry holds it for releases it sends once a worker is found gone,
  // until it stops).
  std::shared_ptr<WorkerAborts> aborts_;
};

}  // namespace duet::router
