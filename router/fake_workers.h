// Test doubles of the internal PrefillWorker and DecodeWorker services, served in-process on a
// loopback port, with knobs for the failures the router must handle.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "duet/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace duet::router::testing {

class FakePrefillWorker final : public v1::PrefillWorker::Service {
 public:
  grpc::Status Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override;
  grpc::Status SetKvTarget(grpc::ServerContext* context, const v1::SetKvTargetRequest* request,
                           v1::SetKvTargetResponse* response) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::WorkerAbortRequest* request,
                     v1::WorkerAbortResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::WorkerStats* response) override;

  // Says it takes late KV targets (set before the router polls it): a Prefill with
  // target_follows waits for its SetKvTarget before it goes on (ABORTED by an Abort first).
  std::atomic<bool> late_kv_target{false};
  std::atomic<bool> fail_set_kv_target{false};  // SetKvTarget returns UNAVAILABLE
  // The process is gone: every call returns UNAVAILABLE, a Prefill waiting for its target once
  // its Abort has come (so that its SetKvTarget's failure, which sends that Abort, comes first).
  std::atomic<bool> gone{false};
  std::atomic<int> num_late_prefills{0};
  // The first token; for a migrated request (output_token_ids) first_token + their number.
  std::atomic<int> first_token{1000};
  // The reply's first_token_finish_reason: LENGTH (the request goes on past the token, so the
  // router may send it at once) or, when false, STOP.
  std::atomic<bool> first_token_continues{false};
  std::atomic<int> prefill_delay_ms{0};
  std::atomic<bool> fail_unavailable{false};  // Prefill returns UNAVAILABLE
  std::atomic<bool> fail_resumed{false};      // Prefill of a migrated request returns UNAVAILABLE
  std::atomic<int> stats_delay_ms{0};         // GetStats answers this late (a stalled worker)
  std::atomic<int> instance{1};               // WorkerStats.instance_id: another value is a restarted process
  std::atomic<int> num_prefills{0};
  std::atomic<int> num_cancelled{0};          // Prefill calls that saw their cancellation
  std::atomic<int> num_aborts_with_kv_target{0};
  // With sampling.prompt_logprobs K: entry i (prompt token i + 1) has logprob -(i + 1), rank
  // i + 2 and top ids 0..K-1; this many entries fewer (a broken worker).
  std::atomic<int> missing_prompt_logprobs{0};

  std::vector<int32_t> last_prompt() const;
  std::vector<int32_t> last_output_tokens() const;  // the last Prefill's output_token_ids
  std::vector<std::string> aborted() const;
  std::vector<uint64_t> targets_set() const;  // the transfer ids SetKvTarget brought, in order

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, v1::KvTarget> late_targets_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> targets_set_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> last_prompt_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> last_output_tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> aborted_ ABSL_GUARDED_BY(mu_);
};

// Decode streams first_token_id (local_first_token for a prefill_here call), then +1, ... (max_tokens in all), one token per
// message with text "t<i> " (and, with sampling.logprobs N, logprob -0.5 and top ids 0..N-1),
// the last one finished with "length" and usage. A migrated request (output_token_ids) gets the
// tokens after those, i counting on from them. With a script, the
// texts are the script's (one token each, at most max_tokens) and the last finishes with its reason.
class FakeDecodeWorker final : public v1::DecodeWorker::Service {
 public:
  void SetScript(std::vector<std::string> texts, std::string finish_reason);

  grpc::Status ReserveKv(grpc::ServerContext* context, const v1::ReserveKvRequest* request,
                         v1::ReserveKvResponse* response) override;
  grpc::Status Decode(grpc::ServerContext* context, const v1::DecodeRequest* request,
                      grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::WorkerAbortRequest* request,
                     v1::WorkerAbortResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::WorkerStats* response) override;

