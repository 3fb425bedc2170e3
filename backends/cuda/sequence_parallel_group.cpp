#include "backends/cuda/sequence_parallel_group.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/llama_cuda.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "kernels/elementwise/gather_rows.h"
#include "parallel/ring_schedule.h"
#include "parallel/zigzag.h"

namespace duet::cuda {
namespace {

cudaEvent_t NewEvent(int device) {
  ScopedDevice on(device);
  cudaEvent_t e = nullptr;
  DUET_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

// The most rows one rank holds for a prompt of `max_tokens` (two chunks of at most
// ceil(T / 2N) tokens).
int MaxRankRows(int max_tokens, int size) { return 2 * ((max_tokens + 2 * size - 1) / (2 * size)); }

}  // namespace

SequenceParallelGroup::SequenceParallelGroup(LlamaCuda& leader, std::vector<int> devices, int64_t min_tokens)
    : leader_(leader), devices_(std::move(devices)), min_tokens_(min_tokens) {}

SequenceParallelGroup::~SequenceParallelGroup() {
  // Whatever Init created (it may have stopped part way).
  for (size_t r = 0; r < written_.size(); ++r) {
    ScopedDevice on(devices_[r]);
    cudaEventDestroy(written_[r]);
    cudaEventDestroy(ring_done_[r]);
    for (size_t k = 0; k < received_.size(); ++k) {
      if (r < received_[k].size()) cudaEventDestroy(received_[k][r]);
      if (r < attended_[k].size()) cudaEventDestroy(attended_[k][r]);
    }
    if (r < stall_events_.size()) {
      for (auto [before, after] : stall_events_[r]) {
        cudaEventDestroy(before);
        cudaEventDestroy(after);
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<SequenceParallelGroup>> SequenceParallelGroup::Create(LlamaCuda& leader,
                                                                                     const std::vector<int>& devices,
                                                                                     int64_t min_tokens,
                                                                                     const std::string& transport) {
  DUET_CHECK(devices.size() >= 2 && devices[0] == leader.device());
  std::unique_ptr<SequenceParallelGroup> group(new SequenceParallelGroup(leader, devices, min_tokens));
  DUET_RETURN_IF_ERROR(group->Init(transport));
  return group;
}

absl::Status SequenceParallelGroup::Init(const std::string& transport) {
  const int n = int(devices_.size());
  const ModelConfig& c = leader_.config_;
  const int max_rows = MaxRankRows(leader_.options_.max_num_batched_tokens, n);
  DUET_ASSIGN_OR_RETURN(transport_, CreateRingTransport(transport, devices_));
  ranks_.push_back(&leader_);
  for (int r = 1; r < n; ++r) {
    // Rank r's K/V go into rank 0's cache.
    DUET_RETURN_IF_ERROR(EnablePeerAccess(devices_[size_t(r)], devices_[0]));
    DUET_ASSIGN_OR_RETURN(std::unique_ptr<LlamaCuda> rank, leader_.LoadRank(devices_[size_t(r)], max_rows));
    ranks_.push_back(rank.get());
    owned_.push_back(std::move(rank));
  }
  for (int r = 0; r < n; ++r) {
    LlamaCuda& m = *ranks_[size_t(r)];
    ScopedDevice on(devices_[size_t(r)]);
    DUET_ASSIGN_OR_RETURN(std::unique_ptr<RankRingAttention> ring,
                          RankRingAttention::Create(r, n, max_rows, int(c.num_heads), int(c.num_kv_heads),
                                                    int(c.head_dim), m.arena_, m.stream_));
    rings_.push_back(std::move(ring));
    written_.push_back(NewEvent(devices_[size_t(r)]));
    ring_done_.push_back(NewEvent(devices_[size_t(r)]));
  }
  stall_events_.resize(size_t(n));
  received_.resize(size_t(n));
  attended_.resize(size_t(n));
  for (int k = 0; k < n; ++k) {
    for (int r = 0; r < n; ++r) {
      received_[size_t(k)].push_back(NewEvent(devices_[size_t(r)]));
      attended_[size_t(k)].push_back(NewEvent(devices_[size_t(r)]));
    }
  }
  return absl::OkStatus();
}

bool SequenceParallelGroup::Takes(absl::Span<const SequenceChunk> chunks) const {
  if (chunks.size() != 1) return false;
  const SequenceChunk& chunk = chunks[0];
  const int n = size();
  const int64_t t = int64_t(chunk.tokens.size());
  if (chunk.start_position != 0 || !chunk.tree_parents.empty() || t < std::max<int64_t>(min_tokens_, 2 * n)) {
    return false;
  }
  // Rank 0 holds the last chunk: every logits row must lie in it.
  return chunk.num_logits <= parallel::ZigzagChunks(t, n).back().size();
}

absl::Status SequenceParallelGroup::Prepare(const SequenceChunk& chunk, int block_size,
                                            absl::Span<const DeviceSamplingRow> sampling, bool with_bitmasks) {
  const int n = size();
  const parallel::RingAttentionSchedule schedule = parallel::PlanRingAttention(int64_t(chunk.tokens.size()), n);
  const std::vector<int64_t> positions = schedule.RowPositions();
  rows_.assign(size_t(n), 0);
  for (int r = 0; r < n; ++r) {
    LlamaCuda& m = *ranks_[size_t(r)];
    ScopedDevice on(devices_[size_t(r)]);
    if (m.metadata_ == nullptr || m.metadata_->block_size() != block_size) {
      DUET_RETURN_IF_ERROR(m.CreateStepMetadata(block_size));
    }
    const int64_t first = schedule.rank_rows[size_t(r)], end = schedule.rank_rows[size_t(r) + 1];
    DUET_ASSIGN_OR_RETURN(const StepPlan plan,
                          m.metadata_->PlanRows(chunk, absl::MakeConstSpan(positions).subspan(size_t(first),
                                                                                              size_t(end - first))));
    if (r > 0 && plan.num_logit_rows > 0) return absl::InternalError("logits rows outside rank 0's shard");
    if (r == 0 && !sampling.empty() && size_t(plan.num_logit_rows) != sampling.size()) {
      return absl::InvalidArgumentError(absl::StrCat("device sampling needs one row per logits row (",
                                                     plan.num_logit_rows, " rows, ", sampling.size(), " given)"));
    }
    rows_[size_t(r)] = plan.num_tokens;
    m.metadata_->Upload(plan, r == 0 ? sampling : absl::Span<const DeviceSamplingRow>{}, m.stream_, with_bitmasks);
    if (r == 0) leader_plan_ = plan;
    DUET_RETURN_IF_ERROR(rings_[size_t(r)]->Prepare(schedule));
  }
  return absl::OkStatus();
}

absl::Status SequenceParallelGroup::EnqueueLayer(int layer, DeviceKvCache& cache, const LayerDoneCallback& on_layer_done,
                                         absl::Span<const SequenceChunk> chunks) {
  const int n = size();
  const kernels::PagedKvView kv = cache.Layer(layer);
  for (int r = 0; r < n; ++r) {
    LlamaCuda& m = *ranks_[size_t(r)];
    ScopedDevice on(devices_[size_t(r)]);
    const CudaLayerWeights& l = m.weights_->layer(size_t(layer));
    if (layer == 0) {
      kernels::EmbeddingGather(m.metadata_->tokens(), m.weights_->embed(), m.residual_.as<float>(), rows_[size_t(r)],
                               int(m.config_.hidden_size), m.stream_);
    } else {
      // The next rank has read this rank's send block of the layer before.
      DUET_CHECK_CUDA(cudaStreamWaitEvent(m.stream_, ring_done_[size_t((r + 1) % n)]));
    }
    const kernels::PagedKvView send = rings_[size_t(r)]->send_view();
    m.EnqueueAttentionInput(l, layer == 0, rows_[size_t(r)], kv, {&send, rings_[size_t(r)]->send_slots()});
    DUET_CHECK_CUDA(cudaEventRecord(written_[size_t(r)], m.stream_));
  }
  // Rank 0's cache holds the whole layer once its stream passes these waits.
  for (int r = 1; r < n; ++r) DUET_CHECK_CUDA(cudaStreamWaitEvent(leader_.stream_, written_[size_t(r)]));
  if (on_layer_done) on_layer_done(int64_t(layer), chunks);
  DUET_RETURN_IF_ERROR(EnqueueRing(layer));
  const bool last = layer + 1 == int(leader_.weights_->num_layers());
  for (int r = 0; r < n; ++r) {
    if (last && r > 0) continue;  // only rank 0's rows give logits
    LlamaCuda& m = *ranks_[size_t(r)];
    ScopedDevice on(devices_[size_t(r)]);
    const CudaLayerWeights& l = m.weights_->layer(size_t(layer));
    const LlamaCuda::LayerRows rows = last ? m.LastLayerRows(leader_plan_) : LlamaCuda::AllRows(rows_[size_t(r)]);
    m.EnqueueAttentionOutput(l, rows);
    m.EnqueueMlp(l, rows);
  }
  return absl::OkStatus();
}

absl::Status SequenceParallelGroup::EnqueueRing(int layer) {
  const int n = size();
  const float scale = 1.0f / std::sqrt(float(leader_.config_.head_dim));
  auto attend = [&](int step) {
    for (int r = 0; r < n; ++r) {
      LlamaCuda& m = *ranks_[size_t(r)];
      ScopedDevice on(devices_[size_t(r)]);
      if (step > 0) RecordStall(r, m.stream_, received_[size_t(step)][size_t(r)]);
      rings_[size_t(r)]->AttendStep(step, m.q_.as<__nv_bfloat16>(), scale);
      DUET_CHECK_CUDA(cudaEventRecord(attended_[size_t(step)][size_t(r)], m.stream_));
    }
  };
  attend(0);
  std::vector<std::array<void*, 2>> held(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
  for (int k = 1; k < n; ++k) {
    for (int r = 0; r < n; ++r) {
      const cudaStream_t comm = transport_->stream(r);
      const size_t prev = size_t((r + n - 1) % n), next = size_t((r + 1) % n);
      // Sources: the blocks ranks r - 1 (copies) and r (NCCL-style sends) hold at step k - 1.
      for (size_t s : {prev, size_t(r)}) {
        DUET_CHECK_CUDA(cudaStreamWaitEvent(comm, k == 1 ? written_[s] : received_[size_t(k - 1)][s]));
      }
      if (k == 1 && layer > 0) {  // the buffers' readers of the layer before
        DUET_CHECK_CUDA(cudaStreamWaitEvent(comm, ring_done_[size_t(r)]));
        DUET_CHECK_CUDA(cudaStreamWaitEvent(comm, ring_done_[next]));
      }
      if (k >= 3) {  // recv[k % 2] was read at step k - 2 here and copied on at step k - 1 by the next rank
        DUET_CHECK_CUDA(cudaStreamWaitEvent(comm, attended_[size_t(k - 2)][size_t(r)]));
        DUET_CHECK_CUDA(cudaStreamWaitEvent(comm, received_[size_t(k - 1)][next]));
      }
      held[size_t(r)] = rings_[size_t(r)]->held(k - 1);
      recv[size_t(r)] = rings_[size_t(r)]->recv(k);
    }
    DUET_RETURN_IF_ERROR(transport_->EnqueueStep(held, recv, rings_[0]->block_bytes()));
    for (int r = 0; r < n; ++r) {
      ScopedDevice on(devices_[size_t(r)]);
      DUET_CHECK_CUDA(cudaEventRecord(received_[size_t(k)][size_t(r)], transport_->stream(r)));
    }
    attend(k);
  }
  for (int r = 0; r < n; ++r) {
    LlamaCuda& m = *ranks_[size_t(r)];
    ScopedDevice on(devices_[size_t(r)]);
    rings_[size_t(r)]->WriteOutput(m.attn_.as<__nv_bfloat16>());
    DUET_CHECK_CUDA(cudaEventRecord(ring_done_[size_t(r)], m.stream_));
  }
  return absl::OkStatus();
}

void SequenceParallelGroup::RecordStall(int rank, cudaStream_t stream, cudaEvent_t wait_for) {
  if (!measure_exposed_) {
    DUET_CHECK_CUDA(cudaStreamWaitEvent(stream, wait_for));
    return;
  }
  auto& pairs = stall_events_[size_t(rank)];
  if (stalls_used_ >= pairs.size()) {
    std::pair<cudaEvent_t, cudaEvent_t> pair;
    DUET_CHECK_CUDA(cudaEventCreate(&pair.first));
    DUET_CHECK_CUDA(cudaEventCreate(&pair.second));
    pairs.push_back(pair);
  }
  DUET_CHECK_CUDA(cudaEventRecord(pairs[stalls_used_].first, stream));
  DUET_CHECK_CUDA(cudaStreamWaitEvent(stream, wait_for));
  DUET_CHECK_CUDA(cudaEventRecord(pairs[stalls_used_].second, stream));
  if (rank + 1 == size()) ++stalls_used_;
}

void SequenceParallelGroup::CollectExposed() {
  exposed_ = {};
  exposed_.step_bytes = 2 * rings_[0]->block_bytes();
  for (int r = 0; r < size(); ++r) {
    double ms = 0;
    for (size_t i = 0; i < stalls_used_; ++i) {
      float e = 0;
      DUET_CHECK_CUDA(cudaEventElapsedTime(&e, stall_events_[size_t(r)][i].first, stall_events_[size_t(r)][i].second));
      ms += e;
    }
    exposed_.max_rank_ms = std::max(exposed_.max_rank_ms, ms);
    exposed_.mean_rank_ms += ms / size();
  }
  stalls_used_ = 0;
}

absl::Status SequenceParallelGroup::SynchronizeRanks() {
  for (int r = 1; r < size(); ++r) {
    ScopedDevice on(devices_[size_t(r)]);
    DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(ranks_[size_t(r)]->stream_),
                                    "sequence-parallel rank"));
    DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(transport_->stream(r)), "sequence-parallel ring"));
  }
  return CudaStatus(cudaStreamSynchronize(transport_->stream(0)), "sequence-parallel ring");
}

absl::Status SequenceParallelGroup::Prefill(absl::Span<const SequenceChunk> chunks, DeviceKvCache& cache,
                                            absl::Span<const DeviceSamplingRow> sampling,
                                            const LayerDoneCallback& on_layer_done, std::vector<float>* logits,
                                            std::vector<DeviceSample>* samples, const FillMasksCallback& fill_masks) {
  DUET_CHECK(Takes(chunks));
  const bool sample = samples != nullptr;
  const bool masks_later = sample && fill_masks != nullptr;
  ScopedDevice on(devices_[0]);
  cache.FlushSlotMoves();
  DUET_RETURN_IF_ERROR(Prepare(chunks[0], int(cache.shape().block_size), sampling, !masks_later));
  if (!sample) logits->resize(size_t(leader_plan_.num_logit_rows) * size_t(leader_.config_.vocab_size));
  for (int layer = 0; layer < int(leader_.weights_->num_layers()); ++layer) {
    if (absl::Status s = EnqueueLayer(layer, cache, on_layer_done, chunks); !s.ok()) {
      const absl::Status synced = SynchronizeRanks();  // nothing of this step may run on after it
      DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(leader_.stream_), "sequence-parallel rank 0"));
      DUET_RETURN_IF_ERROR(synced);
      return s;
    }
  }
  leader_.EnqueueFinalNorm(leader_plan_, sample, leader_.LastLayerRows(leader_plan_));
  if (masks_later) {
    fill_masks();
    leader_.metadata_->UploadBitmasks(sampling, leader_.stream_);
  }
  absl::Status head = leader_.EagerHead(leader_plan_, sample, logits);
  if (head.ok() && sample) head = leader_.CopySamplesToHost(leader_plan_.num_logit_rows, *samples);
  // The ranks' metadata buffers are rewritten by the next step: they must be done with them.
  const absl::Status ranks = SynchronizeRanks();
  DUET_RETURN_IF_ERROR(head);
  DUET_RETURN_IF_ERROR(ranks);
  if (measure_exposed_) CollectExposed();
  return absl::OkStatus();
}

}  // namespace duet::cuda