  std::atomic<int> token_delay_ms{0};
  // Says it takes DecodeRequest.prefill_here (set before the router polls it); such a call
  // streams from local_first_token. Without it, a prefill_here call fails as an older worker's
  // would (FAILED_PRECONDITION: no reservation for transfer id 0).
  std::atomic<bool> prefill_here{false};
  std::atomic<int> local_first_token{3000};
  std::atomic<int> num_prefilled_here{0};
  // While held, Decode keeps its first message back (ReleaseFirstMessage lets it go).
  void HoldFirstMessage();
  void ReleaseFirstMessage();
  // ReserveKv reserves after this long even if its call was cancelled meanwhile (as a worker
  // whose answer crosses the router's cancellation).
  std::atomic<int> reserve_delay_ms{0};
  // While set, Abort waits (as a call to a SIGSTOPped worker waits in its socket) and, once it is
  // cleared, drops a call whose client has given up meanwhile (as a resumed worker would).
  std::atomic<bool> stalled{false};
  std::atomic<bool> kv_full{false};           // ReserveKv returns RESOURCE_EXHAUSTED
  std::atomic<int> fail_after_tokens{-1};     // Decode returns UNAVAILABLE after this many tokens
  std::atomic<int> free_blocks{100};
  std::atomic<int> instance{1};  // WorkerStats.instance_id: another value is a restarted process
  std::atomic<int> num_reserved{0};
  std::atomic<int> last_reserved_tokens{0};   // the last ReserveKv's num_prompt_tokens
  std::atomic<int> num_decodes{0};
  std::atomic<int> num_tokens_sent{0};
  std::atomic<int> num_cancelled{0};          // Decode calls that saw their cancellation (or a failed write)
  std::atomic<bool> in_decode{false};

  std::vector<std::string> aborted() const;
  std::vector<bool> aborted_release_now() const;  // each Abort's release_now, in the same order
  std::vector<uint64_t> aborted_transfer_ids() const;  // each Abort's transfer_id, in the same order
  uint64_t last_transfer_id() const;
  std::vector<v1::SamplingOptions> decoded_sampling() const;  // each Decode's, in arrival order
  v1::DecodeRequest last_decode() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> aborted_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> aborted_release_now_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> aborted_transfer_ids_ ABSL_GUARDED_BY(mu_);
  uint64_t last_transfer_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<v1::SamplingOptions> decoded_sampling_ ABSL_GUARDED_BY(mu_);
  bool hold_first_message_ ABSL_GUARDED_BY(mu_) = false;
  v1::DecodeRequest last_decode_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> script_ ABSL_GUARDED_BY(mu_);
  std::string script_finish_reason_ ABSL_GUARDED_BY(mu_);
};

// A decode worker whose Decode stream goes wrong the way a broken or mismatched worker could: it
// sends `good_messages` valid tokens (first_token_id, +1, ...), then one bad message (`fault`), and
// then keeps the stream open without another word until the router cancels it.
class MalformedDecodeWorker final
    : public v1::DecodeWorker::WithRawCallbackMethod_Decode<v1::DecodeWorker::Service> {
 public:
  enum class Fault {
    kUnparsable,           // bytes that are no GenerateResponse
    kTokenOutOfVocabulary, // token id 1 << 30
    kUnknownFinishReason,  // finished with finish_reason "exploded"
  };

  grpc::Status ReserveKv(grpc::ServerContext* context, const v1::ReserveKvRequest* request,
                         v1::ReserveKvResponse* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Decode(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::WorkerAbortRequest* request,
                     v1::WorkerAbortResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::WorkerStats* response) override;

  std::atomic<Fault> fault{Fault::kUnparsable};
  std::atomic<int> good_messages{2};
  std::atomic<int> num_decodes{0};
  std::atomic<int> num_cancelled{0};  // Decode streams that ended by the router's cancellation

  std::vector<std::string> aborted() const;

 private:
  class Stream;
  mutable absl::Mutex mu_;
  std::vector<std::string> aborted_ ABSL_GUARDED_BY(mu_);
};

// A gRPC server for one fake service on 127.0.0.1 (port 0: any). A service object registers with
// one server only: to "restart" a worker, serve a new service object on the old port.
class FakeServer {
 public:
  explicit FakeServer(grpc::Service* service, int port = 0);
  ~FakeServer();
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void Stop(int grace_ms = 0);

 private:
  grpc::Service* service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace duet::router::testing
